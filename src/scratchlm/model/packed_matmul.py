"""x Wᵀ on CPU through oneDNN with W packed once: the matmuls of batched decoding.

A decoding step of a batch multiplies a few rows (one per sequence) by every weight matrix of the model. On this
machine (AMD EPYC, 2 cores, float32) MKL runs those few-row products at ~25% of the cores' peak, while oneDNN's
JIT kernels, given the weight reordered once into their blocked layout, run them 1.5-2x faster from 3 rows up
(1 or 2 rows stay faster through MKL: see `Linear.forward`). The reorder costs a copy of each weight (~37 ms and
~70 MB for tinystories-17m), so `generate` packs only for batches that use it, only up to `MAX_PACKED_BYTES` of
weights, and drops the packs afterwards (`layers.packed_for_decoding`).

The ops are the ones torch.compile's CPU backend emits (`torch.ops.mkldnn._reorder_linear_weight`,
`_linear_pointwise`); where this torch lacks them (built without oneDNN), `available()` is False and nothing
changes. Inference only: the packed op has no backward for the weight.
"""

from __future__ import annotations

import functools

import torch

MIN_ROWS = 3  # from this many rows on, the packed product beats MKL's (measured here; see the module docstring)
# Packing copies the weights: models whose Linear weights pass this size (gpt2-medium and up: 1.4 GB and more in
# float32) decode unpacked rather than double their memory for the length of a generate() call.
MAX_PACKED_BYTES = 2**30


@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN's packed-linear ops and they run on this CPU."""
    try:
        ops = torch.ops.mkldnn
        weight = torch.ones(4, 2)
        out = ops._linear_pointwise(torch.ones(MIN_ROWS, 2), ops._reorder_linear_weight(weight, MIN_ROWS),
                                    None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return torch.backends.mkldnn.is_available() and bool(torch.equal(out, torch.full((MIN_ROWS, 4), 2.0)))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight (out, in), float32 on CPU, reordered for `linear` (an opaque tensor: only `linear` reads it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)  # 8: the batch it is tuned for


def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x (..., in) -> x Wᵀ (..., out) for a weight packed by `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
