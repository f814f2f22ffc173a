"""x Wᵀ for a few float32 rows on CPU, computed as (W xᵀ)ᵀ: the matmuls of decoding.

Wins on: CPUs whose BLAS runs x Wᵀ, for a row-major W and a handful of rows, through its slow matrix-vector
kernels, while W xᵀ streams W through the matrix-matrix kernel (a single row is doubled to reach it). From 2 rows
on, a W wider than tall (the FFN's down projection) is faster as x Wᵀ. Training batches and other dtypes and
devices take x Wᵀ. The same product (tests/test_kernels.py); figures: docs/benchmarks.md.
"""

from __future__ import annotations

import torch

from scratchlm.model.layers import linear

MAX_ROWS = 16  # float32 inputs with at most this many rows take the W xᵀ path


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`layers.linear` (x (..., in) -> x Wᵀ (..., out)), as (W xᵀ)ᵀ where that is faster."""
    out_features, in_features = weight.shape
    rows = x.numel() // in_features
    faster = rows <= MAX_ROWS and x.device.type == "cpu" and x.dtype == torch.float32 and (
        rows == 1 or in_features <= out_features)
    if not faster:
        return linear(x, weight)
    flat = x.reshape(rows, in_features)
    columns = torch.cat((flat, flat)).t() if rows == 1 else flat.t()  # a single row is doubled (see above)
    return (weight @ columns).t()[:rows].reshape(*x.shape[:-1], out_features)
