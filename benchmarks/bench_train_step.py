"""One full training step (forward, backward, clip, AdamW) of ours vs transformers' LlamaForCausalLM, plus the
trainer's own per-step overhead (data loading from a memmap, the sync-free bookkeeping, amortized logging).

Ours: ``scratchlm.train.step.train_step`` exactly as the trainer runs it (our attention, our AdamW foreach,
our clipping). Rivals: ``LlamaForCausalLM`` with eager attention and with SDPA (use_cache=False), built from the
SAME random weights through scratchlm.compat.hf, trained with ``torch.optim.AdamW(foreach=True)`` (same decay groups),
``F.cross_entropy`` and ``clip_grad_norm_``. tinystories-17m, fp32, batch 8 x 256, 2 threads, interleaved.
``--compile`` adds ours under ``torch.compile`` (inductor; what ``train.compile = true`` runs), its compile time
reported apart (the first call), so the table says whether compiling pays on this machine. ``--kept-memory`` first
tells glibc to keep freed memory (train/allocator.py), as ``scratchlm train`` does on a CPU: the step as the trainer
runs it. It holds for the whole process, so the rivals run with it too (without it each step page-faults its large
buffers in again, HF's more than ours).

Where the step stands against the machine: the peak matrix-product FLOP/s measured in the same run
(``harness.peak_matmul_flops``: a large square fp32 ``torch.mm``, and bf16 where the CPU has bf16 arithmetic), and
each contender's achieved FLOP/s: the model's forward + backward FLOPs per step (``scratchlm.accounting.
training_step_flops``, the count the trainer's MFU uses; the optimizer's elementwise work left out) over its median
step, as a fraction of the fp32 peak. Peak memory: one fresh subprocess per contender (the plain model as model/
reads, without kernels; ours as the trainer builds it; HF eager), each building its one model and optimizer and
running a few steps, its own high-water mark (``harness.child_peak_rss_mb``), with the growth over a child that
only imports.

Targets (issue 36): ours >= 1.10x as fast as HF eager + torch AdamW, or >= 75% of the measured fp32 peak; the
plain model's peak memory <= HF eager's; data loading + logging < 2% of our step time.

    .venv/bin/python benchmarks/bench_train_step.py [--quick] [--threads 2] [--compile] [--no-memory] [--kept-memory]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    child_peak_rss_mb,
    hf_llama,
    interleave,
    machine_line,
    peak_matmul_flops,
    report,
    round_order,
)
from scratchlm.accounting.params_flops import training_step_flops  # noqa: E402
from scratchlm.compat.hf import to_hf_state_dict  # noqa: E402
from scratchlm.config import RunConfig  # noqa: E402
from scratchlm.data.batches import BatchSampler  # noqa: E402
from scratchlm.data.token_file import open_token_file, write_token_file  # noqa: E402
from scratchlm.model import TransformerLM  # noqa: E402
from scratchlm.model.kernels.cpu import has_native_bf16  # noqa: E402
from scratchlm.train.allocator import keep_freed_memory  # noqa: E402
from scratchlm.train.metrics import MetricsLogger  # noqa: E402
from scratchlm.train.setup import build_model, build_optimizer, wrap_model  # noqa: E402
from scratchlm.train.step import DivergenceWatch, train_step  # noqa: E402

BATCH, LOG_EVERY = 8, 10


def run_config() -> RunConfig:
    return RunConfig.from_dict({"model": {"preset": "tinystories-17m"}, "optim": {"warmup_iters": 0},
                                "train": {"device": "cpu"}})


def random_batch(config: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.model.vocab_size, (BATCH, config.model.context_length + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def ours_step(config: RunConfig, batch, compiled: bool = False):
    model = build_model(config, torch.device("cpu"))
    optimizer = build_optimizer(model, config)
    trained = wrap_model(model, config.with_overrides(["train.compile=true"])) if compiled else model
    return model, lambda: train_step(trained, optimizer, [batch], lr=1e-4, grad_clip=1.0)


def hf_step(config: RunConfig, ours: torch.nn.Module | None, batch, attention: str):
    """HF Llama + torch AdamW, with ours' weights (or, with ``ours=None``, a seeded model of the same shape: the
    memory children build one model each)."""
    if ours is None:
        torch.manual_seed(config.train.seed)
        ours = TransformerLM(config.model)
    model = hf_llama(config.model, to_hf_state_dict(ours.state_dict(), config.model), attention)  # same weights
    del ours  # (the memory children keep only the HF copy)
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), foreach=True)
    inputs, targets = batch

    def step():
        logits = model(input_ids=inputs).logits  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def plain_step(config: RunConfig, batch):
    """The model as model/ reads (no kernels) with our optimizer: the readable path's training step."""
    torch.manual_seed(config.train.seed)
    model = TransformerLM(config.model)
    optimizer = build_optimizer(model, config)
    return lambda: train_step(model, optimizer, [batch], lr=1e-4, grad_clip=1.0)


