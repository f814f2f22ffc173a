"""The training loop: golden loss curve, gradient accumulation, exact resume after SIGKILL, SIGTERM, divergence,
the run-directory outputs (metrics.jsonl schema, curves.png, config.toml), `scratchlm eval`, and bad input.

Everything runs the `tiny` preset on a small synthetic byte-level corpus (vocab 256) on the CPU.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import torch_threads
from scratchlm.cli import main as cli_main
from scratchlm.config import RunConfig, load_config
from scratchlm.data.token_file import write_token_file
from scratchlm.errors import UserError
from scratchlm.model import TransformerLM
from scratchlm.train import trainer as trainer_module
from scratchlm.train.budget import BudgetClock
from scratchlm.train.metrics import MetricsLogger, truncate_records
from scratchlm.train.setup import build_optimizer
from scratchlm.train.step import DivergenceWatch, learning_rate, train_step
from scratchlm.train.trainer import train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SENTENCES = [b"the cat sat on the mat. ", b"a dog ran to the park. ", b"we like red apples! ",
             b"she reads a big book? "]
# Mean train loss of steps 1..6 of configs/tiny.toml with log_every=1, batch 4, seed 0 on `corpus(...)`
# (recorded once from this implementation; a change means the numerics of model, loss, optimizer or data moved).
GOLDEN_LOSSES = [5.727898120880127, 5.673134803771973, 5.522216796875, 5.2981133460998535, 4.897848129272461,
                 4.539812088012695]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, here and in the subprocesses (OMP_NUM_THREADS=1): equal thread counts make runs in
    different processes bitwise comparable, and one thread is fastest on a small, busy CI machine."""
    with torch_threads(1):
        yield


def corpus(num_sentences: int, seed: int) -> np.ndarray:
    """Byte tokens of randomly ordered short sentences: learnable structure for a byte-level model."""
    order = np.random.default_rng(seed).integers(0, len(SENTENCES), num_sentences)
    return np.frombuffer(b"".join(SENTENCES[i] for i in order), dtype=np.uint8)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("data")
    paths = {"train": folder / "train.tok", "val": folder / "valid.tok"}
    write_token_file(paths["train"], corpus(2000, seed=1), vocab_size=256)
    write_token_file(paths["val"], corpus(100, seed=2), vocab_size=256)
    return paths


