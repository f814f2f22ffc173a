"""train.dtype = auto (train/precision.py): bf16 autocast where the device has bf16 arithmetic, else fp32, read
from the hardware (nothing timed); the choice is recorded in the run's config.toml and kept on resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scratchlm.config import load_config
from scratchlm.data.token_file import write_token_file
from scratchlm.model.kernels import cpu
from scratchlm.train import precision, resolve
from scratchlm.train.trainer import train
from test_train_startup import TINY


@pytest.mark.parametrize("native, chosen", [(True, "bf16"), (False, "fp32")])
def test_a_cpu_trains_bf16_only_with_bf16_arithmetic(monkeypatch, native, chosen):
    monkeypatch.setattr(cpu, "has_native_bf16", lambda: native)
    dtype, line = precision.choose_dtype(torch.device("cpu"))
    assert dtype == chosen and line.startswith(f"train.dtype = auto: {chosen}, as this device has")
    assert cpu.model_name() in line


def test_held_to_avx2_a_cpu_has_no_native_bf16(monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 (torch's dispatch) or ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN's kernels) rule bf16 out,
    whatever the CPU's flags say: that is how .ci/run proves the AVX2 paths on an AVX-512 machine."""
    monkeypatch.setattr(cpu, "capability", lambda: "AVX2")
    assert not cpu.has_native_bf16()
    monkeypatch.setattr(cpu, "capability", lambda: "AVX512")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not cpu.has_native_bf16()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not cpu.has_native_bf16()  # AVX-512 without its bf16 extension (Skylake, Zen 3 has no AVX-512)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert cpu.has_native_bf16()


def test_a_run_records_its_choice_and_a_resume_keeps_it(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "has_native_bf16", lambda: True)
    rng = np.random.default_rng(0)
    for name in ("train", "valid"):
        write_token_file(tmp_path / f"{name}.tok", rng.integers(0, 256, 5_000), vocab_size=256)
    overrides = [f"data.train_path={tmp_path / 'train.tok'}", f"data.val_path={tmp_path / 'valid.tok'}",
                 "model.vocab_size=256", "data.batch_size=2", "train.eval_batches=1", "train.dtype=auto",
                 f"train.run_dir={tmp_path / 'run'}", "train.checkpoint_every=2", "train.log_every=1",
                 "optim.warmup_iters=1", "train.device=cpu"]
    train(load_config(TINY, [*overrides, "train.max_steps=2"]), quiet=True)
    assert load_config(tmp_path / "run" / resolve.CONFIG_FILE).train.dtype == "bf16"
    monkeypatch.setattr(cpu, "has_native_bf16", lambda: False)  # a resume keeps the run's dtype
    train(load_config(TINY, [*overrides, "train.max_steps=4"]), resume=True, quiet=True)
    assert load_config(tmp_path / "run" / resolve.CONFIG_FILE).train.dtype == "bf16"


def test_an_unknown_dtype_is_refused_naming_the_choices():
    expected = r"train.dtype must be one of \('fp32', 'bf16', 'fp16', 'auto'\), got 'fp8'"
    with pytest.raises(ValueError, match=expected):
        load_config(TINY, ["train.dtype=fp8"])
