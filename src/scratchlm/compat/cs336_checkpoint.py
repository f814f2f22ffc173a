"""Read a CS336-style checkpoint into our TransformerLM, to compare a student's model with ours.

The assignment's `run_save_checkpoint` writes `torch.save({"model": state_dict, "optimizer": ..., "iteration":
int})` with the reference state-dict names (`token_embeddings.weight`, `layers.{i}.attn.q_proj.weight`, ...,
`lm_head.weight`), which are ours too, so the weights load without a remap. The file holds no model shape: the
caller gives a `ModelConfig`. The file is read with `torch.load(weights_only=True)`: a checkpoint is data, and
a pickle that wants to run code is refused.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch

from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.train.checkpoint_state import load_model_state

# Wrappers that prefix every name of the state dict they save: torch.compile's OptimizedModule and DDP.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def read_cs336_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], int | None]:
    """(model state dict with wrapper prefixes removed, iteration or None) of a `torch.save`d checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no CS336 checkpoint file at {path}")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{path} is not a checkpoint torch.load(weights_only=True) can read: {first_line}") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        found = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"{path}: expected a dict with a 'model' state dict (as run_save_checkpoint writes), "
                         f"found {found}")
    iteration = saved.get("iteration")
    return strip_wrapper_prefixes(saved["model"]), int(iteration) if isinstance(iteration, int) else None


def strip_wrapper_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict as the bare module names it: students often save a compiled or DDP-wrapped model."""
    for prefix in WRAPPER_PREFIXES:
        if state and all(name.startswith(prefix) for name in state):
            state = {name.removeprefix(prefix): tensor for name, tensor in state.items()}
    return state


def load_cs336_model(path: str | os.PathLike, config: ModelConfig,
                     device: str | torch.device = "cpu") -> tuple[TransformerLM, int | None]:
    """(TransformerLM of shape `config` in eval mode holding the file's weights, the saved iteration). Missing,
    unexpected and wrongly shaped tensors are named in a one-line ValueError."""
    state, iteration = read_cs336_checkpoint(path)
    model = TransformerLM(config, device=device)
    load_model_state(model, state, where=str(path))
    return model.eval(), iteration
