"""GPU training throughput: tokens/s, MFU and peak memory of the real training step on one CUDA device.

Usage: ``python benchmarks/gpu_throughput.py --out gpu_results/gpu_throughput.json [--quick]`` (writes the JSON and
a Markdown table beside it, ``.md``). Without CUDA it says so in one line and exits 0. Not named bench_*: it needs
a GPU. Both files are written as results come, so a run killed part-way (a timeout) keeps every finished shape:
the ``.md`` header first and one row appended per shape, the JSON rewritten (atomically) after each shape with
``"complete": false`` until the last. A shape that raises (out of memory, say) gets an error row, the next shape
still runs, and the exit status is 1.

Shapes: tinystories-17m and GPT-2 small with the CS336 recipe (AdamW), and tinystories-17m with the modern recipe
(configs/recipes/modern.toml: Muon for the hidden matrices, QK-norm, ReLU², soft-capped logits) beside it, so the
cost of the recipe's pieces on a GPU is one row apart.

What is timed: ``step.train_step`` (forward, backward, global-norm clipping, the optimizer) exactly as the trainer
runs it, with the one-GPU fast path switched on: bf16 autocast (fp32 master weights), TF32 matmuls,
``torch.compile`` of the model and the fused SDPA attention kernel. Batches are random token ids already on the
GPU: the trainer's pinned, non-blocking copies overlap compute, so data loading is not what this measures.
Each shape warms up (compilation, autotuning, allocator) before ``--seconds`` of timed steps; the GPU is
synchronised only around the timed window.

MFU = step FLOPs (forward + backward from scratchlm.accounting, attention T^2 terms included) x steps / time /
the device's dense bf16 peak (H100 SXM and H200: 989 TFLOP/s; see scratchlm.train.metrics.PEAK_FLOPS).
Targets (issue 6): tinystories-17m >= 400k tokens/s; GPT-2-small shape >= 45% MFU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from scratchlm.accounting.params_flops import training_step_flops
from scratchlm.config import RunConfig, load_config
from scratchlm.model.config import PRESETS
from scratchlm.paths import DEFAULT_RECIPE
from scratchlm.train.metrics import device_peak_flops
from scratchlm.train.setup import build_model, build_optimizer, wrap_model
from scratchlm.train.step import train_step

TARGETS = {"tinystories-17m": ("tokens_per_s", 400_000), "gpt2-small": ("mfu", 0.45)}


@dataclass(frozen=True)
class Shape:
    preset: str
    batch_size: int  # sequences per step (context length is the preset's)
    recipe: str = "cs336"  # cs336: the preset as it is, AdamW | modern: configs/recipes/modern.toml at its shape


SHAPES = (Shape("tinystories-17m", 128), Shape("tinystories-17m", 128, "modern"), Shape("gpt2-small", 32))
SHAPE_KEYS = ("vocab_size", "context_length", "d_model", "num_layers", "num_heads")


def run_config(shape: Shape) -> RunConfig:
    train = {"device": "cuda", "dtype": "bf16", "compile": True, "fused_attention": True, "max_steps": 10}
    if shape.recipe == "cs336":
        return RunConfig.from_dict({"model": {"preset": shape.preset}, "optim": {"warmup_iters": 0},
                                    "data": {"batch_size": shape.batch_size}, "train": train})
    # The modern recipe's switches and optimizer (Muon, QK-norm, ReLU², ...) at the preset's shape; d_ff follows
    # the recipe's FFN (ReLU²: 4·d_model).
    preset = PRESETS[shape.preset]
    shape_overrides = [f"model.{key}={preset[key]}" for key in SHAPE_KEYS] + ["model.d_ff=none"]
    return load_config(DEFAULT_RECIPE, [*shape_overrides, f"data.batch_size={shape.batch_size}",
                                        "optim.warmup_iters=0", *(f"train.{k}={v}" for k, v in train.items())])


def measure(shape: Shape, warmup_steps: int, seconds: float) -> dict:
    """Warm up, then time steps for about ``seconds``; return the figures for this shape."""
    config = run_config(shape)
    device = torch.device("cuda")
    raw = build_model(config, device)
    model = wrap_model(raw, config)
    optimizer = build_optimizer(raw, config)
    context, vocab = config.model.context_length, config.model.vocab_size
    tokens = torch.randint(0, vocab, (shape.batch_size, context + 1), device=device)
    batches = [(tokens[:, :-1], tokens[:, 1:])]

    def step() -> torch.Tensor:
        return train_step(model, optimizer, batches, lr=1e-4, grad_clip=1.0, dtype="bf16")[0]

    start = time.perf_counter()
    for _ in range(warmup_steps):
        step()
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start
    torch.cuda.reset_peak_memory_stats()
    steps, start = 0, time.perf_counter()
    while steps < 5 or time.perf_counter() - start < seconds:
        loss = step()
        steps += 1
        if steps % 10 == 0:
            torch.cuda.synchronize()  # keeps the host from queueing far ahead of the time budget
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    flops = training_step_flops(config.model, context, shape.batch_size)
    peak = device_peak_flops(torch.cuda.get_device_name(device), "bf16")
    achieved = steps * (flops.forward + flops.backward) / elapsed
    return {"preset": shape.preset, "recipe": shape.recipe, "batch_size": shape.batch_size, "context_length": context,
            "parameters": sum(p.numel() for p in raw.parameters()), "steps": steps, "seconds": elapsed,
            "warmup_s": warmup_s, "step_ms": 1000 * elapsed / steps,
            "tokens_per_s": steps * shape.batch_size * context / elapsed, "tflops": achieved / 1e12,
            "mfu": achieved / peak if peak else None, "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
            "final_loss": loss.item()}


def verdict(row: dict) -> str:
    metric, target = TARGETS.get(row["preset"], (None, None)) if row["recipe"] == "cs336" else (None, None)
    if metric is None or row.get(metric) is None:
        return "n/a"
    return f"{'PASS' if row[metric] >= target else 'MISS'} ({metric} >= {target:g})"


def markdown_header(report: dict) -> str:
    return "\n".join([
        f"# GPU throughput ({report['date']})", "",
        f"Device: {report['device']}; torch {report['torch']}; bf16 autocast + TF32 + torch.compile + fused "
        f"attention; peak bf16 {report['peak_tflops']} TFLOP/s.", "",
        "| shape | recipe | batch x context | params | step ms | tokens/s | TFLOP/s | MFU | peak mem GiB | target |",
        "|---|---|---|---|---|---|---|---|---|---|"]) + "\n"


def markdown_row(row: dict) -> str:
    if "error" in row:
        return (f"| {row['preset']} | {row['recipe']} | {row['batch_size']} x ? | - | - | - | - | - | - | "
                f"ERROR: {row['error']} |\n")
    mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
    return (f"| {row['preset']} | {row['recipe']} | {row['batch_size']} x {row['context_length']} | "
            f"{row['parameters'] / 1e6:.1f}M | {row['step_ms']:.1f} | {row['tokens_per_s']:,.0f} | "
            f"{row['tflops']:.1f} | {mfu} | {row['peak_memory_gib']:.2f} | {verdict(row)} |\n")


def write_json(path: Path, report: dict) -> None:
    """Replace ``path`` atomically: a kill mid-write leaves the previous (shorter) report, never half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_results/gpu_throughput.json"),
                        help="JSON results path (a .md table is written beside it)")
    parser.add_argument("--seconds", type=float, default=30.0, help="timed seconds per shape (default 30)")
    parser.add_argument("--warmup-steps", type=int, default=8, help="untimed steps first (compilation)")
    parser.add_argument("--quick", action="store_true", help="5 timed seconds per shape")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_throughput: no CUDA device here (torch.cuda.is_available() is False); nothing to measure.")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    seconds = 5.0 if args.quick else args.seconds
    name = torch.cuda.get_device_name()
    peak = device_peak_flops(name, "bf16")
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "device": name,
              "torch": torch.__version__, "peak_tflops": peak / 1e12 if peak else None, "complete": False,
              "results": []}
    md = args.out.with_suffix(".md")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(markdown_header(report))
    write_json(args.out, report)
    failed = False
    for shape in SHAPES:
        try:
            row = measure(shape, args.warmup_steps, seconds)
        except Exception as exc:  # noqa: BLE001 - one shape's failure (OOM, compile error) must not lose the other
            failed = True
            row = {"preset": shape.preset, "recipe": shape.recipe, "batch_size": shape.batch_size,
                   "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200].replace("|", "/")}
            print(f"{shape.preset}: FAILED: {row['error']}", flush=True)
        else:
            mfu = "n/a" if row["mfu"] is None else f"{row['mfu']:.1%}"
            print(f"{row['preset']}: {row['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, peak "
                  f"{row['peak_memory_gib']:.2f} GiB -> {verdict(row)}", flush=True)
        finally:
            torch.cuda.empty_cache()
        report["results"].append(row)
        with md.open("a") as f:
            f.write(markdown_row(row))
        write_json(args.out, report)
    report["complete"] = True
    write_json(args.out, report)
    print(f"wrote {args.out} and {md}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
