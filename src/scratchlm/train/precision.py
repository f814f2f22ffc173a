"""``train.dtype = "auto"``: bf16 autocast where the hardware has bf16 arithmetic, else fp32.

Why: bf16 autocast multiplies at about twice fp32's rate on hardware with bf16 units (CUDA GPUs since Ampere,
CPUs with AVX512-BF16 or AMX) and many times slower where bf16 is emulated (AVX2-only CPUs), while the loss a
step buys is nearly the same (figures: docs/recipes.md). Under a time budget more steps is more quality. The
hardware answers the question, so nothing is timed: a budget is spent training, not probing a dtype the CPU
cannot run. The choice is the run's: config.toml records the dtype it took, so a resume (and every rank under
torch.distributed) trains the same one.
"""

from __future__ import annotations

import torch

from scratchlm.model.kernels import cpu


def has_bf16_arithmetic(device: torch.device) -> tuple[bool, str]:
    """(whether `device` multiplies in bf16 natively rather than emulating it, the device named): the one rule
    behind train.dtype = auto and Muon's Newton-Schulz dtype (optim.muon_ns_dtype = auto)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False), torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return cpu.has_native_bf16(), cpu.describe()
    return False, f"{device.type} (bf16 speed unknown)"


def choose_dtype(device: torch.device) -> tuple[str, str]:
    """(the dtype for train.dtype = auto on `device`, a line saying why)."""
    native, where = has_bf16_arithmetic(device)
    chosen = "bf16" if native else "fp32"
    why = "has bf16 arithmetic" if native else "has no bf16 arithmetic (it would be emulated)"
    return chosen, f"train.dtype = auto: {chosen}, as this device {why}: {where}"
