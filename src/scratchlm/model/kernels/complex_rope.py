"""RoPE as one complex multiply: every adjacent pair rotated by a single elementwise op.

Wins on: every device, as the rotation is bound by memory traffic. Read as a complex number x₂ᵢ + i·x₂ᵢ₊₁, a
pair rotated by an angle is the pair times cos + i·sin: one op that reads x once and writes once, where the
readable rotation (`attention.rotate_pairs`) makes seven passes over x-sized tensors (four multiplies, an add,
a subtract, the stack) in forward and as many in backward. Figures: docs/benchmarks.md. The same rotation to
float32 round-off (tests/test_kernels.py).
"""

from __future__ import annotations

import torch


def rotate_as_complex(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`attention.rotate_pairs` (x (..., T, d_k), cos/sin (..., T, d_k/2), float32 or float64) as a complex multiply."""
    pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())  # (..., T, d_k/2) complex
    return torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2)
