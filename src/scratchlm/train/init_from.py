"""Starting a run from existing weights: ``train.init_from`` (``scratchlm train --init-from PATH``).

PATH is a run directory (its newest valid checkpoint), a checkpoint directory, or a Hugging Face model folder
(read as ``import hf`` reads it). The run takes the weights and their model config, whole (the config's [model]
table does not apply), and the source's tokenizer as data.tokenizer (another one given is refused); the optimizer,
schedule, step counter, budget and seed start fresh. A model field the caller set on purpose (``stated``: the CLI's
``--set model.*``) must agree with the source's; ``stated=None`` states all of config.model, so a library caller
gets no silent replacement. On ``--resume`` with checkpoints the run's own model wins and the source is not read
(resolve.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from scratchlm.config import RunConfig
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


def adopt(config: RunConfig, source: InitSource, stated: Mapping[str, Any] | None) -> RunConfig:
    """``config`` with the source's model and tokenizer (see the module docstring)."""
    return with_tokenizer(with_model(config, source.model, source.where, stated), source)


def with_model(config: RunConfig, model: ModelConfig, where: str, stated: Mapping[str, Any] | None) -> RunConfig:
    """``config`` with ``model`` as its model, once each ``stated`` field agrees with it (None: all of config.model;
    ``where`` names the model's origin in the refusal)."""
    stated = dataclasses.asdict(config.model) if stated is None else stated
    if "preset" in stated:
        raise UserError(f"model.preset cannot be set with train.init_from: the model is that of {where}")
    for key, value in stated.items():
        if not _agrees(model, key, value):
            raise UserError(f"model.{key} = {value!r} conflicts with the model of {where} ({key} = "
                            f"{getattr(model, key)!r}): with train.init_from the model is the source's; leave "
                            f"model.{key} out")
    return dataclasses.replace(config, model=model)


def _agrees(model: ModelConfig, key: str, value: Any) -> bool:
    """Is ``key = value`` what ``model`` has? A value the config resolves to the model's agrees too (d_ff = none
    is the FFN kind's default size): compared after the config's own resolution."""
    if value == getattr(model, key):
        return True
    try:
        return dataclasses.replace(model, **{key: value}) == model
    except ValueError:
        return False


def with_tokenizer(config: RunConfig, source: InitSource) -> RunConfig:
    """``config`` whose data.tokenizer (and its hash) is the source's; another tokenizer given is refused."""
    from scratchlm.train.tokenizer_identity import short

    expected, data = source.tokenizer_hash, config.data
    if expected is None:
        return config  # the source records no tokenizer: the data settings stand
    given = {"data.tokenizer_hash": data.tokenizer_hash}
    if data.tokenizer:
        from scratchlm.tokenizer.tokenizer import Tokenizer

        given[f"data.tokenizer {data.tokenizer}"] = Tokenizer.load(data.tokenizer).hash
    for name, found in given.items():
        if found and found != expected:
            copy = f" ({source.tokenizer})" if source.tokenizer else ""
            raise UserError(f"{name} is tokenizer {short(found)}, but the model of {source.where} was trained with "
                            f"tokenizer {short(expected)}: leave data.tokenizer out to use that one{copy}, and "
                            f"encode the data with it")
    tokenizer = str(source.tokenizer) if source.tokenizer else data.tokenizer
    return dataclasses.replace(config, data=dataclasses.replace(data, tokenizer=tokenizer, tokenizer_hash=expected))
