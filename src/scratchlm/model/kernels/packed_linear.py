"""x Wᵀ on CPU through oneDNN with W packed once: the matmuls of batched decoding.

Wins on: CPUs with oneDNN (torch's x86 builds), for float32 inputs of a few rows without autograd, i.e. a
decoding step of a batch (one row per sequence through every weight matrix). MKL runs such few-row products
far below the cores' peak, while oneDNN's JIT kernels, given the weight reordered once into their blocked
layout, run them faster from `MIN_ROWS` rows up (1 or 2 rows stay faster as few_rows_linear.py computes them).
Figures: docs/benchmarks.md (bench_generate). The reorder copies each weight, so `packed_weights` packs only
for batches that use it, only up to `MAX_PACKED_BYTES` of weights, and drops the packs on exit.

The ops are private ones, the ones torch.compile's CPU backend emits (`torch.ops.mkldnn._reorder_linear_weight`,
`_linear_pointwise`): they are called from `available`, `PackedLinear` only. Where this torch lacks them or they
fail on this CPU, `available()` is False and nothing is packed. Inference only: the packed op has no backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from scratchlm.model.layers import Linear

MIN_ROWS = 3  # from this many rows on, the packed product beats the unpacked ones
# Packing copies the weights: models whose Linear weights pass this size (gpt2-medium and up: 1.4 GB and more in
# float32) decode unpacked rather than double their memory for the length of a generate() call.
MAX_PACKED_BYTES = 2**30
_TUNED_BATCH = 8  # the batch size the packed layout is tuned for


@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN's packed-linear ops and they compute x Wᵀ on this CPU."""
    try:
        ops = torch.ops.mkldnn
        weight = torch.ones(4, 2)
        out = ops._linear_pointwise(torch.ones(MIN_ROWS, 2), ops._reorder_linear_weight(weight, MIN_ROWS),
                                    None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return torch.backends.mkldnn.is_available() and bool(torch.equal(out, torch.full((MIN_ROWS, 4), 2.0)))


class PackedLinear:
    """A Linear's `matmul` with the weight packed: the packed product for >= MIN_ROWS float32 rows without
    autograd while the weight is unchanged since packing (an in-place update bumps its version); otherwise
    `fallback`, the matmul it stands in for."""

    def __init__(self, weight: torch.Tensor, fallback: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.version = weight._version
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _TUNED_BATCH)  # opaque layout
        self.fallback = fallback

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // weight.shape[1]
        if (rows >= MIN_ROWS and x.dtype == torch.float32 and not torch.is_grad_enabled()
                and weight._version == self.version):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return self.fallback(x, weight)


@contextmanager
def packed_weights(model: nn.Module, rows: int) -> Iterator[None]:
    """Within the block, the float32 CPU Linear layers of `model` multiply by oneDNN-packed copies of their
    weights, when decoding `rows` sequences at once makes that pay (see the module docstring). Layers already
    packed by an enclosing block are left to it; the copies are dropped on exit."""
    layers = [layer for layer in model.modules() if isinstance(layer, Linear)
              and not isinstance(layer.matmul, PackedLinear)
              and layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32]
    size = sum(layer.weight.nbytes for layer in layers)
    if rows < MIN_ROWS or size > MAX_PACKED_BYTES or not available():
        layers = []
    unpacked = [layer.matmul for layer in layers]
    for layer in layers:
        layer.matmul = PackedLinear(layer.weight, layer.matmul)
    try:
        yield
    finally:
        for layer, matmul in zip(layers, unpacked):
            layer.matmul = matmul
