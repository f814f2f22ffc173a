"""Global-L2-norm gradient clipping, in place, without a host sync.

The total norm is the L2 norm of the per-tensor L2 norms (computed with ``torch._foreach_norm`` per (device,
dtype) bucket), exactly as ``torch.nn.utils.clip_grad_norm_`` computes it, so both agree bit for bit. Instead
of ``if norm > max_norm`` (which would copy the norm to the host every step), every gradient is multiplied by
``min(1, max_norm / (norm + eps))``: multiplying by exactly 1.0 leaves unclipped gradients unchanged. The
pre-clip norm is returned as a 0-d tensor; the caller decides when to read it (logging steps only).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch


def clip_gradients(params: Iterable[torch.Tensor], max_l2_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale all gradients so their global L2 norm is at most ``max_l2_norm``; returns the pre-clip norm.

    Parameters without a gradient are skipped. A non-finite norm is returned as is (the trainer stops on it).
    """
    if not max_l2_norm > 0:
        raise ValueError(f"clip_gradients: max_l2_norm must be positive, got {max_l2_norm!r}")
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        buckets[(grad.device, grad.dtype)].append(grad)
    first_device = grads[0].device
    norms = [norm for bucket in buckets.values() for norm in torch._foreach_norm(bucket, 2.0)]
    total_norm = torch.linalg.vector_norm(torch.stack([norm.to(first_device) for norm in norms]), 2.0)
    scale = torch.clamp(max_l2_norm / (total_norm + eps), max=1.0)  # 0-d, stays on the device
    for (device, _), bucket in buckets.items():
        torch._foreach_mul_(bucket, scale.to(device))
    return total_norm
