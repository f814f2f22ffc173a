"""Opening the weights a run starts from (``train.init_from``): a run, a checkpoint or a Hugging Face folder.

This is the one place where training meets the formats of other tools: train/ adopts what `open_source` returns
(train/init_from.py) and never reads a Hugging Face folder itself, so train/ does not depend on compat/. A run or
checkpoint directory gives its newest valid checkpoint and the tokenizer recorded with it; a Hugging Face folder is
read as `scratchlm import hf` reads it (compat/hf_import.py), its tokenizer too when our encoder matches it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from scratchlm.errors import UserError
from scratchlm.model.config import ModelConfig
from scratchlm.train.checkpoint_state import load_model_state

if TYPE_CHECKING:
    from scratchlm.tokenizer.tokenizer import Tokenizer


@dataclass
class InitSource:
    """What train.init_from names, read once: the weights (CPU tensors), their model config, the tokenizer."""

    model: ModelConfig
    weights: dict[str, torch.Tensor]  # emptied by load_into: training needs the memory more than this copy
    tokenizer: Path | None  # the source's tokenizer directory (None: it has none to copy)
    tokenizer_hash: str | None  # the tokenizer it was trained with (None: unrecorded)
    where: str  # "train.init_from PATH", for messages
    read_tokenizer: Tokenizer | None = None  # the tokenizer in ``tokenizer``, as read here: the run need not read it

    def load_into(self, model: nn.Module) -> None:
        """Copy the weights into ``model`` (on its device, in its dtype) and let go of this copy."""
        load_model_state(model, self.weights, where=self.where)
        self.weights.clear()


def open_source(path: str | Path) -> InitSource:
    """Read train.init_from: a run or checkpoint directory, or a Hugging Face model folder."""
    from scratchlm.train.checkpoint import META_FILE

    path = Path(path)
    where = f"train.init_from {path}"
    if not path.exists():
        raise FileNotFoundError(f"{where} does not exist: give a run directory, a checkpoint directory or a "
                                f"Hugging Face model folder")
    if (path / META_FILE).is_file() or (path / "checkpoints").is_dir():
        return _from_run(path, where)
    if (path / "config.json").is_file():
        return _from_hf_folder(path, where)
    kind = "a file" if path.is_file() else "a folder with neither checkpoints/, meta.json nor config.json"
    raise UserError(f"{where} is {kind}: give a run directory, a checkpoint directory or a Hugging Face model "
                    f"folder (config.json + safetensors)")


def _from_run(path: Path, where: str) -> InitSource:
    from scratchlm.train.checkpoint import load_for_inference
    from scratchlm.train.tokenizer_identity import run_tokenizer_dir, tokenizer_for_run

    model, config = load_for_inference(path)  # a run's newest valid checkpoint, or this one; verified
    directory = run_tokenizer_dir(path, config)
    if directory is None:
        return InitSource(model.config, model.state_dict(), None, config.data.tokenizer_hash, where)
    tokenizer = tokenizer_for_run(path, config, None)  # refuses a copy that is not the recorded one
    return InitSource(model.config, model.state_dict(), directory, tokenizer.hash, where, tokenizer)


def _from_hf_folder(path: Path, where: str) -> InitSource:
    from scratchlm.compat.hf_import import DEFAULT_MAX_GIB, HF_PACKAGES, read_hf_model, read_hf_tokenizer
    from scratchlm.extras import require

    for package in HF_PACKAGES:
        require(package, "hf", "train.init_from a Hugging Face folder")
    model = read_hf_model(path, max_gib=DEFAULT_MAX_GIB)  # `import hf`'s size limit
    try:
        tokenizer = read_hf_tokenizer(path)
    except ValueError as error:  # UnsupportedHFTokenizer, or a malformed tokenizer.json
        raise UserError(f"{where}: its tokenizer cannot be used ({error}); `scratchlm import hf` keeps the "
                        f"weights without it, and a run made so can be the init_from with your data.tokenizer") \
            from None
    if tokenizer is None:
        return InitSource(model.config, model.state_dict(), None, None, where)
    return InitSource(model.config, model.state_dict(), path, tokenizer.hash, where, tokenizer)
