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


class _CrossEntropy(torch.autograd.Function):
    """Mean NLL over rows of (N, V) logits, with a hand-written backward that keeps only softmax(logits):
    d loss / d logits = (softmax(logits) - onehot(targets)) / N. Autograd through the forward's ops would keep
    two (N, V) tensors and spend several (N, V) passes in backward; this keeps one and spends two."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        row_max = logits.amax(dim=-1, keepdim=True)  # (N, 1)
        probs = (logits - row_max).exp_()  # (N, V), every exponent <= 0 so nothing overflows
        sums = probs.sum(dim=-1, keepdim=True)  # (N, 1), >= 1
        target_logit = logits.gather(-1, targets.unsqueeze(-1))  # (N, 1)
        loss = (sums.log() + row_max - target_logit).mean()  # logsumexp(logits) - logits[target]
        ctx.save_for_backward(probs.div_(sums), targets)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        probs, targets = ctx.saved_tensors
        scale = grad_loss / probs.shape[0]
        grad = probs * scale  # (N, V)
        grad.scatter_add_(-1, targets.unsqueeze(-1), (-scale).expand(targets.shape[0], 1))
        return grad, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of ``targets`` under ``softmax(logits)``.

    logits: (..., V) unnormalized scores; targets: (...) integer ids in [0, V). Returns a 0-d tensor.
    Ids out of range fail inside ``gather`` (checking them here would force a host sync every step).
    """
    _check_shapes(logits, targets)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return _CrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long())


def perplexity(mean_loss: float | torch.Tensor) -> float:
    """exp(mean cross-entropy in nats); ``inf`` instead of an OverflowError for a diverged loss."""
    value = float(mean_loss)
    try:
        return math.exp(value)
    except OverflowError:
        return math.inf
