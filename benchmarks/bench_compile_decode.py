"""torch.compile (inductor, on the CPU) against our eager fused step, per decoding step: issue 23 asks it measured.

    .venv/bin/python benchmarks/bench_compile_decode.py [--quick] [--threads 2]

The contender is model/kernels/compiled_step.py's `CompiledStep` (what `generate(..., compile=True)` and `scratchlm
generate --compile` use for bf16 models), compiled here for float32 too, to show why it is not used there. Ours is
`kernels.decoding`'s eager step. Both decode the same 100 steps at positions 22-121 of a KV cache of
tinystories-17m (random weights), fp32 and bf16, batch 1 and 8; reported: median ms a step, the ratio, and the
time of the compiled step's first pass over the steps (its compile, which every new process pays again, longer
when inductor's on-disk cache is cold).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from harness import machine_line
from scratchlm.model import KVCache, ModelConfig, TransformerLM, kernels
from scratchlm.model.kernels.compiled_step import CompiledStep

PRESET = "tinystories-17m"
STEPS = 100
QUICK_STEPS = 30


def median_ms(step, steps: int) -> float:
    times = []
    for position in range(22, 22 + steps):
        start = time.perf_counter()
        step(position)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure(dtype: torch.dtype, rows: int, steps: int) -> tuple[float, float, float]:
    """(ours ms a step, compiled ms a step, seconds of the compiled step's first pass: its compiles)."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.preset(PRESET), dtype=dtype).eval()
    ids = torch.zeros(rows, dtype=torch.long)
    with torch.inference_mode(), kernels.decoding(model) as ours:
        def prompted() -> KVCache:
            cache = KVCache.for_model(model, rows)
            ours(ids[:, None].expand(rows, 22).contiguous(), cache)
            return cache

        cache = prompted()
        ours_ms = median_ms(lambda position: ours(ids[:, None], cache), steps)
        compiled = CompiledStep(model)
        cache = prompted()
        start = time.perf_counter()
        median_ms(lambda position: compiled(ids[:, None], cache), steps)  # compiles at its first step
        first_pass_s = time.perf_counter() - start
        cache = prompted()
        compiled_ms = median_ms(lambda position: compiled(ids[:, None], cache), steps)
    return ours_ms, compiled_ms, first_pass_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps instead of {STEPS}")
    args = parser.parse_args()
    print(machine_line(), flush=True)
    steps = QUICK_STEPS if args.quick else STEPS
    torch.set_num_threads(args.threads)
    print(f"{PRESET}, {args.threads} threads, median of {steps} steps at positions 22-{21 + steps}")
    print("| dtype, batch | ours (kernels.decoding) ms | torch.compile ms | compiled / ours | first pass s |")
    print("|---|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 8):
            ours_ms, compiled_ms, first_pass_s = measure(dtype, rows, steps)
            print(f"| {str(dtype).removeprefix('torch.')}, {rows} | {ours_ms:.2f} | {compiled_ms:.2f} | "
                  f"{compiled_ms / ours_ms:.2f} | {first_pass_s:.1f} |", flush=True)


if __name__ == "__main__":
    main()
