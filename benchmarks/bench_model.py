"""Forward+backward speed and training-step memory of TransformerLM against Hugging Face LlamaForCausalLM.

Same config, same weights (ours, seeded once, mapped by scratchlm.compat.hf and saved once as safetensors that
each contender loads; their logits are checked equal), fp32, 2 threads; HF runs with use_cache=False. The
contenders are timed in alternation (benchmarks/harness.py) and reported as medians with the time ratio (wall
clock, plus process CPU time per step, which stays meaningful when other jobs share the cores):
- ours (as the trainer runs it: the speed paths of model/kernels/ applied, chunked attention core on CPU) vs
  Llama with eager attention (target: ratio <= 1.0),
- ours vs Llama with SDPA attention (target: within 10%),
- optionally ours under torch.compile (`--compile`).
Peak memory of a training step is the peak RSS of a fresh subprocess per contender (interpreter, torch and
transformers imports included alike; its one model built and loaded from the saved weights + a few
forward/backward steps): the child's own high-water mark, which it reads from the kernel at its end
(harness.child_peak_rss_mb), exact where sampling the RSS every 10 ms missed transient peaks by tens of MB; the
lowest of the repeats counts. Its growth over a child that only imports is the model's own (weights, gradients,
what backward keeps, its transients). The memory runs add "plain": ours as
model/ reads, without kernels (the readable path a learner steps through; target: growth <= Llama eager's).

    .venv/bin/python benchmarks/bench_model.py            # tinystories-17m 8x256 and tiny, + memory
    .venv/bin/python benchmarks/bench_model.py --quick    # fewer repeats
    .venv/bin/python benchmarks/bench_model.py --compile  # also time torch.compile(ours)
    .venv/bin/python benchmarks/bench_model.py --memory-only --batch 4 --seq 256  # memory alone, any shape
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import child_peak_rss_mb, hf_llama, interleave, report, round_order  # noqa: E402
from scratchlm.compat.hf import to_hf_state_dict  # noqa: E402
from scratchlm.model import ModelConfig, TransformerLM, kernels  # noqa: E402

CONTENDERS = ("ours", "llama-eager", "llama-sdpa")


def save_weights(preset: str, root: Path, seed: int = 0) -> Path:
    """Seeded random weights of ours, saved once under both naming schemes (so each contender only loads its file);
    returns their folder."""
    cfg = ModelConfig.preset(preset)
    torch.manual_seed(seed)
    state = TransformerLM(cfg).state_dict()
    folder = root / preset
    folder.mkdir()
    save_file(state, folder / "ours.safetensors")
    save_file(to_hf_state_dict(state, cfg), folder / "llama.safetensors")
    return folder


def build(name: str, cfg: ModelConfig, folder: Path) -> torch.nn.Module:
    """One contender, and only it, loaded with the weights in `folder` (save_weights), so all compute one function."""
    if name in ("ours", "plain"):
        model = TransformerLM(cfg)
        if name == "ours":
            kernels.apply(model, "cpu")  # what train/setup.build_model does
        model.load_state_dict(load_file(folder / "ours.safetensors"))
        return model
    return hf_llama(cfg, load_file(folder / "llama.safetensors"), name.removeprefix("llama-"),
                    strict=not cfg.tie_embeddings)


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(model, LlamaForCausalLM):
        return model(input_ids=ids).logits
    return model(ids)


def train_step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """Forward, next-token cross-entropy, backward; gradients dropped afterwards."""
    logits = logits_of(model, ids[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    for p in model.parameters():
        p.grad = None


def check_same_function(models: dict[str, torch.nn.Module], ids: torch.Tensor) -> None:
    """All contenders give the same logits, up to fp32 summation order (their attention kernels differ)."""
    with torch.no_grad():
        logits = {name: logits_of(model, ids) for name, model in models.items()}
    for name, value in logits.items():
        worst = (value - logits["ours"]).abs().max().item()
        assert worst < 1e-4, f"{name}: logits differ from ours by up to {worst:.1e}, so it is not the same function"


def bench_speed(preset: str, batch: int, seq: int, repeats: int, with_compile: bool, folder: Path) -> None:
    cfg = ModelConfig.preset(preset)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    models = {name: build(name, cfg, folder).train() for name in CONTENDERS}
    check_same_function(models, ids[:, :-1])
    if with_compile:
        compiled = torch.compile(build("ours", cfg, folder).train())
        start = time.perf_counter()
        train_step(compiled, ids)
        print(f"torch.compile(ours) first step (compile) took {time.perf_counter() - start:.1f} s")
        models["ours-compiled"] = compiled
    cpu_seconds: dict[str, list[float]] = {name: [] for name in models}

    def timed_step(name: str, model: torch.nn.Module) -> None:
        start = time.process_time()
        train_step(model, ids)
        cpu_seconds[name].append(time.process_time() - start)

    results = interleave({name: (lambda n=name, m=m: timed_step(n, m)) for name, m in models.items()}, repeats)
    title = f"{preset} forward+backward, batch {batch} x {seq}, fp32, {torch.get_num_threads()} threads"
    tokens = batch * seq
    report(title + " — vs Llama eager", results, "ours", "llama-eager", tokens, "tokens")
    report(title + " — vs Llama sdpa", results, "ours", "llama-sdpa", tokens, "tokens")
    report_cpu_time(title, cpu_seconds)
    if with_compile:
        report(title + " — torch.compile", results, "ours-compiled", "ours", tokens, "tokens")


def report_cpu_time(title: str, cpu_seconds: dict[str, list[float]]) -> None:
    """Process CPU time per step (warm-up dropped): robust where other jobs share the cores and inflate wall time."""
    medians = {name: statistics.median(times[1:]) for name, times in cpu_seconds.items()}
    print(f"\n## {title} — process CPU seconds per step (median)")
    for name, seconds in medians.items():
        print(f"{name}: {seconds:.3f} s  (ours/{name} = {medians['ours'] / seconds:.2f})")


# Every child, the baseline too, imports this module (torch, transformers' Llama, safetensors, scratchlm).
CHILD_IMPORTS = (f"import sys, torch; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
                 f"import bench_model as b; torch.set_num_threads(2); ")


def child_snippet(name: str, preset: str, batch: int, seq: int, folder: Path) -> str:
    return CHILD_IMPORTS + (
        f"cfg = b.ModelConfig.preset({preset!r}); m = b.build({name!r}, cfg, b.Path({str(folder)!r})).train(); "
        f"ids = torch.randint(0, cfg.vocab_size, ({batch}, {seq + 1})); [b.train_step(m, ids) for _ in range(3)]")


def bench_memory(preset: str, batch: int, seq: int, repeats: int, folder: Path) -> None:
    snippets = {name: child_snippet(name, preset, batch, seq, folder) for name in ("plain", *CONTENDERS)}
    snippets["baseline (imports only)"] = CHILD_IMPORTS
    peaks: dict[str, list[float]] = {name: [] for name in snippets}
    for round_index in range(repeats):
        for name in round_order(list(snippets), round_index):
            peaks[name].append(child_peak_rss_mb(snippets[name]))
    title = f"{preset} training-step peak RSS, batch {batch} x {seq}, one subprocess per run"
    print(f"\n## {title}: each child's own high-water mark (VmHWM), MB, {repeats} runs each")
    for name, values in peaks.items():
        print(f"{name}: {', '.join(f'{value:,.1f}' for value in values)}")
    baseline = min(peaks["baseline (imports only)"])
    print(f"baseline peak RSS (interpreter + imports, no model): {baseline:,.0f} MB")
    growth = {name: min(peaks[name]) - baseline for name in ("plain", *CONTENDERS)}
    print(f"\n## {title} — peak RSS growth over the baseline (the model's own memory)")
    print("| contender | growth MB | / llama-eager |\n|---|---:|---:|")
    for name, grown in growth.items():
        print(f"| {name} | {grown:,.0f} | {grown / growth['llama-eager']:.2f} |")
    print("JSON " + json.dumps({"title": title, "peak_rss_growth_mb": growth}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, skip memory")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(ours)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory-only", action="store_true", help="only the peak-RSS runs, at --batch x --seq")
    parser.add_argument("--batch", type=int, default=8, help="batch of the memory runs (default: 8)")
    parser.add_argument("--seq", type=int, default=256, help="sequence length of the memory runs (default: 256)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats = 2 if args.quick else 5
    with tempfile.TemporaryDirectory() as root:
        if args.memory_only:
            folder = save_weights("tinystories-17m", Path(root))
            bench_memory("tinystories-17m", args.batch, args.seq, repeats=1, folder=folder)
            return
        weights = {preset: save_weights(preset, Path(root)) for preset in ("tinystories-17m", "tiny")}
        bench_speed("tinystories-17m", 8, 256, repeats, args.compile, weights["tinystories-17m"])
        bench_speed("tiny", 8, 32, repeats * 5, with_compile=False, folder=weights["tiny"])
        if not args.quick:
            bench_memory("tinystories-17m", args.batch, args.seq, repeats=2, folder=weights["tinystories-17m"])


if __name__ == "__main__":
    main()
