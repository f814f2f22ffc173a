"""Cross-entropy loss and perplexity for next-token prediction, from tensor primitives (the tests use
``F.cross_entropy`` as oracle).

The loss is ``logsumexp(logits) - logits[target]`` with the row maximum subtracted first, so ``exp`` only sees
values <= 0 and any finite logits stay finite. Leading batch dimensions are flattened, as ``F.cross_entropy`` on
the ``(N, V)`` view. Half-precision logits are upcast to float32: a sum over a 10k-50k vocabulary loses too many bits
in bf16. A target equal to ``ignore_index`` (``IGNORED``, -100) counts for nothing, and ``reduction="sum"`` lets a
caller that splits a batch into micro-batches divide by the whole batch's count (train/step.py).
"""

from __future__ import annotations

import math

import torch

IGNORED = -100  # a target that counts for nothing: F.cross_entropy's default ignore_index


def _check_shapes(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() < 1:
        raise ValueError(f"cross_entropy: logits must have a vocabulary dimension, got shape {tuple(logits.shape)}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"cross_entropy: targets shape {tuple(targets.shape)} must equal logits shape without "
                         f"its last (vocabulary) dimension {tuple(logits.shape[:-1])}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"cross_entropy: targets must be integer token ids, got dtype {targets.dtype}")


class _CrossEntropy(torch.autograd.Function):
    """Mean NLL over rows of (N, V) logits, with a hand-written backward that keeps only softmax(logits):
    d loss / d logits = (softmax(logits) - onehot(targets)) / N. Autograd through the forward's ops would keep
    two (N, V) tensors and spend several (N, V) passes in backward; this keeps one and spends two.

    With ``counted`` (N,) bool, only those rows count: their NLL summed, divided by ``divisor`` (a 0-d tensor: the
    number of counted rows for a mean, 1 for a sum); the other rows' targets may be any value (``IGNORED``)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, counted: torch.Tensor | None = None,
                divisor: torch.Tensor | None = None) -> torch.Tensor:
        if counted is not None:
            targets = targets.masked_fill(~counted, 0)  # any valid id: these rows are weighed 0 below
        row_max = logits.amax(dim=-1, keepdim=True)  # (N, 1)
        probs = (logits - row_max).exp_()  # (N, V), every exponent <= 0 so nothing overflows
        sums = probs.sum(dim=-1, keepdim=True)  # (N, 1), >= 1
        target_logit = logits.gather(-1, targets.unsqueeze(-1))  # (N, 1)
        nll = sums.log() + row_max - target_logit  # logsumexp(logits) - logits[target], (N, 1)
        if counted is None:
            loss = nll.mean()
            weights = None
        else:
            weights = counted.unsqueeze(-1).to(nll.dtype) / divisor  # (N, 1): each counted row's share
            loss = (nll * weights).sum()
        ctx.save_for_backward(probs.div_(sums), targets, weights)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        probs, targets, weights = ctx.saved_tensors
        scale = grad_loss / probs.shape[0] if weights is None else (grad_loss * weights)  # () or (N, 1)
        grad = probs * scale  # (N, V)
        grad.scatter_add_(-1, targets.unsqueeze(-1), (-scale).expand(targets.shape[0], 1))
        return grad, None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int | None = None,
                  reduction: str = "mean") -> torch.Tensor:
    """Mean negative log-likelihood of ``targets`` under ``softmax(logits)``.

    logits: (..., V) unnormalized scores; targets: (...) integer ids in [0, V). Returns a 0-d tensor.
    Ids out of range fail inside ``gather`` (checking them here would force a host sync every step).
    ``ignore_index`` (usually ``IGNORED``): targets equal to it count for nothing, and the mean is over the others
    (NaN when there are none, as F.cross_entropy). ``reduction="sum"``: the sum over the counted targets instead.
    """
    _check_shapes(logits, targets)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long()
    if ignore_index is None and reduction == "mean":
        return _CrossEntropy.apply(logits, targets)
    counted = torch.ones_like(targets, dtype=torch.bool) if ignore_index is None else targets != ignore_index
    divisor = counted.sum() if reduction == "mean" else torch.ones((), device=logits.device)
    return _CrossEntropy.apply(logits, targets, counted, divisor.to(logits.dtype))


def perplexity(mean_loss: float | torch.Tensor) -> float:
    """exp(mean cross-entropy in nats); ``inf`` instead of an OverflowError for a diverged loss."""
    value = float(mean_loss)
    try:
        return math.exp(value)
    except OverflowError:
        return math.inf
