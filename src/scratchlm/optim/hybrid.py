"""MuonAdamW: one optimizer, one state dict, that updates some param groups with Muon and the others with AdamW.

Muon is meant for the 2-D matrices of the hidden layers only; the token embeddings, the output head and the
1-D gains go to AdamW (Jordan et al. 2024; Moonshot 2025). Two optimizers side by side would work, but would mean
two state dicts to checkpoint, two ``zero_grad``s and two learning-rate loops in the trainer. Here every param
group names its ``algorithm`` ("muon" or "adamw") and carries that algorithm's hyperparameters; what a group
leaves out takes the default of ``Muon``'s or ``AdamW``'s constructor. The update code is theirs
(``muon_group_step``, ``adamw_group_step``), so each group behaves exactly like the stand-alone optimizer.

A group may carry keys of its own (a trainer's ``lr_scale``, say): the torch base class saves and restores
every key of every group, so they survive ``state_dict()`` / ``load_state_dict()``.

    optimizer = MuonAdamW([
        {"params": hidden_matrices, "algorithm": "muon", "lr": 0.02, "weight_decay": 0.1},
        {"params": embeddings_and_head, "algorithm": "adamw", "lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1},
        {"params": gains, "algorithm": "adamw", "lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.0},
    ])
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from scratchlm.optim.adamw import AdamW, adamw_group_step, closure_loss, validate_adamw
from scratchlm.optim.muon import Muon, muon_group_step, refuse_last_group_unless_matrices, validate_muon


def constructor_defaults(optimizer_class: type[torch.optim.Optimizer]) -> dict[str, Any]:
    """The hyperparameter defaults of an optimizer's constructor (one source of truth for both optimizers)."""
    parameters = inspect.signature(optimizer_class.__init__).parameters
    return {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}


ALGORITHMS = {"muon": (constructor_defaults(Muon), validate_muon),
              "adamw": (constructor_defaults(AdamW), validate_adamw)}


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups with ``algorithm="muon"``, AdamW on those with ``algorithm="adamw"``."""

    def __init__(self, param_groups: Iterable[dict[str, Any]]) -> None:
        super().__init__(list(param_groups), defaults={})  # each group brings its algorithm's defaults
        self._denominators: dict[torch.Tensor, torch.Tensor] = {}  # AdamW's scratch buffers (foreach path)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        algorithm = param_group.get("algorithm")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"MuonAdamW: param group {len(self.param_groups)} has algorithm {algorithm!r}; "
                             f"each group needs 'algorithm' set to one of {sorted(ALGORITHMS)}")
        defaults, validate = ALGORITHMS[algorithm]
        for name, value in defaults.items():
            param_group.setdefault(name, value)
        validate(param_group)
        super().add_param_group(param_group)  # turns (name, param) pairs into params + param_names
        if algorithm == "muon":
            refuse_last_group_unless_matrices(self)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - signature fixed by torch.optim.Optimizer
        loss = closure_loss(closure)
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                muon_group_step(self.state, group)
            else:
                adamw_group_step(self.state, group, self._denominators)
        return loss

