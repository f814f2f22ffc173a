"""x Wᵀ on CPU through oneDNN with W packed once: the matmuls of decoding.

Wins on: CPUs with oneDNN (torch's x86 builds), for decoding steps (a few rows, no autograd): MKL runs such
few-row products far below peak, oneDNN's JIT kernels on a weight reordered once into their blocked layout run
them near memory speed. The rule, fixed (measured with bench_generate, docs/benchmarks.md) so that a machine
always decodes the same way:
- float32 weights are packed for steps of 2 rows and more; a single row takes few_rows_linear.py;
- bf16 weights are packed in bf16 where the CPU has bf16 instructions (`cpu.has_native_bf16`);
- other bf16 weights, and fp16 ones, are packed as float32 copies for steps of 4 rows and more, the inputs upcast
  and the product rounded back once (what a half-precision matmul computes). Fewer rows take the layer's own
  product in the weight's dtype: torch's half-precision matrix-vector kernels read half the bytes of the copies.

The ops are private ones that torch.compile's CPU backend emits (`torch.ops.mkldnn._reorder_linear_weight`,
`_linear_pointwise`); where this torch lacks them or they fail, `available()` is False and nothing is packed.
Inference only: with autograd on, or once the weight changed in place, the layer's own matmul runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from scratchlm.model.kernels import cpu
from scratchlm.model.kernels.swap import swapped
from scratchlm.model.layers import Linear

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_TUNED_BATCH = 8  # the batch size the packed layout is tuned for
PACKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The packs copy the weights: a model whose copies would pass this size (gpt2-medium and up) decodes unpacked
# rather than double its memory for the length of a generate() call.
MAX_PACKED_BYTES = 2**30


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
    """A Linear's `matmul` with the weight packed in `compute_dtype` (its own, or float32): the packed product for
    `min_rows` rows or more of the weight's dtype, without autograd, while the weight is unchanged since packing
    (an in-place update bumps its version); otherwise `fallback`, the matmul it stands in for."""

    def __init__(self, weight: torch.Tensor, fallback: Matmul, *, compute_dtype: torch.dtype, min_rows: int = 1):
        self.version, self.dtype = weight._version, weight.dtype
        self.compute_dtype, self.min_rows = compute_dtype, min_rows
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(compute_dtype), _TUNED_BATCH)
        self.fallback = fallback

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // weight.shape[1]
        if (rows >= self.min_rows and x.dtype == self.dtype and not torch.is_grad_enabled()
                and weight._version == self.version):
            product = torch.ops.mkldnn._linear_pointwise(x.to(self.compute_dtype), self.packed, None, "none", [], "")
            return product.to(x.dtype)
        return self.fallback(x, weight)


def packing_for(weight: torch.Tensor) -> tuple[torch.dtype, int]:
    """(the dtype to pack `weight` in, the fewest rows that take the packed product), by the rule above."""
    if weight.dtype == torch.float32:
        return torch.float32, 2
    if weight.dtype == torch.bfloat16 and cpu.has_native_bf16():
        return torch.bfloat16, 1
    return torch.float32, 4


@contextmanager
def packed_weights(model: nn.Module, step_rows: int | None = None) -> Iterator[int]:
    """Within the block, the CPU Linear layers of `model` multiply through packed copies of their weights (by the
    rule above); yields how many were packed (0 where oneDNN's ops are missing or the copies would pass
    MAX_PACKED_BYTES). `step_rows`, the most rows a decoding step will have (its batch), leaves unpacked the
    weights whose packs need more: only prefills would use them, and packing a weight costs about as much as ten
    of its products. Each layer's previous matmul comes back on exit, and the copies are dropped."""
    layers = [layer for layer in model.modules()
              if isinstance(layer, Linear) and not isinstance(layer.matmul, PackedLinear)
              and layer.weight.device.type == "cpu" and layer.weight.dtype in PACKED_DTYPES
              and (step_rows is None or packing_for(layer.weight)[1] <= step_rows)]
    copy_bytes = sum(layer.weight.numel() * 4 for layer in layers)  # float32 copies at most
    if not layers or copy_bytes > MAX_PACKED_BYTES or not available():
        yield 0
        return
    packs = []
    for layer in layers:
        compute_dtype, min_rows = packing_for(layer.weight)
        packs.append((layer, "matmul", PackedLinear(layer.weight, layer.matmul, compute_dtype=compute_dtype,
                                                    min_rows=min_rows)))
    with swapped(packs):
        yield len(layers)
