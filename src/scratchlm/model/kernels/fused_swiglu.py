"""SwiGLU's hidden layer, SiLU(gate) ⊙ up, through torch's fused SiLU and its backward (aten `silu`,
`silu_backward`).

Wins on: every device, in training, where the (batch, T, d_ff) activations are streamed through memory a pass at
a time. The readable `silu(gate) * up` makes 3 passes forward and 8 backward (SiLU's derivative is 6 elementwise
ops, the product's 2), and autograd keeps SiLU(gate) beside gate and up; this makes 2 passes forward and 4
backward and keeps gate and up only. Without autograd (decoding) it is the 2 forward ops. The same values and
gradients to round-off (tests/test_kernels.py); figures: docs/benchmarks.md.
"""

from __future__ import annotations

import torch

_silu, _silu_backward = torch.ops.aten.silu, torch.ops.aten.silu_backward


class _SwiGLU(torch.autograd.Function):
    """d/dgate = dy ⊙ up ⊙ SiLU'(gate), d/dup = dy ⊙ SiLU(gate), with SiLU(gate) recomputed in the backward."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return _silu_backward(grad * up, gate), grad * _silu(gate)


def fused_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`SwiGLU.hidden` (gate, up (..., d_ff) -> SiLU(gate) ⊙ up), through fused ops."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SwiGLU.apply(gate, up)
    return _silu(gate) * up
