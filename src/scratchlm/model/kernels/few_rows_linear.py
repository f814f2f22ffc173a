"""x Wᵀ for a few float32 rows on CPU, computed as (W xᵀ)ᵀ: the matmuls of decoding.

Wins on: CPUs with a BLAS (MKL, OpenBLAS) that runs x Wᵀ, for a row-major W and a handful of rows, through its
matrix-vector kernels, which reach a fraction of memory speed, while W xᵀ, (out, in) @ (in, rows), streams W
through the matrix-matrix kernel. That is the shape of every matmul of a decoding step (one row per sequence);
a single row is doubled to reach the matrix-matrix kernel. From 2 rows on, a W wider than tall (the FFN's down
projection) is faster as x Wᵀ. Training batches (thousands of rows) and other dtypes and devices take x Wᵀ.
Figures: docs/benchmarks.md (bench_generate). The result is the same product (tests/test_kernels.py).
"""

from __future__ import annotations

import torch

from scratchlm.model.layers import linear

MAX_ROWS = 16  # float32 inputs with at most this many rows take the W xᵀ path


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`layers.linear` (x (..., in) -> x Wᵀ (..., out)), as (W xᵀ)ᵀ where that is faster."""
    out_features, in_features = weight.shape
    rows = x.numel() // in_features
    if not _faster_as_w_xt(x, rows, in_features, out_features):
        return linear(x, weight)
    flat = x.reshape(rows, in_features)
    columns = torch.cat((flat, flat)).t() if rows == 1 else flat.t()  # a single row is doubled (see above)
    return (weight @ columns).t()[:rows].reshape(*x.shape[:-1], out_features)


def _faster_as_w_xt(x: torch.Tensor, rows: int, in_features: int, out_features: int) -> bool:
    if rows > MAX_ROWS or x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    return rows == 1 or in_features <= out_features
