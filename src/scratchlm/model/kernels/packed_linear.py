"""x Wᵀ on CPU through oneDNN with W packed once: the matmuls of batched decoding.

Wins on: CPUs with oneDNN (torch's x86 builds), for inputs of a few rows without autograd, i.e. a decoding
step of a batch (one row per sequence through every weight matrix). MKL runs such few-row products far below
the cores' peak, while oneDNN's JIT kernels, given the weight reordered once into their blocked layout, ran
them faster from 3 rows up on the CPUs timed (1 or 2 rows were faster unpacked). Figures: docs/benchmarks.md
(bench_generate). Whether it wins is decided by timing (tuned_linear.py `tuned_weights`, which packs only up
to its `MAX_COPY_BYTES` of weights, as the reorder copies each weight, and drops the packs on exit).

The ops are private ones, the ones torch.compile's CPU backend emits (`torch.ops.mkldnn._reorder_linear_weight`,
`_linear_pointwise`): they are called from `available`, `PackedLinear` only. Where this torch lacks them or they
fail on this CPU, `available()` is False and nothing is packed. Inference only: the packed op has no backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

_TUNED_BATCH = 8  # the batch size the packed layout is tuned for


@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN's packed-linear ops and they compute x Wᵀ on this CPU."""
    try:
        ops = torch.ops.mkldnn
        weight = torch.ones(4, 2)
        out = ops._linear_pointwise(torch.ones(3, 2), ops._reorder_linear_weight(weight, 3), None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return torch.backends.mkldnn.is_available() and bool(torch.equal(out, torch.full((3, 4), 2.0)))


class PackedLinear:
    """A Linear's `matmul` with the weight packed: the packed product for (one or more) rows of the weight's
    dtype without autograd while the weight is unchanged since packing (an in-place update bumps its version);
    otherwise `fallback`, the matmul it stands in for.

    A bf16 (or fp16) weight is packed as its float32 copy and its inputs are upcast, the product rounded back to
    their dtype: the same product as a bf16 matmul (which accumulates in float32 and rounds once), and on CPUs
    without bf16 matrix instructions (AVX512-BF16, AMX) several times faster for a few rows than torch's bf16
    kernels, which then emulate bf16. With `native=True` it is packed in its own dtype instead: on CPUs that
    have those instructions, oneDNN's bf16 kernels stream half the bytes (a tinystories-17m step's products in
    1.9 ms against 4.3 ms float32-packed and 3.7 ms unpacked bf16, at batch 1 on an AVX512-BF16 Xeon).
    tuned_linear.py decides by timing which wins. float32 weights only otherwise: a float64 one would lose
    precision."""

    def __init__(self, weight: torch.Tensor, fallback: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                 native: bool = False):
        self.version, self.dtype = weight._version, weight.dtype
        self.compute_dtype = weight.dtype if native else torch.float32
        packed = weight.detach().to(self.compute_dtype)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(packed, _TUNED_BATCH)  # opaque layout
        self.fallback = fallback

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // weight.shape[1]
        if (rows and x.dtype == self.dtype and not torch.is_grad_enabled()
                and weight._version == self.version):
            product = torch.ops.mkldnn._linear_pointwise(x.to(self.compute_dtype), self.packed, None, "none", [], "")
            return product.to(x.dtype)
        return self.fallback(x, weight)


def native_packed(weight: torch.Tensor, fallback: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> PackedLinear:
    """A PackedLinear of `weight` in its own dtype (see PackedLinear's `native`)."""
    return PackedLinear(weight, fallback, native=True)
