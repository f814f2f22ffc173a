"""The CUDA fast path against the fp32 eager from-scratch reference (every test needs a GPU; conftest skips them
without one). Run them with ``pytest -m cuda`` or ``scripts/gpu_check.sh``.

Tolerances, and why:
- bf16 autocast vs fp32: bf16 keeps 8 significant bits (relative step 2^-8 = 0.4%); over a few layers the errors
  mostly average out, so the mean loss of a random model (~ln V) agrees to 1% relative.
- torch.compile vs eager (fp32): inductor fuses and reorders reductions, so logits agree to ~1e-5; we allow 1e-4.
- fused SDPA vs our attention (fp32, TF32 off): the kernels differ only in summation order, 1e-4.
- KV-cache decoding: greedy tokens must be identical, and incremental logits close to the full forward's.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from scratchlm.config import RunConfig
from scratchlm.data.token_file import write_token_file
from scratchlm.generate.decoding import generate
from scratchlm.model import TransformerLM, kernels
from scratchlm.model.config import PRESETS, ModelConfig
from scratchlm.model.kv_cache import KVCache
from scratchlm.train.loss import cross_entropy
from scratchlm.train.setup import build_optimizer
from scratchlm.train.step import train_step

pytestmark = pytest.mark.cuda

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMALL = ModelConfig(**{**PRESETS["tiny"], "vocab_size": 1000, "context_length": 128, "d_model": 256,
                       "num_layers": 4, "num_heads": 8, "d_ff": 672})


@pytest.fixture
def model() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(SMALL, device="cuda").eval()


@pytest.fixture
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, SMALL.vocab_size, (4, SMALL.context_length + 1), device="cuda", generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.fixture(autouse=True)
def _no_tf32():
    """The references are true fp32: TF32 matmuls (10-bit mantissa) would blur every comparison."""
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


@torch.no_grad()
def test_bf16_autocast_loss_is_close_to_fp32(model, batch):
    inputs, targets = batch
    fp32 = cross_entropy(model(inputs), targets)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(inputs)
    assert logits.dtype == torch.bfloat16  # autocast really ran the matmuls in bf16
    bf16 = cross_entropy(logits.float(), targets)
    torch.testing.assert_close(bf16, fp32, rtol=1e-2, atol=0.0)


def test_bf16_gradients_point_the_same_way_as_fp32(model, batch):
    inputs, targets = batch
    model.train()
    cross_entropy(model(inputs), targets).backward()
    fp32 = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(inputs)
    cross_entropy(logits.float(), targets).backward()
    bf16 = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.nn.functional.cosine_similarity(fp32, bf16, dim=0) > 0.99


@torch.no_grad()
def test_compiled_logits_equal_eager(model, batch):
    inputs, _ = batch
    eager = model(inputs)
    compiled = torch.compile(model)(inputs)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_sdpa_equals_from_scratch_attention(model, batch, dtype):
    inputs, _ = batch
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        ours = model(inputs).float()
        kernels.apply(model, fused_attention=True)
        fused = model(inputs).float()
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2  # bf16: two different 8-bit roundings of the softmax
    torch.testing.assert_close(fused, ours, rtol=tolerance, atol=tolerance)


@torch.no_grad()
def test_kv_cache_logits_equal_full_forward(model, batch):
    inputs, _ = batch
    full = model(inputs)  # (B, T, V)
    cache = KVCache.for_model(model, batch_size=inputs.shape[0])
    prefix = 100
    steps = [model(inputs[:, :prefix], kv_cache=cache)]
    steps += [model(inputs[:, t:t + 1], kv_cache=cache) for t in range(prefix, inputs.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


def test_kv_cache_greedy_generation_equals_recomputation(model):
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    cached = generate(model, prompts, 40, top_k=1, seed=0, use_cache=True)
    recomputed = generate(model, prompts, 40, top_k=1, seed=0, use_cache=False)
    assert cached == recomputed
    assert all(len(row) == 40 for row in cached)


@pytest.mark.parametrize("dtype,compile_model", [("fp32", False), ("bf16", True)])
def test_training_steps_on_cuda_lower_the_loss(dtype, compile_model):
    """Memorise one fixed batch: 30 AdamW steps must cut the loss by more than half, in both fast-path modes."""
    config = RunConfig.from_dict({"model": dataclasses.asdict(SMALL), "optim": {"lr": 3e-3, "warmup_iters": 0},
                                  "train": {"max_steps": 30, "dtype": dtype, "compile": compile_model}})
    torch.manual_seed(0)
    raw = TransformerLM(config.model, device="cuda")
    model = torch.compile(raw) if compile_model else raw
    optimizer = build_optimizer(raw, config)
    generator = torch.Generator(device="cuda").manual_seed(2)
    tokens = torch.randint(0, SMALL.vocab_size, (8, SMALL.context_length + 1), device="cuda", generator=generator)
    batches = [(tokens[:, :-1], tokens[:, 1:])]
    losses = [train_step(model, optimizer, batches, lr=3e-3, grad_clip=1.0, dtype=dtype)[0].item()
              for _ in range(30)]
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.5 * losses[0], losses


def test_torchrun_nccl_one_rank_trains(tmp_path):
    """`torchrun -m scratchlm.train` on the GPU: the NCCL process group, cuda:LOCAL_RANK, DDP and a checkpoint."""
    text = np.frombuffer(b"the cat sat on the mat. a dog ran to the park. " * 200, dtype=np.uint8)
    write_token_file(tmp_path / "train.tok", text, vocab_size=256)
    sets = [f"data.train_path={tmp_path / 'train.tok'}", "train.max_steps=6", "train.checkpoint_every=3",
            "train.device=auto", "train.dtype=bf16", "optim.warmup_iters=1"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m",
               "scratchlm.train", "--config", str(CONFIGS / "tiny.toml"), "--run-dir", str(tmp_path / "run"),
               *[f"--set={s}" for s in sets]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step_0000006").is_dir()
