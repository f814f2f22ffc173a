"""Which update rule, learning rate and weight decay each parameter of a TransformerLM trains with.

The CS336 recipe (``optim.optimizer = "adamw"`` with no per-part rates) is the two AdamW groups of
``adamw.param_groups_for``: matrices decay, gains do not. The modern recipe splits the model by role, as the
modded-nanogpt speedrun does:

- the hidden matrices (attention Q, K, V, output; FFN W1, W2, W3; chosen by ``optim.muon_params``, a regular
  expression over parameter names) go to Muon at ``optim.muon_lr``: their updates are orthogonalised, so every
  direction of a matrix learns at the same speed;
- the token embeddings (``optim.embedding_lr``) and an untied ``lm_head`` (``optim.head_lr``) stay with AdamW at
  rates of their own: an embedding row is a lookup that only its token's gradient reaches, and the head maps to
  a vocabulary-sized output; neither is a hidden linear map for which orthogonalised updates are meant;
- norm gains (1-D) stay with AdamW at ``optim.lr`` without weight decay.

Each group carries ``lr_scale`` (its peak rate over optim.lr); the trainer sets ``group["lr"]`` to the scheduled
rate times it at every step, so one schedule drives every group. A tied embedding/head matrix is one parameter:
it trains as the embedding.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from scratchlm.config import OptimConfig
from scratchlm.optim.adamw import param_groups_for


def recipe_param_groups(model: nn.Module, optim: OptimConfig) -> list[dict[str, Any]]:
    """Param groups for the optimizer of ``optim.optimizer`` (see the module docstring); empty groups dropped.
    With Muon every group carries ``algorithm`` ("muon" or "adamw") for the hybrid optimizer."""
    if optim.optimizer == "adamw" and optim.embedding_lr is None and optim.head_lr is None:
        return param_groups_for(model, optim.weight_decay)
    muon, matrices, embeddings, head, gains = _split_by_role(model, optim)
    scale = lambda lr: (optim.lr if lr is None else lr) / optim.lr  # noqa: E731 - a one-line helper
    groups = [{"params": muon, "weight_decay": optim.weight_decay, "lr_scale": optim.muon_lr / optim.lr},
              {"params": matrices, "weight_decay": optim.weight_decay, "lr_scale": 1.0},
              {"params": embeddings, "weight_decay": optim.weight_decay, "lr_scale": scale(optim.embedding_lr)},
              {"params": head, "weight_decay": optim.weight_decay, "lr_scale": scale(optim.head_lr)},
              {"params": gains, "weight_decay": 0.0, "lr_scale": 1.0}]
    if optim.optimizer == "muon":  # the hybrid optimizer's tag; AdamW alone takes groups without it
        for group in groups:
            group["algorithm"] = "muon" if group is groups[0] else "adamw"
    return [group for group in groups if group["params"]]


def _split_by_role(model: nn.Module, optim: OptimConfig) -> tuple[list[nn.Parameter], ...]:
    """(Muon's matrices, AdamW's other matrices, token embeddings, untied head, gains): each trainable parameter
    exactly once."""
    pattern = re.compile(optim.muon_params)
    muon, matrices, embeddings, head, gains = [], [], [], [], []
    for name, param in model.named_parameters():  # a tied matrix appears once, as token_embeddings.weight
        if not param.requires_grad:
            continue
        if name == "token_embeddings.weight":
            embeddings.append(param)
        elif name == "lm_head.weight":
            head.append(param)
        elif optim.optimizer == "muon" and pattern.search(name):
            if param.dim() != 2:
                raise ValueError(f"optim.muon_params {optim.muon_params!r} selects {name} of shape "
                                 f"{tuple(param.shape)}: Muon takes 2-D matrices only (gains stay with AdamW)")
            muon.append(param)
        elif param.dim() >= 2:
            matrices.append(param)
        else:
            gains.append(param)
    if optim.optimizer == "muon" and not muon:
        raise ValueError(f"optim.muon_params {optim.muon_params!r} selects no parameter of this model")
    return muon, matrices, embeddings, head, gains
