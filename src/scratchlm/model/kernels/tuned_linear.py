"""The decoding matmuls chosen by timing them: whichever way of computing x Wᵀ is fastest on this machine.

Wins on: every CPU, because no single rule does. A decode step multiplies `rows` rows (one per sequence) by
every weight matrix, and which kernel does that fastest depends on the CPU and its BLAS: on one Xeon with MKL,
(W xᵀ)ᵀ (few_rows_linear.py) doubled batch-1 speed; on an AVX2-only EPYC with the same MKL it is 1.3x slower
than x Wᵀ, and x @ Wᵀ with Wᵀ stored contiguously (column-major, `ColumnMajorLinear`) is fastest; a bf16 model
on a CPU without bf16 matrix instructions decodes a batch of 8 several times faster through float32-packed
oneDNN weights (packed_linear.py) than through torch's emulated bf16 kernels. Figures: docs/benchmarks.md.

`tuned_weights(model, rows)` therefore times each strategy on the model's own CPU Linear layers, all of them
in a row as one decode step runs them (so weights stream from memory as they do when decoding, rather than
sitting in cache as in a one-matrix micro-benchmark), and installs the fastest for the block. A batch of `rows`
also decodes a single row at times (a lone request on a server, the last sequence of a batch), and the fastest
kernel for one row need not be the fastest for several: on the AMD EPYC (Zen 4) of docs/benchmarks.md, W xᵀ
(few_rows_linear.py) decodes one row of tinystories-17m in 3.1-3.3 ms against 3.8-4.4 ms packed, and packed
weights decode 8 rows in 5.6-5.7 ms against 7.3-8.1 ms. So a caller whose batch varies (a server:
`also_one_row`) has the strategies timed at one row as well, and where the winners differ each layer
multiplies through `ByRows`: one row's winner for one row, the other's for more. The strategies:
- "installed": each layer's current matmul (few_rows_linear or the readable `linear`);
- "column_major": a contiguous float32 copy of Wᵀ, multiplied as x @ Wᵀ;
- "packed": oneDNN-packed float32 copies of the weights, where this torch has the ops;
- "packed_native": the weights oneDNN-packed in their own dtype (for float32 weights, "packed" again: skipped).
bf16/fp16 weights are copied as float32 and their inputs upcast, the product rounded back once: what a bf16
matmul computes (float32 sums, one rounding), at float32 speed where the CPU has no bf16 instructions.
Each strategy is timed once in each of TIMING_ROUNDS rounds, the strategies taking turns, and its fastest pass
counts: a moment of load from elsewhere (a server's HTTP side starting beside it) slows a pass of one strategy,
not all of that strategy's passes, which once made a server pick "installed" for 16 rows (9.8 ms a step of 8
rows instead of 7.0). Passes spread over rounds beat passes back to back: in process on a busy 2-core VM,
3 rounds of one pass picked the 1-row winner 60 times in 60, 2 rounds of two passes (the same time) 56 in 60.
The choice is remembered per (rows, threads, layer shapes, dtypes and matmuls) for the life of the process, so
only the first decode of a kind pays for the timing (4 passes over the weights per strategy and row count, one
of them a warm-up). Every
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
TimingPass = Callable[[int], Callable[[], object]]  # rows -> one decode step (or matmul pass) of that many rows
TIMING_ROUNDS = 3  # the strategies take turns, one timed pass each a round (the first after a warm-up pass)
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


class ByRows:
    """A layer's matmul through `one_row` for a single row (x (..., in) with one row in all) and `more_rows` for
    several: the fastest kernel for a lone sequence's step and for a batch's can differ (see above)."""

    def __init__(self, one_row: Matmul, more_rows: Matmul):
        self.one_row, self.more_rows = one_row, more_rows

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return (self.one_row if x.numel() == x.shape[-1] else self.more_rows)(x, weight)


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
    start = time.perf_counter()
    one_pass()
    return time.perf_counter() - start


def _key(layers: list[Linear], rows: int, timed: str) -> tuple:
    return (rows, timed, torch.get_num_threads(),
            tuple((tuple(layer.weight.shape), layer.weight.dtype,
                   getattr(layer.matmul, "__qualname__", type(layer.matmul).__name__)) for layer in layers))


def _fastest(layers: list[Linear], rows: int, timing_pass: TimingPass | None) -> str:
    """The name of the fastest strategy for `rows` rows (timed now, or remembered from an earlier call)."""
    key = _key(layers, rows, "matmuls" if timing_pass is None else "step")
    if key in _chosen:
        return _chosen[key]
    one_pass = timing_pass(rows) if timing_pass is not None else _matmul_pass(layers, rows)
    float32_only = all(layer.weight.dtype == torch.float32 for layer in layers)
    names = [name for name in strategies() if not (name == "packed_native" and float32_only)]  # = "packed"
    seconds = dict.fromkeys(names, float("inf"))
    with torch.inference_mode():
        for round_ in range(TIMING_ROUNDS):
            for name in names:
                with _installed(layers, _build(name, layers)):
                    if round_ == 0:
                        one_pass()  # a warm-up: oneDNN creates its kernels for a shape on first use
                    seconds[name] = min(seconds[name], _seconds_per_pass(one_pass))
    _chosen[key] = min(names, key=seconds.__getitem__)  # a tie: the first, "installed" (no copies)
    return _chosen[key]


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
                  timing_pass: TimingPass | None = None, also_one_row: bool = False) -> Iterator[str]:
    """Within the block, the CPU Linear layers of `model` multiply `rows` rows by the fastest strategy (or the
    one named by `strategy`); yields its name. With `also_one_row` (a batch that also decodes a single row at
    times) one row gets its own fastest where that differs (`ByRows`), and the name is "ONE (1 row), MORE (N
    rows)". What is timed for each strategy is `timing_pass(rows)`, the caller's decode
    step of that many rows where it has one (so the choice counts what runs around the products: a strategy
    that is faster alone can lose inside a step), else every layer's matmul once. Layers already tuned by an
    enclosing block are left to it; models whose Linear weights pass MAX_COPY_BYTES keep their matmuls (the
    strategies copy the weights)."""
    tuned = (ColumnMajorLinear, PackedLinear, ByRows)
    layers = [layer for layer in model.modules() if isinstance(layer, Linear) and not isinstance(layer.matmul, tuned)
              and layer.weight.device.type == "cpu" and layer.weight.dtype in COPIED_DTYPES]
    if strategy is not None and strategy not in strategies():
        raise ValueError(f"unknown matmul strategy {strategy!r}; expected one of {', '.join(strategies())}")
    copy_bytes = sum(layer.weight.numel() * 4 for layer in layers)  # the strategies' float32 copies
    if rows < 1 or not layers or copy_bytes > MAX_COPY_BYTES:
        yield "installed"
        return
    more = strategy or _fastest(layers, rows, timing_pass)
    one = _fastest(layers, 1, timing_pass) if strategy is None and also_one_row and rows > 1 else more
    if one == more:
        name, matmuls = more, _build(more, layers)
    else:
        name = f"{one} (1 row), {more} ({rows} rows)"
        matmuls = [ByRows(a, b) for a, b in zip(_build(one, layers), _build(more, layers))]
    with _installed(layers, matmuls):
        yield name