def tiny_overrides(data: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    return [f"data.train_path={data['train']}", f"data.val_path={data['val']}", f"train.run_dir={run_dir}",
            "data.batch_size=4", "train.max_steps=12", "train.log_every=1", "train.eval_every=6",
            "train.checkpoint_every=6", *extra]


def tiny_config(data: dict[str, Path], run_dir: Path, *extra: str) -> RunConfig:
    return load_config(CONFIGS / "tiny.toml", tiny_overrides(data, run_dir, *extra))


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def finished_run(data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    result = train(tiny_config(data, run_dir), quiet=True)
    assert result.status == "finished" and result.final_step == 12
    return run_dir


def test_golden_loss_curve(finished_run: Path):
    losses = [r["loss"] for r in records(finished_run, "train")][:len(GOLDEN_LOSSES)]
    np.testing.assert_allclose(losses, GOLDEN_LOSSES, rtol=1e-5)


def test_run_directory_outputs(finished_run: Path, data):
    train_records, evals, ends = (records(finished_run, k) for k in ("train", "eval", "end"))
    assert [r["step"] for r in train_records] == list(range(1, 13))
    for r in train_records:
        assert set(r) == {"kind", "step", "tokens", "wall_time", "train_time", "loss", "lr", "grad_norm",
                          "tokens_per_s", "mfu"}
        assert r["tokens"] == r["step"] * 4 * 32 and r["tokens_per_s"] > 0 and r["mfu"] is None  # CPU: no peak
    # Step s trains with the rate of iteration s - 1: 5 warm-up iterations from 0, then cosine over 5..12.
    lrs = [r["lr"] for r in train_records]
    assert lrs[:2] == [0.0, 3e-3 / 5] and lrs[5] == 3e-3 and lrs[11] == pytest.approx(3e-4 + 2.7e-3 * (1 + math.cos(
        math.pi * 6 / 7)) / 2)
    assert [r["step"] for r in evals] == [6, 12]
    assert set(evals[0]) == {"kind", "step", "tokens", "wall_time", "train_time", "val_loss", "val_ppl"}
    assert evals[1]["val_ppl"] == pytest.approx(math.exp(evals[1]["val_loss"]))
    assert ends == [{"kind": "end", "step": 12, "status": "finished", "message": ""}]
    assert (finished_run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert load_config(finished_run / "config.toml") == tiny_config(data, finished_run)
    assert sorted(p.name for p in (finished_run / "checkpoints").glob("step_*")) == ["step_0000006", "step_0000012"]


def test_eval_command_matches_the_runs_validation(finished_run: Path, data, capsys):
    assert cli_main(["eval", "--checkpoint", str(finished_run), "--data", str(data["val"]), "--batch-size", "4",
                     "--batches", "4", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    loss = float(printed.split()[1])
    assert loss == pytest.approx(records(finished_run, "eval")[-1]["val_loss"], abs=1e-4)
    assert "perplexity" in printed


def test_gradient_accumulation_equals_one_big_batch():
    config = RunConfig.from_dict({"model": {"preset": "tiny"}, "optim": {"warmup_iters": 0}})
    generator = torch.Generator().manual_seed(0)
    inputs, targets = (torch.randint(0, 256, (8, 32), generator=generator) for _ in range(2))
    results = []
    for pieces in (1, 4):
        torch.manual_seed(0)
        model = TransformerLM(config.model)
        optimizer = build_optimizer(model, config)
        batches = list(zip(inputs.chunk(pieces), targets.chunk(pieces)))
        loss, norm = train_step(model, optimizer, batches, lr=1e-3, grad_clip=0.5)
        # AdamW's first moment after one step is (1 - beta1) x the clipped gradient the optimizer received.
        gradients = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
        results.append((loss, norm, gradients, [p.detach().clone() for p in model.parameters()]))
    (loss_1, norm_1, grads_1, params_1), (loss_4, norm_4, grads_4, params_4) = results
    torch.testing.assert_close(loss_4, loss_1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norm_4, norm_1, rtol=1e-5, atol=1e-6)
    assert norm_1 > 0.5  # the clip was active, so clipping saw the accumulated (not a partial) gradient
    for a, b in zip(grads_4, grads_1):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    for a, b in zip(params_4, params_1):  # Adam's first step is ~lr * sign(g): tiny g differ by up to ~lr
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def launch(data, run_dir: Path, *extra: str, resume: bool = False) -> subprocess.Popen:
    argv = [sys.executable, "-m", "scratchlm.train", "--config", str(CONFIGS / "tiny.toml"), "--quiet",
            *(["--resume"] if resume else []),
            *[arg for item in tiny_overrides(data, run_dir, *extra) for arg in ("--set", item)]]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_for_step(process: subprocess.Popen, run_dir: Path, step: int, timeout: float = 60) -> None:
    """Poll metrics.jsonl until a train record for ``step`` (or later) appears."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the run ended before step {step}: {process.communicate()}"
        path = run_dir / "metrics.jsonl"
        if path.exists() and any(f'"step": {s},' in path.read_text() for s in range(step, step + 6)):
            return
        time.sleep(0.005)
    raise AssertionError(f"no step {step} within {timeout} s")


# An evaluation (and curves redrawn) every other step slows the run enough to signal it mid-way; evaluation
# never touches the training state, so the losses are those of a run without it.
SLOW = ("train.eval_every=2", "train.eval_batches=1", "train.checkpoint_every=4")


def test_sigkill_then_resume_is_bitwise_identical(data, finished_run: Path, tmp_path: Path):
    run_dir = tmp_path / "killed"
    process = launch(data, run_dir, *SLOW)
    wait_for_step(process, run_dir, 6)
    process.kill()  # SIGKILL: no handler runs; the checkpoint of step 4 is what survives
    process.wait()
    assert not records(run_dir, "end")
    resumed = launch(data, run_dir, *SLOW, resume=True)
    _, stderr = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, stderr
    expected = [r["loss"] for r in records(finished_run, "train")]
    assert [r["loss"] for r in records(run_dir, "train")] == expected  # bitwise: JSON floats round-trip exactly
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, 13))  # no duplicated steps


MODERN = ("optim.optimizer=muon", "optim.muon_lr=0.02", "optim.embedding_lr=0.01", "optim.head_lr=0.002",
          "optim.schedule=wsd", "optim.decay_fraction=0.5", "optim.warmup_iters=2", "model.qk_norm=true",
          "model.ffn=relu2", "model.zero_init_residual=true", "model.logit_softcap=15")


def test_modern_recipe_sigkill_then_resume_is_bitwise_identical(data, tmp_path: Path):
    """Muon and AdamW as one optimizer state (momentum buffers, moments, steps, each group's lr_scale) resume
    exactly, with the recipe's other switches on."""
    whole = tmp_path / "whole"
    assert train(tiny_config(data, whole, *SLOW, *MODERN), quiet=True).status == "finished"
    run_dir = tmp_path / "killed"
    process = launch(data, run_dir, *SLOW, *MODERN)
    wait_for_step(process, run_dir, 6)
    process.kill()
    process.wait()
    resumed = launch(data, run_dir, *SLOW, *MODERN, resume=True)
    _, stderr = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, stderr
    expected = [r["loss"] for r in records(whole, "train")]
    assert [r["loss"] for r in records(run_dir, "train")] == expected
    assert expected[-1] < expected[0]  # and it learns


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(data, finished_run: Path, tmp_path: Path):
    run_dir = tmp_path / "terminated"
    process = launch(data, run_dir, *SLOW)
    wait_for_step(process, run_dir, 2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    end = records(run_dir, "end")[-1]
    assert end["status"] == "interrupted" and "SIGTERM" in end["message"] and "interrupted" in stderr
    assert (run_dir / "checkpoints" / f"step_{end['step']:07d}").is_dir()
    result = train(load_config(run_dir / "config.toml"), resume=True, quiet=True)
    assert result.status == "finished"
    assert [r["loss"] for r in records(run_dir, "train")] == [r["loss"] for r in records(finished_run, "train")]


def test_divergence_stops_and_keeps_the_last_good_checkpoint(data, tmp_path: Path):
    run_dir = tmp_path / "diverged"
    config = tiny_config(data, run_dir, "optim.lr=1e6", "optim.min_lr=0", "optim.warmup_iters=0",
                         "optim.grad_clip=0", "train.checkpoint_every=1", "train.log_every=100")
    result = train(config, quiet=True)
    assert result.status == "diverged" and result.message.startswith("diverged at step ")
    bad_step = int(result.message.split()[3].rstrip(":"))
    end = records(run_dir, "end")[-1]
    assert end["status"] == "diverged" and end["message"] == result.message
    saved = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    assert saved and max(saved) < bad_step  # nothing from or after the bad step was checkpointed


def test_max_loss_counts_as_divergence(data, tmp_path: Path):
    result = train(tiny_config(data, tmp_path / "run", "train.max_loss=1.0"), quiet=True)
    assert result.status == "diverged"
    assert "diverged at step 1: loss=5.7" in result.message and "train.max_loss = 1.0" in result.message


def test_a_bad_grad_norm_under_max_loss_does_not_blame_max_loss():
    watch = DivergenceWatch(torch.device("cpu"), max_loss=10.0)
    watch.update(3, torch.tensor(2.5), torch.tensor(float("inf")))
    assert watch.check() == "diverged at step 3: loss=2.5, grad_norm=inf"


def test_cli_train_runs_and_refuses_to_overwrite(data, tmp_path: Path):
    run_dir = tmp_path / "cli"
    argv = ["train", "--config", str(CONFIGS / "tiny.toml"), "--quiet", "--run-dir", str(run_dir),
            *[a for item in tiny_overrides(data, run_dir, "train.max_steps=2", "optim.warmup_iters=1",
                                           "train.eval_every=2") for a in ("--set", item)]]
    assert cli_main(argv) == 0 and records(run_dir, "end")[-1]["status"] == "finished"
    assert cli_main(argv) == 1  # the run directory has checkpoints: --resume or another --run-dir
    assert cli_main(["train", "--run-dir", str(run_dir), "--resume", "--quiet"]) == 0  # nothing left to do


@pytest.mark.parametrize(("problem", "message"), [
    ("short", "holds 20 tokens, fewer than model.context_length + 1 = 33"),
    ("vocab", "model.vocab_size 256 is smaller than the 300 ids of the tokenizer of data.train_path"),
    ("unset", "data.train_path is not set"),
    ("missing", "nope.tok"),
])
def test_bad_token_files_are_clear_errors(data, tmp_path: Path, problem: str, message: str):
    path = tmp_path / "bad.tok"
    if problem == "short":
        write_token_file(path, np.arange(20), vocab_size=256)
    elif problem == "vocab":
        write_token_file(path, np.arange(1000) % 300, vocab_size=300)
    else:
        path = "" if problem == "unset" else tmp_path / "nope.tok"
    config = tiny_config(data, tmp_path / "run", f"data.train_path={path}")
    with pytest.raises((ValueError, FileNotFoundError, UserError)) as info:
        train(config, quiet=True)
    assert message in str(info.value)


def test_unwritable_run_directory(data, tmp_path: Path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(PermissionError, match=f"cannot write to run directory {blocker / 'run'}"):
        train(tiny_config(data, blocker / "run"), quiet=True)


@pytest.mark.parametrize("change", ["model.d_model=32", "model.rope_theta=500"])  # other shapes; the same shapes
def test_resume_with_another_model_is_refused(data, finished_run: Path, change: str):
    """Refused when the run is resolved, before a model is built or a weight is read."""
    with pytest.raises(ValueError, match="cannot resume from .*step_0000012: it was trained with model"):
        train(tiny_config(data, finished_run, change), resume=True, quiet=True)


def test_resume_when_every_checkpoint_is_corrupt_is_refused(data, tmp_path: Path):
    run_dir = tmp_path / "corrupt"
    config = tiny_config(data, run_dir, "train.max_steps=2", "optim.warmup_iters=1", "train.checkpoint_every=1")
    assert train(config, quiet=True).status == "finished"
    before = (run_dir / "metrics.jsonl").read_text()
    for checkpoint in (run_dir / "checkpoints").glob("step_*"):
        with open(checkpoint / "model.safetensors", "ab") as handle:
            handle.write(b"x")
    with pytest.warns(UserWarning, match="skipping checkpoint"), \
            pytest.raises(ValueError, match="cannot resume: none of the 2 checkpoint"):
        train(config, resume=True, quiet=True)
    assert (run_dir / "metrics.jsonl").read_text() == before  # nothing was overwritten


def test_a_checkpoint_records_only_the_val_loss_of_its_own_step(data, tmp_path: Path):
    run_dir = tmp_path / "run"
    train(tiny_config(data, run_dir, "train.checkpoint_every=4"), quiet=True)  # evaluations at steps 6 and 12
    evals = {r["step"]: r["val_loss"] for r in records(run_dir, "eval")}
    saved = {p.name: json.loads((p / "meta.json").read_text())["val_loss"]
             for p in (run_dir / "checkpoints").glob("step_*")}
    assert saved == {"step_0000004": None, "step_0000008": None, "step_0000012": evals[12]}  # not step 6's
    best = json.loads((run_dir / "checkpoints" / "best.json").read_text())
    assert best == {"step": 12, "val_loss": evals[12], "name": "step_0000012"}


def test_throughput_after_resume_counts_only_the_steps_run_since(data, tmp_path: Path, monkeypatch):
    clock = SimpleNamespace(now=0.0)

    def one_second_step(*args, **kwargs):
        clock.now += 1.0
        return train_step(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "train_step", one_second_step)
    monkeypatch.setattr(trainer_module, "BudgetClock",  # the loop's clock
                        lambda config, used=0.0, started=None: BudgetClock(config, used=used, clock=lambda: clock.now))
    run_dir = tmp_path / "run"
    config = tiny_config(data, run_dir, "train.log_every=5", "train.checkpoint_every=3")
    train(config, quiet=True)
    # As if killed after step 9's checkpoint, whose loss window holds steps 6-9: the resumed clock starts at 9.
    shutil.rmtree(run_dir / "checkpoints" / "step_0000012")
    train(config, resume=True, quiet=True)
    train_records = records(run_dir, "train")
    assert [r["step"] for r in train_records] == [5, 10, 12]
    assert [r["tokens_per_s"] for r in train_records] == [4 * 32] * 3  # one step per (fake) second


def test_resume_drops_a_cut_last_metrics_line_but_refuses_a_malformed_one_elsewhere(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"kind": "train", "step": step, "loss": 1.0}) for step in (1, 2, 3)]
    path.write_text("\n".join(lines) + "\n" + lines[0][:10])  # killed mid-write
    truncate_records(path, 2)
    assert path.read_text() == lines[0] + "\n" + lines[1] + "\n"
    damaged = "\n".join([lines[0], lines[1][:-5], lines[2]]) + "\n"
    path.write_text(damaged)
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: not a JSON object")):
        truncate_records(path, 3)
    assert path.read_text() == damaged  # the records after the damaged line are kept


def test_metrics_logger_writes_and_echoes_non_finite_values(tmp_path: Path, capsys):
    logger = MetricsLogger(tmp_path, total_steps=1)
    logger.log({"kind": "eval", "step": 1, "tokens": 8, "wall_time": 0.1, "val_loss": 800.0, "val_ppl": math.inf})
    logger.close()
    assert records(tmp_path, "eval")[0]["val_ppl"] == "inf"
    assert "val_ppl inf" in capsys.readouterr().err


def test_cuda_requested_without_cuda(data, tmp_path: Path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        train(tiny_config(data, tmp_path / "run", "train.device=cuda"), quiet=True)


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "scratchlm.train", "--help"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "120"})
    assert out.returncode == 0 and "--resume" in out.stdout and "--set" in out.stdout


def test_a_run_that_diverges_before_its_first_log_keeps_its_last_good_and_bad_steps(data, tmp_path: Path):
    """lr 1e6 diverges within a few steps, long before log step 100: the records of the last good step and the
    first bad one are what the report draws (a line to the x at the divergence)."""
    from scratchlm.experiments.curves import TRAINING_PANELS, curves_figure, panel_axes
    from scratchlm.experiments.runs import load_run

    run_dir = tmp_path / "lr1e6"
    config = tiny_config(data, run_dir, "optim.lr=1e6", "optim.min_lr=0", "optim.warmup_iters=0",
                         "optim.grad_clip=0", "train.log_every=100", "train.eval_every=100",
                         "train.checkpoint_every=100", "train.max_steps=30")
    result = train(config, quiet=True)
    assert result.status == "diverged"
    bad_step, bad_loss = load_run(run_dir).divergence
    assert 1 < bad_step < 30
    good, bad = records(run_dir, "train")
    assert (good["step"], bad["step"]) == (bad_step - 1, bad_step)
    assert math.isfinite(good["loss"]) and good["tokens"] == good["step"] * 4 * 32
    assert good["lr"] == learning_rate(good["step"] - 1, config) and 0 < good["wall_time"] < bad["wall_time"]
    loss, grad_norm = float(bad["loss"]), float(bad["grad_norm"])  # "nan"/"inf" as the metrics writer encodes them
    assert not (math.isfinite(loss) and math.isfinite(grad_norm))  # as measured, not a mean of the window
    assert loss == pytest.approx(bad_loss, rel=1e-5, nan_ok=True)  # the end message's loss (printed with %g)
    fig = curves_figure([load_run(run_dir)])
    for panel in TRAINING_PANELS[:2]:  # steps and tokens (wall time is interpolated)
        (line,) = panel_axes(fig, panel).lines[1:]  # after the x marker: the run's line
        xs = list(line.get_xdata())
        scale = 1 if panel.x_key == "step" else 4 * 32
        assert xs == [(bad_step - 1) * scale, bad_step * scale]
        assert list(line.get_ydata())[0] == pytest.approx(good["loss"])
