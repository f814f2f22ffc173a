"""The CPU training step with and without train/allocator.py's speed path (glibc keeps freed memory).

Each side is a fresh process (malloc settings are per process and cannot be undone) that builds the modern
recipe's model and optimizer (configs/recipes/modern.toml: batch 16 x 256, vocab 4096), runs warm-up steps, then
times training steps exactly as the trainer runs them (``train_step``). The sides alternate (ABBA); reported: the
median step, the share of the process's CPU time spent in the kernel (page faults show up there), the peak RSS
and the load average seen. Target: ours (kept memory) faster than the default; the peak RSS it costs is
reported beside it.

    .venv/bin/python benchmarks/bench_allocator.py [--steps 10] [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from harness import machine_line

ROOT = Path(__file__).resolve().parents[1]

STEPS_IN_A_PROCESS = """
import json, resource, sys, time
import numpy as np, torch
from scratchlm.config import load_config
from scratchlm.data.batches import BatchSampler
from scratchlm.train.allocator import keep_freed_memory
from scratchlm.train.setup import build_model, build_optimizer
from scratchlm.train.step import train_step

keep, steps, threads = sys.argv[1] == "kept", int(sys.argv[2]), int(sys.argv[3])
applied = keep_freed_memory() if keep else False
torch.set_num_threads(threads)
config = load_config(sys.argv[4]).with_overrides(["model.vocab_size=4096"])
model = build_model(config, torch.device("cpu"))
optimizer = build_optimizer(model, config)
tokens = np.random.default_rng(0).integers(0, 4096, 1_000_000).astype(np.uint16)
sampler = BatchSampler(tokens, config.micro_batch_size, config.model.context_length, "cpu", seed=0)
times = []
for step in range(steps + 2):  # two warm-up steps
    batch = sampler.next()
    start, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    train_step(model, optimizer, [batch], lr=1e-3, grad_clip=1.0)[0].item()
    after = resource.getrusage(resource.RUSAGE_SELF)
    if step >= 2:
        times.append((time.perf_counter() - start, after.ru_stime - usage.ru_stime,
                      after.ru_utime - usage.ru_utime + after.ru_stime - usage.ru_stime))
peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"applied": applied, "times": times, "peak_mb": peak_mb}))
"""


def run_side(side: str, steps: int, threads: int) -> dict:
    env = os.environ | {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", STEPS_IN_A_PROCESS, side, str(steps), str(threads),
                          str(ROOT / "configs/recipes/modern.toml")], env=env, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(machine_line(), flush=True)
    results: dict[str, dict] = {"default": {"times": [], "peak_mb": 0.0}, "kept": {"times": [], "peak_mb": 0.0}}
    for round_index in range(args.rounds):
        for side in ("default", "kept") if round_index % 2 == 0 else ("kept", "default"):
            run = run_side(side, args.steps, args.threads)
            if side == "kept" and not run["applied"]:
                sys.exit("bench_allocator: keep_freed_memory() did not apply here (not glibc?)")
            results[side]["times"] += run["times"]
            results[side]["peak_mb"] = max(results[side]["peak_mb"], run["peak_mb"])
    print(f"\n## modern recipe training step, batch 16 x 256, {args.threads} threads, "
          f"{args.rounds} x {args.steps} steps a side (load average {os.getloadavg()[0]:.2f})")
    print("| malloc | median s/step | kernel share of CPU time | peak RSS MB |\n|---|---:|---:|---:|")
    medians = {}
    for side, result in results.items():
        medians[side] = statistics.median(t[0] for t in result["times"])
        kernel = sum(t[1] for t in result["times"]) / sum(t[2] for t in result["times"])
        print(f"| {side} | {medians[side]:.3f} | {kernel:.0%} | {result['peak_mb']:,.0f} |")
    print(f"time ratio kept/default = {medians['kept'] / medians['default']:.2f} (< 1.0: the speed path wins)")


if __name__ == "__main__":
    main()
