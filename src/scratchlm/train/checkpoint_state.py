"""What a checkpoint holds and how it comes back: weights, optimizer state, RNG states (checkpoint.py decides where
they go). Every piece is a dict of contiguous CPU tensors, for safetensors, or a JSON-able value: no pickle.

- Weights are those of the plain module under any DDP/FSDP/``torch.compile`` wrapper (``unwrap``), checked by name
  and shape before loading (``load_model_state``). Tied tensors share memory, which safetensors refuses: each
  storage view is stored once and the other names kept as aliases in the file's metadata.
- The optimizer state is split into its tensors, keyed "{param index}.{name}", and a JSON remainder (param_groups,
  non-tensor values); JSON's lists become the tuples (betas) the optimizer was built with again.
- RNG states (python, numpy, torch CPU and CUDA) are JSON lists, so a resumed run draws the same numbers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

# ---- model weights ------------------------------------------------------------------------------------------

def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP/FSDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """``model.load_state_dict(state)`` after checking names and shapes, with errors naming the tensor."""
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint {where} does not fit this model: missing tensors {missing[:5]}, "
                         f"unexpected tensors {unexpected[:5]}")
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint {where} does not fit this model: parameter {name!r} has shape "
                             f"{tuple(state[name].shape)} in the checkpoint but {tuple(tensor.shape)} in the model")
    model.load_state_dict(state)


def model_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """CPU state dict with shared tensors stored once: (tensors, {alias name: stored name})."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in unwrap(model).state_dict().items():
        storage = tensor.untyped_storage().data_ptr()
        view = (storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
        if view in seen:
            aliases[name] = seen[view]
            continue
        seen[view] = name
        # .clone() for views of a larger storage: safetensors refuses tensors that share memory.
        tensors[name] = tensor.detach().cpu().contiguous().clone()
    return tensors, aliases


def read_model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Read model.safetensors back into a full state dict (aliases filled in)."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    tensors = load_file(str(path), device="cpu")
    for alias, stored in json.loads(metadata.get("aliases", "{}")).items():
        tensors[alias] = tensors[stored]
    return tensors


# ---- optimizer state ----------------------------------------------------------------------------------------

def optimizer_parts(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state dict into safetensors-able tensors and a JSON-able remainder."""
    state_dict = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, param_state in state_dict["state"].items():
        for name, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def optimizer_state_from_parts(tensors: dict[str, torch.Tensor], rest: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = tensor
    for index, values in rest["scalars"].items():
        state.setdefault(int(index), {}).update(values)
    return {"state": state, "param_groups": [with_tuples(group) for group in rest["param_groups"]]}


def with_tuples(group: dict[str, Any]) -> dict[str, Any]:
    """A param group whose lists, but ``params``, are tuples again: JSON (and torch.distributed's full state dict)
    turn tuples (betas) into lists, and optimizers expect the tuples they were built with."""
    return {k: v if k == "params" or not isinstance(v, list) else tuple(v) for k, v in group.items()}


# ---- RNG states ---------------------------------------------------------------------------------------------

def capture_rng_state() -> dict[str, Any]:
    """JSON-able RNG states of python ``random``, numpy's global generator, torch CPU and every CUDA device."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng_state``; CUDA states are restored only when CUDA is available here."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = [torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]]
        torch.cuda.set_rng_state_all(cuda_states[:torch.cuda.device_count()])
