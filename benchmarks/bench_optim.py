"""Our AdamW step (foreach) vs torch.optim.AdamW, foreach and fused, on tinystories-17m; checkpoint save/load times.

Target: ours no slower than torch (time ratio <= 1.0). torch is timed both ways because which of its paths is
faster on a CPU depends on the machine. Each optimizer updates its own copy of the same parameters with the
same fixed gradients, timed in alternation (benchmarks/harness.py); afterwards their parameters must agree:
bit-identical for torch foreach (same operations in the same order), within the printed tolerance for fused
(one kernel that rounds differently). The checkpoint part
times ``CheckpointManager.save`` (safetensors + JSON, fsync, sha256, rename) and ``load`` (verify + restore) of
the same model with a populated optimizer state.

    .venv/bin/python benchmarks/bench_optim.py [--quick] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleave, report  # noqa: E402
from scratchlm.model import ModelConfig, TransformerLM  # noqa: E402
from scratchlm.optim.adamw import AdamW, param_groups_for  # noqa: E402
from scratchlm.train.checkpoint import CheckpointManager  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repeats (a smoke run)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bench_step(repeats=5 if args.quick else 30)
    bench_checkpoint(repeats=2 if args.quick else 5)


if __name__ == "__main__":
    main()
