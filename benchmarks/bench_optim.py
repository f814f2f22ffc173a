"""Our AdamW and Muon steps vs torch.optim's, on tinystories-17m; Muon's cost in a training step; checkpoint times.

AdamW target: ours no slower than torch (time ratio <= 1.0). torch is timed both ways because which of its paths is
faster on a CPU depends on the machine. Each optimizer updates its own copy of the same parameters with the
same fixed gradients, timed in alternation (benchmarks/harness.py); afterwards their parameters must agree:
bit-identical for torch foreach (same operations in the same order), within the printed tolerance for fused
(one kernel that rounds differently). The checkpoint part
times ``CheckpointManager.save`` (safetensors + JSON, fsync, sha256, rename) and ``load`` (verify + restore) of
the same model with a populated optimizer state.

Muon (``--part muon``): our Muon (batched and per-tensor Newton-Schulz) vs torch.optim.Muon over the hidden
matrices (parameters asserted bit-identical afterwards); then our MuonAdamW (Muon on the hidden matrices, AdamW
on the embeddings, head and gains) vs our AdamW over the whole model. Project target: the Muon step costs no
more than 1.5x our AdamW step. ``--part muon-train`` sets that in context: a whole training step (forward,
backward, clipping, optimizer) at batch 8 x 256 with MuonAdamW vs with AdamW.

    .venv/bin/python benchmarks/bench_optim.py [--quick] [--threads 2] [--part all|adamw|checkpoint|muon|muon-train]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleave, report  # noqa: E402
from scratchlm.config import RunConfig  # noqa: E402
from scratchlm.model import ModelConfig, TransformerLM  # noqa: E402
from scratchlm.optim.adamw import AdamW, param_groups_for  # noqa: E402
from scratchlm.optim.groups import recipe_param_groups  # noqa: E402
from scratchlm.optim.hybrid import MuonAdamW  # noqa: E402
from scratchlm.optim.muon import Muon  # noqa: E402
from scratchlm.train.checkpoint import CheckpointManager  # noqa: E402
from scratchlm.train.setup import build_optimizer  # noqa: E402
from scratchlm.train.step import train_step  # noqa: E402


def model_with_grads(seed: int) -> TransformerLM:
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig.preset("tinystories-17m"))
    generator = torch.Generator().manual_seed(1)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator) * 1e-3
    return model


# torch variant -> (its constructor flag, (rtol, atol) within which its parameters must match ours after the run).
# Fused lands a few ulps away; a missed or wrong step (lr 1e-3 on parameters of size ~0.1-2) is far outside that.
TORCH_VARIANTS = {
    "torch.optim.AdamW foreach": ({"foreach": True}, (0.0, 0.0)),
    "torch.optim.AdamW fused": ({"fused": True}, (1e-5, 1e-6)),
}


def bench_step(repeats: int) -> None:
    ours_model = model_with_grads(0)
    steps = {"scratchlm AdamW": AdamW(param_groups_for(ours_model, 0.1), lr=1e-3, foreach=True).step}
    torch_models = {name: model_with_grads(0) for name in TORCH_VARIANTS}
    for name, (flag, _) in TORCH_VARIANTS.items():
        steps[name] = torch.optim.AdamW(param_groups_for(torch_models[name], 0.1), lr=1e-3, **flag).step
    num_params = sum(p.numel() for p in ours_model.parameters())
    print(f"tinystories-17m: {num_params / 1e6:.1f} M parameters, {torch.get_num_threads()} threads")
    warmup = 2
    results = interleave(steps, repeats, warmup=warmup)
    for name in TORCH_VARIANTS:
        report(f"AdamW step (fp32, tinystories-17m): ours vs {name}", results, "scratchlm AdamW", name,
               unit_work=num_params / 1e6, unit="M params")
    check_same_parameters(ours_model, torch_models, steps=warmup + repeats)


def check_same_parameters(ours: torch.nn.Module, rivals: dict[str, torch.nn.Module], steps: int) -> None:
    """After the same number of steps, every rival's parameters must match ours within its stated tolerance."""
    print(f"\nparameters after {steps} steps, each torch variant vs ours:")
    for name, model in rivals.items():
        rtol, atol = TORCH_VARIANTS[name][1]
        pairs = list(zip(ours.parameters(), model.parameters()))
        worst = max((a - b).abs().max().item() for a, b in pairs)
        assert all(torch.allclose(b, a, rtol=rtol, atol=atol) for a, b in pairs), f"{name} diverged from ours: {worst}"
        print(f"- {name}: max |difference| {worst:.1e}, asserted within rtol {rtol:g}, atol {atol:g}")


def bench_checkpoint(repeats: int) -> None:
    model = model_with_grads(0)
    optimizer = AdamW(param_groups_for(model, 0.1), lr=1e-3)
    optimizer.step()
    save_s, load_s, verify_s = [], [], []
    with tempfile.TemporaryDirectory(dir=".") as run_dir:
        manager = CheckpointManager(run_dir, keep_last=1)
        for step in range(repeats):
            start = time.perf_counter()
            path = manager.save(step, model, optimizer, config={}, sampler_state={})
            save_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            assert manager.latest_valid() == path
            verify_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            manager.load(path, model, optimizer)
            load_s.append(time.perf_counter() - start)
        size_mb = sum(f.stat().st_size for f in path.iterdir()) / 2**20
    print("\n## Checkpoint (tinystories-17m, model + AdamW state)")
    print("| operation | median s |\n|---|---:|")
    print(f"| save (write, fsync, sha256, rename) | {statistics.median(save_s):.3f} |")
    print(f"| latest_valid (re-hash all files) | {statistics.median(verify_s):.3f} |")
    print(f"| load (verify + restore weights, optimizer, RNG) | {statistics.median(load_s):.3f} |")
    print(f"checkpoint size {size_mb:,.0f} MB")


