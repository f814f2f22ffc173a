"""Optimizers stepped side by side on the same gradients: how the optimizer tests (test_adamw.py, test_muon.py)
compare ours with torch's, one path with another, and a resumed optimizer with the one it was saved from."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

SetGrads = Callable[[list[nn.Parameter], int, int], None]  # (params, step, seed): the same gradients every call


def take_steps(set_grads: SetGrads, steps: range, seed: int,
               *runs: tuple[torch.optim.Optimizer, list[nn.Parameter]]) -> None:
    """Each (optimizer, params) of runs takes these steps, each on the gradients set_grads gives that step."""
    for step in steps:
        for optimizer, params in runs:
            set_grads(params, step, seed)
            optimizer.step()
