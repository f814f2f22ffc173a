"""train.dtype = auto (train/precision.py): bf16 autocast where the run measures it clearly faster, else fp32;
the choice is recorded in the run's config.toml and kept on resume."""

from __future__ import annotations

import numpy as np
import pytest

from scratchlm.config import load_config
from scratchlm.data.token_file import write_token_file
from scratchlm.train import precision, resolve
from scratchlm.train.trainer import train
from test_train_startup import TINY

STEP_SECONDS = {"fp32": 1.0}


@pytest.fixture
def measured(monkeypatch) -> list[str]:
    """measure_step_seconds by dtype, from STEP_SECONDS and the test's bf16 time; returns the dtypes measured."""
    calls: list[str] = []

    def fake(config, train_tokens, steps=5):
        calls.append(config.train.dtype)
        return STEP_SECONDS[config.train.dtype]

    monkeypatch.setattr(precision, "measure_step_seconds", fake)
    return calls


@pytest.mark.parametrize("bf16_seconds, chosen", [(0.5, "bf16"), (1 / precision.BF16_MIN_SPEEDUP, "bf16"),
                                                  (0.95, "fp32"), (3.0, "fp32")])
def test_bf16_is_chosen_only_when_clearly_faster(monkeypatch, measured, bf16_seconds, chosen):
    monkeypatch.setitem(STEP_SECONDS, "bf16", bf16_seconds)
    dtype, line = precision.choose_dtype(load_config(TINY, ["train.dtype=auto"]), np.zeros(10, dtype=np.uint16))
    assert dtype == chosen and sorted(measured) == ["bf16", "fp32"]
    assert line.startswith(f"train.dtype = auto: {chosen} (a step took 1.000 s in fp32, {bf16_seconds:.3f} s")


def test_a_run_records_its_choice_and_a_resume_keeps_it(tmp_path, monkeypatch, measured):
    monkeypatch.setitem(STEP_SECONDS, "bf16", 0.5)
    rng = np.random.default_rng(0)
    for name in ("train", "valid"):
        write_token_file(tmp_path / f"{name}.tok", rng.integers(0, 256, 5_000), vocab_size=256)
    overrides = [f"data.train_path={tmp_path / 'train.tok'}", f"data.val_path={tmp_path / 'valid.tok'}",
                 "model.vocab_size=256", "data.batch_size=2", "train.eval_batches=1", "train.dtype=auto",
                 f"train.run_dir={tmp_path / 'run'}", "train.checkpoint_every=2", "train.log_every=1",
                 "optim.warmup_iters=1"]
    train(load_config(TINY, [*overrides, "train.max_steps=2"]), quiet=True)
    assert load_config(tmp_path / "run" / resolve.CONFIG_FILE).train.dtype == "bf16" and len(measured) == 2
    monkeypatch.setitem(STEP_SECONDS, "bf16", 9.0)  # a resume does not measure again: it keeps the run's dtype
    train(load_config(TINY, [*overrides, "train.max_steps=4"]), resume=True, quiet=True)
    assert load_config(tmp_path / "run" / resolve.CONFIG_FILE).train.dtype == "bf16" and len(measured) == 2


def test_an_unknown_dtype_is_refused_naming_the_choices():
    expected = r"train.dtype must be one of \('fp32', 'bf16', 'fp16', 'auto'\), got 'fp8'"
    with pytest.raises(ValueError, match=expected):
        load_config(TINY, ["train.dtype=fp8"])