MEMORY_CONTENDERS = ("plain", "ours", "hf_eager")


def memory_child(name: str, steps: int = 3) -> None:
    """What one memory subprocess runs: one contender's model and optimizer, `steps` training steps."""
    config = run_config()
    batch = random_batch(config)
    step = {"plain": lambda: plain_step(config, batch), "ours": lambda: ours_step(config, batch)[1],
            "hf_eager": lambda: hf_step(config, None, batch, "eager")}[name]()
    for _ in range(steps):
        step()


def bench_memory(threads: int, repeats: int) -> None:
    """Peak RSS of each contender's training step, one fresh subprocess per run, in turn (ABBA); the lowest of the
    repeats counts (a child's peak moves by tens of MB run to run), and its growth over an imports-only child."""
    imports = (f"import sys, torch; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
               f"import bench_train_step as b; torch.set_num_threads({threads}); ")
    snippets = {name: imports + f"b.memory_child({name!r})" for name in MEMORY_CONTENDERS}
    snippets["baseline (imports only)"] = imports
    peaks: dict[str, list[float]] = {name: [] for name in snippets}
    for round_index in range(repeats):
        for name in round_order(list(snippets), round_index):
            peaks[name].append(child_peak_rss_mb(snippets[name]))
    baseline = min(peaks["baseline (imports only)"])
    growth = {name: min(peaks[name]) - baseline for name in MEMORY_CONTENDERS}
    print(f"\n## training-step peak RSS, batch {BATCH} x {run_config().model.context_length}, one subprocess per run "
          f"({repeats} run(s) each, the lowest counts)")
    print(machine_line())
    print("| contender | peak RSS MB (each run) | growth over imports MB | / hf_eager |\n|---|---|---:|---:|")
    for name in MEMORY_CONTENDERS:
        runs = ", ".join(f"{value:,.1f}" for value in peaks[name])
        print(f"| {name} | {runs} | {growth[name]:,.0f} | {growth[name] / growth['hf_eager']:.2f} |")
    print(f"baseline (interpreter + imports, no model): {baseline:,.0f} MB")
    met = growth["plain"] <= growth["hf_eager"]
    print(f"target plain <= hf_eager: {'met' if met else 'MISSED'} "
          f"({growth['plain']:,.0f} vs {growth['hf_eager']:,.0f} MB)")


def report_against_peak(config: RunConfig, results: dict, names: list[str]) -> None:
    """Each contender's achieved FLOP/s against the peak matmul FLOP/s measured now, and the issue's targets."""
    context = config.model.context_length
    flops = training_step_flops(config.model, context, BATCH)
    step_flops = flops.forward + flops.backward  # the matmuls; AdamW's ~14 FLOPs a parameter are left out
    fp32_peak = peak_matmul_flops("float32")
    bf16_peak = peak_matmul_flops("bfloat16") if has_native_bf16() else None
    print("\n## where the step stands against the machine")
    print(machine_line())
    bf16_text = (f", bf16 {bf16_peak / 1e9:,.1f} GFLOP/s" if bf16_peak else
                 ", bf16 not probed (no bf16 arithmetic on this CPU, or torch held below AVX-512)")
    print(f"peak matmul (2048 x 2048 torch.mm, median of 5, {torch.get_num_threads()} threads): "
          f"fp32 {fp32_peak / 1e9:,.1f} GFLOP/s{bf16_text}")
    print(f"model FLOPs a step (forward + backward, scratchlm.accounting.training_step_flops): "
          f"{step_flops / 1e9:,.1f} GFLOP")
    print("| contender | median s | achieved GFLOP/s | of fp32 peak |\n|---|---:|---:|---:|")
    for name in names:
        achieved = step_flops / results[name].median
        print(f"| {name} | {results[name].median:.3f} | {achieved / 1e9:,.1f} | {achieved / fp32_peak:.0%} |")
    speedup = results["hf_eager"].median / results["ours"].median
    share = step_flops / results["ours"].median / fp32_peak
    met = speedup >= 1.10 or share >= 0.75
    print(f"target ours >= 1.10x HF eager ({speedup:.2f}x) or >= 75% of the fp32 peak ({share:.0%}): "
          f"{'met' if met else 'MISSED'}")


