"""Compute-optimal model sizing for a time budget, aware that a small corpus gets repeated.

The rule behind ``scratchlm plan``:

1. A short probe measures the machine's training throughput on the recipe's own shape: F FLOP/s, the exact
   forward + backward FLOPs of a step (params_flops.py) over its measured time. The compute the budget buys is
   C = F · (training share of the budget).
2. Each candidate shape (a ladder of widths and depths, 64-dimensional heads, the recipe's FFN, vocabulary,
   context and batch) costs c FLOPs per trained token, so it trains D = C / c tokens.
3. Data: a corpus of U unique tokens trained for D tokens is repeated R = D/U - 1 times. Repeated tokens are worth
   less than fresh ones; Muennighoff et al. (2023, "Scaling Data-Constrained Language Models") fit the effective
   data as D' = U + U·R*·(1 - exp(-R/R*)) with R* = 15.4: up to ~4 epochs are nearly as good as new data, and
   beyond ~40 they add almost nothing.
4. Each candidate's loss is predicted with the Chinchilla fit (Hoffmann et al. 2022, approach 3)
   L(N, D') = E + A/N^α + B/D'^β, with N its non-embedding parameters, and the lowest prediction wins.

The fit's constants come from web text, so its predicted losses are not TinyStories losses: only the ranking is
used. The same throughput F is assumed for every candidate, though small matrices run below a CPU's peak; the
probe measures the recipe's shape, so candidates near it are the best estimated.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from scratchlm.accounting.params_flops import count_params, training_step_flops
from scratchlm.model.config import ModelConfig

CHINCHILLA = dict(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)  # Hoffmann et al. 2022, approach 3
REPETITION_HALF_LIFE = 15.4  # R* for data (Muennighoff et al. 2023)
WIDTHS = (64, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024)
DEPTHS = (2, 3, 4, 6, 8, 12)
HEAD_DIM = 64


@dataclass(frozen=True)
class Candidate:
    model: ModelConfig
    non_embedding_params: int
    flops_per_token: float
    tokens: float  # trained in the budget
    epochs: float
    effective_tokens: float  # after the repetition discount
    predicted_loss: float  # Chinchilla fit: for ranking only


def effective_tokens(tokens: float, unique: float) -> float:
    """Muennighoff et al.'s D' of `tokens` trained on a corpus of `unique` tokens."""
    if tokens <= unique:
        return tokens
    repeats = tokens / unique - 1
    return unique + unique * REPETITION_HALF_LIFE * (1 - math.exp(-repeats / REPETITION_HALF_LIFE))


def predicted_loss(params: float, tokens: float) -> float:
    c = CHINCHILLA
    return c["E"] + c["A"] / params ** c["alpha"] + c["B"] / tokens ** c["beta"]


def candidate_shapes(base: ModelConfig) -> list[ModelConfig]:
    """The ladder: every width and depth with d_model // 64 heads (at least one) of d_model / heads each, the rest
    of `base` kept (d_ff re-derived from the FFN kind unless the recipe fixes its ratio to d_model; grouped-query
    attention keeps its query heads per KV head where they divide the new head count, else multi-head)."""
    shapes = []
    group = base.num_heads // base.num_kv_heads
    for width in WIDTHS:
        for depth in DEPTHS:
            heads = max(1, width // HEAD_DIM)
            if width % heads:
                continue
            ratio = base.d_ff / base.d_model
            d_ff = int(round(ratio * width / 64) * 64) or None
            kv_heads = heads // group if heads % group == 0 else heads
            shapes.append(dataclasses.replace(base, d_model=width, num_layers=depth, num_heads=heads, d_ff=d_ff,
                                              num_kv_heads=kv_heads, head_dim=None))
    return shapes


def rank_shapes(base: ModelConfig, flops_per_second: float, seconds: float, unique_tokens: int,
                batch: int) -> list[Candidate]:
    """Every candidate shape with its predicted loss for `seconds` of training at `flops_per_second`, best first."""
    compute = flops_per_second * seconds
    ranked = []
    for model in candidate_shapes(base):
        step = training_step_flops(model, model.context_length, batch)
        per_token = (step.forward + step.backward) / (batch * model.context_length)
        tokens = compute / per_token
        params = model.non_embedding_params(count_params(model).total)
        effective = effective_tokens(tokens, unique_tokens)
        ranked.append(Candidate(model, params, per_token, tokens, tokens / unique_tokens, effective,
                                predicted_loss(params, effective)))
    return sorted(ranked, key=lambda c: c.predicted_loss)
