"""The decoding matmuls chosen by timing them: whichever way of computing x Wᵀ is fastest on this machine.

Wins on: every CPU, because no single rule does. A decode step multiplies `rows` rows (one per sequence) by
every weight matrix, and which kernel does that fastest depends on the CPU and its BLAS: on one Xeon with MKL,
(W xᵀ)ᵀ (few_rows_linear.py) doubled batch-1 speed; on an AVX2-only EPYC with the same MKL it is 1.3x slower
than x Wᵀ, and x @ Wᵀ with Wᵀ stored contiguously (column-major, `ColumnMajorLinear`) is fastest; a bf16 model
on a CPU without bf16 matrix instructions decodes a batch of 8 several times faster through float32-packed
oneDNN weights (packed_linear.py) than through torch's emulated bf16 kernels. Figures: docs/benchmarks.md.

`tuned_weights(model, rows)` therefore times each strategy on the model's own CPU Linear layers, all of them
in a row as one decode step runs them (so weights stream from memory as they do when decoding, rather than
sitting in cache as in a one-matrix micro-benchmark), and installs the fastest for the block:
- "installed": each layer's current matmul (few_rows_linear or the readable `linear`);
- "column_major": a contiguous float32 copy of Wᵀ, multiplied as x @ Wᵀ;
- "packed": oneDNN-packed float32 copies of the weights, where this torch has the ops;
- "packed_native": the weights oneDNN-packed in their own dtype (for float32 weights, "packed" again: skipped).
bf16/fp16 weights are copied as float32 and their inputs upcast, the product rounded back once: what a bf16
matmul computes (float32 sums, one rounding), at float32 speed where the CPU has no bf16 instructions.
The choice is remembered per (rows, threads, layer shapes, dtypes and matmuls) for the life of the process, so
only the first decode of a kind pays for the timing (~3 passes over the weights per strategy). Every
strategy falls back to the layer's matmul with autograd on, for another dtype, or once the weight changed in
place, and each computes the same product (tests/test_kernels.py). The copies are dropped on exit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from scratchlm.model.kernels import packed_linear
from scratchlm.model.kernels.packed_linear import PackedLinear
from scratchlm.model.layers import Linear

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
TIMED_PASSES = 3  # after one warm-up pass; the fastest pass counts (load from other processes only slows)
# The strategies copy the weights: models whose float32 copies would pass this size (gpt2-medium and up: 1.4 GB and
# more) decode with their matmuls as installed rather than double their memory for the length of a generate() call.
MAX_COPY_BYTES = 2**30
COPIED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # weights the strategies copy as float32
_chosen: dict[tuple, str] = {}  # what tuned_weights picked, by the key of `_key`


class ColumnMajorLinear:
    """A Linear's `matmul` as x @ Wᵀ with Wᵀ (in, out) stored contiguously in float32, without autograd while the
    weight is unchanged since the copy and x has its dtype; otherwise `fallback`, the matmul it stands in for.

    A bf16 (or fp16) weight is copied as float32 and its inputs upcast, the product rounded back once, as
    PackedLinear does: the product a bf16 matmul computes (float32 sums, one rounding), and on a CPU without bf16
    matrix instructions ~2x faster even for one row than torch's bf16 matrix-vector kernel."""

    def __init__(self, weight: torch.Tensor, fallback: Matmul):
        self.version, self.dtype = weight._version, weight.dtype
        self.weight_t = weight.detach().float().t().contiguous()  # (in, out)
        self.fallback = fallback

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.dtype and not torch.is_grad_enabled() and weight._version == self.version:
            return (x.float() @ self.weight_t).to(x.dtype)
        return self.fallback(x, weight)


def strategies() -> dict[str, Callable[[torch.Tensor, Matmul], Matmul] | None]:
    """Each strategy's name and how it builds a layer's matmul from (weight, installed matmul); None keeps it."""
    found: dict[str, Callable[[torch.Tensor, Matmul], Matmul] | None] = {"installed": None,
                                                                           "column_major": ColumnMajorLinear}
    if packed_linear.available():
        found["packed"] = PackedLinear
        found["packed_native"] = packed_linear.native_packed  # bf16 kernels where the CPU has bf16 instructions
    return found


