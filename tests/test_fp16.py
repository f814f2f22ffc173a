"""train.dtype = "fp16": a GradScaler scales the loss, unscales before clipping, skips overflowing steps; refused
off CUDA. The scaler's arithmetic is checked on the CPU (GradScaler runs there; autocast stays off with fp32),
the fp16 autocast run on a CUDA device."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from scratchlm.config import RunConfig, load_config
from scratchlm.data.token_file import write_token_file
from scratchlm.model import TransformerLM
from scratchlm.train.setup import build_optimizer, check_dtype_on_device
from scratchlm.train.step import train_step
from scratchlm.train.trainer import train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def model_and_batch(seed: int = 0):
    config = RunConfig.from_dict({"model": {"preset": "tiny"}, "optim": {"warmup_iters": 0}})
    torch.manual_seed(seed)
    model = TransformerLM(config.model)
    generator = torch.Generator().manual_seed(seed)
    batch = tuple(torch.randint(0, 256, (4, 32), generator=generator) for _ in range(2))
    return model, build_optimizer(model, config), [batch]


@pytest.mark.parametrize("grad_clip", [0.0, 1e-3])  # no clipping, and clipping that always bites
def test_a_scaled_step_equals_the_unscaled_step(grad_clip):
    """A power-of-two loss scale is exact in floating point: unscaling gives back the very same gradients."""
    plain_model, plain_opt, batch = model_and_batch()
    scaled_model, scaled_opt, _ = model_and_batch()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    plain = train_step(plain_model, plain_opt, batch, lr=1e-3, grad_clip=grad_clip)
    scaled = train_step(scaled_model, scaled_opt, batch, lr=1e-3, grad_clip=grad_clip, scaler=scaler)
    assert scaled[0].item() == plain[0].item()  # the reported loss is unscaled
    assert scaled[1].item() == pytest.approx(plain[1].item(), rel=1e-6)  # so is the grad norm
    for a, b in zip(plain_model.parameters(), scaled_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert scaler.get_scale() == 2.0**12  # no overflow, and the growth interval (2000 steps) not reached


def test_an_overflowing_step_is_skipped_reported_as_norm_zero_and_the_scale_halved():
    model, optimizer, batch = model_and_batch()
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    # One gradient overflows, as an fp16 gradient does past 65504.
    next(model.parameters()).register_hook(lambda grad: grad * math.inf)
    loss, grad_norm = train_step(model, optimizer, batch, lr=1e-3, grad_clip=1.0, scaler=scaler)
    assert math.isfinite(loss.item()) and grad_norm.item() == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaler.get_scale() == 2.0**11
    optimizer.zero_grad()


def test_fp16_is_refused_on_the_cpu_with_one_clear_line():
    with pytest.raises(ValueError, match=r"^train.dtype = fp16 needs a CUDA GPU \(this run is on cpu\)"):
        check_dtype_on_device("fp16", torch.device("cpu"))
    check_dtype_on_device("bf16", torch.device("cpu"))  # bf16 and fp32 run anywhere
    check_dtype_on_device("fp16", torch.device("cuda"))  # checked by type only: no GPU needed here


def tiny_run(tmp_path: Path, *extra: str) -> RunConfig:
    tokens = np.frombuffer(b"the cat sat on the mat. a dog ran to the park. " * 80, dtype=np.uint8)
    write_token_file(tmp_path / "t.tok", tokens, vocab_size=256)
    return load_config(CONFIGS / "tiny.toml", [
        f"data.train_path={tmp_path / 't.tok'}", f"data.val_path={tmp_path / 't.tok'}", "data.batch_size=4",
        f"train.run_dir={tmp_path / 'run'}", "train.max_steps=40", "train.log_every=10", "train.eval_every=20",
        "train.eval_batches=2", "train.checkpoint_every=20", "train.dtype=fp16", *extra])


def test_the_cli_refuses_fp16_training_on_the_cpu(tmp_path):
    with pytest.raises(ValueError, match="fp16 needs a CUDA GPU"):
        train(tiny_run(tmp_path, "train.device=cpu"), quiet=True)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.cuda
def test_fp16_training_on_cuda_learns_and_resumes_with_its_scale(tmp_path):
    config = tiny_run(tmp_path, "train.device=cuda")
    result = train(config, quiet=True)
    assert result.status == "finished" and result.best_val_loss < 3.0  # from ln(256) = 5.5
    from scratchlm.train.checkpoint import CheckpointManager

    latest = CheckpointManager(tmp_path / "run").latest_valid()
    extra = CheckpointManager(tmp_path / "run").load(latest, TransformerLM(config.model),
                                                     build_optimizer(TransformerLM(config.model), config))["extra"]
    assert extra["grad_scaler"]["scale"] > 0
