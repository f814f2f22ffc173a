"""Cross-entropy loss and perplexity for next-token prediction, from tensor primitives.

Design: the loss is computed as ``logsumexp(logits) - logits[target]`` with the row maximum subtracted first, so
logits of ±1e4 (or any finite magnitude) stay finite: ``exp`` only ever sees values <= 0. Any number of leading
batch dimensions is accepted and the mean is taken over all of them, which matches ``F.cross_entropy`` on the
flattened ``(N, V)`` view. Half-precision logits (bf16 autocast) are upcast to float32 first: the sum over a
10k-50k vocabulary loses too many bits in bf16. No ``torch.nn.functional`` is used (the tests use it as oracle).
"""

from __future__ import annotations

import math

import torch


def _check_shapes(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() < 1:
        raise ValueError(f"cross_entropy: logits must have a vocabulary dimension, got shape {tuple(logits.shape)}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"cross_entropy: targets shape {tuple(targets.shape)} must equal logits shape without "
                         f"its last (vocabulary) dimension {tuple(logits.shape[:-1])}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"cross_entropy: targets must be integer token ids, got dtype {targets.dtype}")


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of ``targets`` under ``softmax(logits)``.

    logits: (..., V) unnormalized scores; targets: (...) integer ids in [0, V). Returns a 0-d tensor.
    Ids out of range fail inside ``gather`` (checking them here would force a host sync every step).
    """
    _check_shapes(logits, targets)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    row_max = logits.amax(dim=-1, keepdim=True).detach()  # (..., 1); a constant shift, no gradient needed
    shifted = logits - row_max  # (..., V), every entry <= 0 so exp cannot overflow
    log_normalizer = shifted.exp().sum(dim=-1).log()  # (...)
    target_logit = shifted.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # (...)
    return (log_normalizer - target_logit).mean()


def perplexity(mean_loss: float | torch.Tensor) -> float:
    """exp(mean cross-entropy in nats); ``inf`` instead of an OverflowError for a diverged loss."""
    value = float(mean_loss)
    try:
        return math.exp(value)
    except OverflowError:
        return math.inf