def _build(name: str, layers: list[Linear]) -> list[Matmul]:
    make = strategies()[name]
    return [layer.matmul if make is None else make(layer.weight, layer.matmul) for layer in layers]


def _matmul_pass(layers: list[Linear], rows: int) -> Callable[[], None]:
    """Every layer's matmul once on random rows, in order, as a decode step runs them."""
    inputs = {(layer.in_features, layer.weight.dtype): torch.randn(rows, layer.in_features, dtype=layer.weight.dtype)
              for layer in layers}

    def one_pass() -> None:
        for layer in layers:
            layer.matmul(inputs[layer.in_features, layer.weight.dtype], layer.weight)

    return one_pass


def _seconds_per_pass(one_pass: Callable[[], object]) -> float:
    """The fastest of TIMED_PASSES timed calls of `one_pass`, after one warm-up call."""
    one_pass()
    best = float("inf")
    for _ in range(TIMED_PASSES):
        start = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - start)
    return best


def _key(layers: list[Linear], rows: int, timed: str) -> tuple:
    return (rows, timed, torch.get_num_threads(),
            tuple((tuple(layer.weight.shape), layer.weight.dtype,
                   getattr(layer.matmul, "__qualname__", type(layer.matmul).__name__)) for layer in layers))


def _fastest(layers: list[Linear], rows: int, one_pass: Callable[[], object] | None) -> tuple[str, list[Matmul]]:
    """The fastest strategy's name and matmuls (timed now, or remembered from an earlier call)."""
    key = _key(layers, rows, "matmuls" if one_pass is None else "step")
    if key in _chosen:
        return _chosen[key], _build(_chosen[key], layers)
    one_pass = one_pass or _matmul_pass(layers, rows)
    best_name, best_matmuls, best_seconds = "installed", [], float("inf")
    with torch.inference_mode():
        for name in strategies():
            if name == "packed_native" and all(layer.weight.dtype == torch.float32 for layer in layers):
                continue  # float32 weights packed natively are "packed"
            matmuls = _build(name, layers)
            with _installed(layers, matmuls):
                seconds = _seconds_per_pass(one_pass)
            if seconds < best_seconds:
                best_name, best_matmuls, best_seconds = name, matmuls, seconds
    _chosen[key] = best_name
    return best_name, best_matmuls


@contextmanager
def _installed(layers: list[Linear], matmuls: list[Matmul]) -> Iterator[None]:
    """Within the block, each layer multiplies by its matmul of `matmuls`; the previous ones come back on exit."""
    before = [layer.matmul for layer in layers]
    for layer, matmul in zip(layers, matmuls):
        layer.matmul = matmul
    try:
        yield
    finally:
        for layer, matmul in zip(layers, before):
            layer.matmul = matmul


@contextmanager
def tuned_weights(model: nn.Module, rows: int, strategy: str | None = None,
                  one_pass: Callable[[], object] | None = None) -> Iterator[str]:
    """Within the block, the CPU Linear layers of `model` multiply `rows` rows by the fastest strategy (or the
    one named by `strategy`); yields its name. What is timed for each strategy is `one_pass`, the caller's decode
    step where it has one (so the choice counts what runs around the products: a strategy that is faster alone
    can lose inside a step), else every layer's matmul once. Layers already tuned by an enclosing block are
    left to it; models whose Linear weights pass MAX_COPY_BYTES keep their matmuls (the strategies copy the
    weights)."""
    tuned = (ColumnMajorLinear, PackedLinear)
    layers = [layer for layer in model.modules() if isinstance(layer, Linear) and not isinstance(layer.matmul, tuned)
              and layer.weight.device.type == "cpu" and layer.weight.dtype in COPIED_DTYPES]
    if strategy is not None and strategy not in strategies():
        raise ValueError(f"unknown matmul strategy {strategy!r}; expected one of {', '.join(strategies())}")
    copy_bytes = sum(layer.weight.numel() * 4 for layer in layers)  # the strategies' float32 copies
    if rows < 1 or not layers or copy_bytes > MAX_COPY_BYTES:
        yield "installed"
        return
    if strategy is None:
        strategy, matmuls = _fastest(layers, rows, one_pass)
    else:
        matmuls = _build(strategy, layers)
    with _installed(layers, matmuls):
        yield strategy