MUON_RECIPE = RunConfig().with_overrides(["optim.optimizer=muon"])


def hidden_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return recipe_param_groups(model, MUON_RECIPE.optim)[0]["params"]


def muon_adamw(model: torch.nn.Module) -> MuonAdamW:
    """Muon on the hidden matrices, AdamW (decay on matrices only) on the rest: the trainer's own optimizer."""
    return build_optimizer(model, MUON_RECIPE)


def whole_model_adamw(model: torch.nn.Module) -> AdamW:
    return AdamW(param_groups_for(model, 0.1), lr=1e-3, betas=(0.9, 0.95), foreach=True)


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch) -> Callable[[], object]:
    return lambda: train_step(model, optimizer, [batch], lr=1e-3, grad_clip=1.0)


def bench_muon(repeats: int) -> None:
    models = {name: model_with_grads(0) for name in ("ours", "ours per-tensor", "torch", "hybrid", "adamw")}
    hidden = hidden_matrices(models["ours"])
    shapes = sorted({tuple(p.shape) for p in hidden})
    print(f"\nMuon on {len(hidden)} hidden matrices of shapes {shapes} ({sum(p.numel() for p in hidden) / 1e6:.1f} M "
          f"parameters), Newton-Schulz in bf16 (5 steps), {torch.get_num_threads()} threads")
    steps = {"scratchlm Muon": Muon(hidden, lr=0.02, foreach=True).step,
             "scratchlm Muon per-tensor": Muon(hidden_matrices(models["ours per-tensor"]), lr=0.02,
                                               foreach=False).step,
             "torch.optim.Muon": torch.optim.Muon(hidden_matrices(models["torch"]), lr=0.02).step}
    results = interleave(steps, repeats, warmup=1)
    work = sum(p.numel() for p in hidden) / 1e6
    report("Muon step (hidden matrices): ours (batched) vs torch.optim.Muon", results, "scratchlm Muon",
           "torch.optim.Muon", work, "M params")
    report("Muon step (hidden matrices): ours per-tensor vs torch.optim.Muon", results,
           "scratchlm Muon per-tensor", "torch.optim.Muon", work, "M params")
    for name in ("ours per-tensor", "torch"):
        for a, b in zip(hidden, hidden_matrices(models[name])):
            assert torch.equal(a, b), f"{name} diverged from ours"
    print(f"parameters after {1 + repeats} steps: ours, ours per-tensor and torch.optim.Muon bit-identical")

    steps = {"scratchlm MuonAdamW": muon_adamw(models["hybrid"]).step,
             "scratchlm AdamW": whole_model_adamw(models["adamw"]).step}
    results = interleave(steps, repeats, warmup=1)
    summary = report("optimizer step, whole model: MuonAdamW vs AdamW", results, "scratchlm MuonAdamW",
                     "scratchlm AdamW")
    print(f"target MuonAdamW/AdamW <= 1.5: {'PASS' if summary['time_ratio'] <= 1.5 else 'MISS'}")


def bench_muon_train_step(repeats: int, batch_size: int = 8) -> None:
    config = ModelConfig.preset("tinystories-17m")
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.context_length + 1), generator=generator)
    batch = (tokens[:, :-1], tokens[:, 1:])
    steps = {}
    for name, make_optimizer in (("MuonAdamW", muon_adamw), ("AdamW", whole_model_adamw)):
        torch.manual_seed(0)
        model = TransformerLM(config)
        steps[f"train step with {name}"] = training_step(model, make_optimizer(model), batch)
    results = interleave(steps, repeats, warmup=1)
    print(f"\ntinystories-17m, fp32, batch {batch_size} x {config.context_length}, {torch.get_num_threads()} threads")
    summary = report("training step (forward, backward, clip, optimizer): MuonAdamW vs AdamW", results,
                     "train step with MuonAdamW", "train step with AdamW", batch_size * config.context_length,
                     "tokens")
    print(f"target MuonAdamW/AdamW <= 1.5: {'PASS' if summary['time_ratio'] <= 1.5 else 'MISS'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (a smoke run)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--part", choices=["all", "adamw", "checkpoint", "muon", "muon-train"], default="all",
                        help="run one part only (each Muon part takes minutes on 2 busy cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average at start: {', '.join(f'{x:.1f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    if args.part in ("all", "adamw"):
        bench_step(repeats=5 if args.quick else 30)
    if args.part in ("all", "checkpoint"):
        bench_checkpoint(repeats=2 if args.quick else 5)
    if args.part in ("all", "muon"):
        bench_muon(repeats=2 if args.quick else 5)
    if args.part in ("all", "muon-train"):
        bench_muon_train_step(repeats=2 if args.quick else 5)
    print(f"load average at end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