def overhead_per_step(config: RunConfig, repeats: int) -> float:
    """Seconds of trainer work per step besides the step itself: a memmap batch, bookkeeping, 1/LOG_EVERY log."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "train.tok"
        write_token_file(path, np.random.default_rng(0).integers(0, 10_000, 2_000_000), vocab_size=10_000)
        sampler = BatchSampler(open_token_file(path).tokens, BATCH, config.model.context_length, "cpu", seed=0)
        logger = MetricsLogger(Path(folder), total_steps=10**6, quiet=True)
        watch, window = DivergenceWatch(torch.device("cpu"), None), torch.zeros(())
        loss, norm = torch.tensor(3.0), torch.tensor(1.0)
        times = []
        for step in range(repeats * LOG_EVERY):
            start = time.perf_counter()
            sampler.next()
            watch.update(step, loss, norm)
            window += loss
            logger.advance()
            if step % LOG_EVERY == 0:
                watch.check()
                logger.log({"kind": "train", "step": step, "tokens": 0, "wall_time": 0.0, "loss": window.item(),
                            "lr": 1e-4, "grad_norm": norm.item(), "tokens_per_s": 1.0, "mfu": None})
            times.append(time.perf_counter() - start)
        logger.close()
    return statistics.mean(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (noisier)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also ours under torch.compile (inductor)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS subprocesses")
    parser.add_argument("--kept-memory", action="store_true",
                        help="glibc keeps freed memory, as `scratchlm train` sets on a CPU (every contender)")
    args = parser.parse_args()
    if args.kept_memory and not keep_freed_memory():
        sys.exit("--kept-memory: this C library does not take the setting (glibc's mallopt)")
    torch.set_num_threads(args.threads)
    repeats = 2 if args.quick else 6
    config = run_config()
    context = config.model.context_length
    batch = random_batch(config)
    ours_model, ours = ours_step(config, batch)
    contenders = {"ours": ours, "hf_eager": hf_step(config, ours_model, batch, "eager"),
                  "hf_sdpa": hf_step(config, ours_model, batch, "sdpa")}
    if args.compile:
        torch.manual_seed(0)  # (weights differ from ours' eager copy: only the speed is compared)
        _, compiled = ours_step(config, batch, compiled=True)
        start = time.perf_counter()
        compiled()
        compile_seconds = time.perf_counter() - start
        contenders["ours_compiled"] = compiled
    results = interleave(contenders, repeats=repeats, warmup=1)
    work = BATCH * context
    allocator = "glibc keeps freed memory (--kept-memory)" if args.kept_memory else "the default allocator"
    print(f"tinystories-17m, fp32, batch {BATCH} x {context}, {args.threads} threads, {repeats} interleaved repeats, "
          f"{allocator}")
    report("train step vs HF Llama (eager attention) + torch AdamW", results, "ours", "hf_eager", work, "tokens")
    report("train step vs HF Llama (SDPA attention) + torch AdamW", results, "ours", "hf_sdpa", work, "tokens")
    if args.compile:
        print(f"\ntorch.compile: first call (compiling) {compile_seconds:.1f} s")
        report("ours compiled vs ours eager", results, "ours_compiled", "ours", work, "tokens")
        report("ours compiled vs HF Llama (eager attention) + torch AdamW", results, "ours_compiled", "hf_eager",
               work, "tokens")
    report_against_peak(config, results, list(contenders))
    overhead = overhead_per_step(config, repeats=20)
    share = overhead / results["ours"].median
    print(f"\n## trainer overhead per step (memmap batch + bookkeeping + 1/{LOG_EVERY} of a log record)")
    print(f"{overhead * 1e3:.3f} ms = {share:.3%} of our median step ({results['ours'].median:.3f} s); "
          f"target < 2%: {'PASS' if share < 0.02 else 'MISS'}")
    if not args.no_memory:
        bench_memory(args.threads, repeats=1 if args.quick else 3)


if __name__ == "__main__":
    main()
