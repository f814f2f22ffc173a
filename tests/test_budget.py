"""Time-budgeted training: duration parsing, the plan (a pure function of a given step time), the graceful stop
at the budget on a fake clock, and resume keeping the plan. No test here depends on the machine's speed: the
probe is replaced by a fixed step time and the clock by a counter."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from scratchlm.cli import main as cli_main
from scratchlm.config import load_config
from scratchlm.data.token_file import write_token_file
from scratchlm.train import budget as budget_module
from scratchlm.train import trainer as trainer_module
from scratchlm.train.budget import BudgetClock, parse_duration, plan_steps
from scratchlm.train.trainer import train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("text, seconds", [("25m", 1500), ("1.5h", 5400), ("900s", 900), ("900", 900),
                                           (" 2.5m ", 150), (".5h", 1800)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5m", "5 minutes", "abc", "1e3", "inf", "5d", "0m"])
def test_parse_duration_refuses_what_is_not_a_positive_duration(text):
    with pytest.raises(ValueError, match="is not a positive duration: write e.g. 25m, 1.5h, 900s or 900"):
        parse_duration(text)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    paths = {"train": folder / "train.tok", "val": folder / "valid.tok"}
    write_token_file(paths["train"], rng.integers(0, 256, 20_000).astype(np.uint16), vocab_size=256)
    write_token_file(paths["val"], rng.integers(0, 256, 2_000).astype(np.uint16), vocab_size=256)
    return paths


def config_for(data, run_dir: Path, *extra: str):
    return load_config(CONFIGS / "tiny.toml", [
        f"data.train_path={data['train']}", f"data.val_path={data['val']}", f"train.run_dir={run_dir}",
        "data.batch_size=4", "train.eval_batches=3", "optim.warmup_iters=50", "train.max_steps=1000", *extra])


def test_plan_fills_the_budget_with_steps_and_evaluations(data, tmp_path):
    config = config_for(data, tmp_path, "train.budget_seconds=100", "optim.schedule=wsd", "optim.decay_fraction=0.5")
    planned, plan = plan_steps(config, step_seconds=0.1)
    eval_steps = budget_module.EVALUATIONS * 3 / 3  # 8 evaluations of 3 batches, each ~1/3 of a step
    assert plan.max_steps == planned.train.max_steps == int(0.95 * 100 / 0.1 - eval_steps) == 942
    assert planned.train.eval_every == planned.train.checkpoint_every == 118  # 8 evaluations over the run
    assert planned.optim.warmup_iters == 50 and planned.train.log_every == 18
    excluded, plan = plan_steps(config.with_overrides(["train.budget_includes_eval=false"]), step_seconds=0.1)
    assert excluded.train.max_steps == 950 and plan.eval_steps == 0


def test_plan_keeps_the_warmup_inside_a_short_run(data, tmp_path):
    config = config_for(data, tmp_path, "train.budget_seconds=3", "optim.schedule=wsd", "optim.decay_fraction=0.95")
    planned, _ = plan_steps(config, step_seconds=0.1)
    assert planned.train.max_steps == 20 and planned.optim.warmup_iters == 1  # 20 - round(0.95 * 20) = 1


def test_a_budget_too_small_for_one_evaluation_is_refused_with_what_would_do(data, tmp_path):
    config = config_for(data, tmp_path, "train.budget_seconds=1")
    with pytest.raises(ValueError, match=r"budget 1 s is too small: a step takes 0.50 s here, so it buys 0 steps "
                                         r"\(and its evaluations\); give at least 6 s"):
        plan_steps(config, step_seconds=0.5)


def test_budget_clock_counts_evaluations_only_when_the_budget_includes_them(data, tmp_path):
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    for includes, expected in ((True, 10.0), (False, 6.0)):
        config = config_for(data, tmp_path, "train.budget_seconds=8", f"train.budget_includes_eval={includes}")
        watch = BudgetClock(config, used=1.0, clock=clock)
        now[0] += 5.0
        watch.begin_pause()
        now[0] += 4.0
        assert watch.used() == (10.0 if includes else 6.0)  # during the pause: at its start when excluded
        watch.end_pause()
        assert watch.used() == expected and watch.exceeded() == (expected >= 8)
        now[0] = 0.0


class FakeClock:
    """perf_counter stand-in: each read advances one 'second'."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def fixed_probe(config):
    return budget_module.plan_steps(config, step_seconds=0.01, threads=1)


def metrics(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def stopped_clock(monkeypatch) -> None:
    """The budget's clock never advances: the run ends at its planned step whatever this machine's speed."""
    monkeypatch.setattr(trainer_module, "BudgetClock",
                        lambda config, used=0.0: BudgetClock(config, used=used, clock=lambda: 0.0))


def test_budgeted_run_is_planned_saved_and_resumed_with_its_plan(data, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_module, "plan_budget", fixed_probe)
    stopped_clock(monkeypatch)
    run_dir = tmp_path / "run"
    config = config_for(data, run_dir, "train.budget_seconds=0.5")
    result = train(config.with_overrides([]), quiet=True)
    saved = load_config(run_dir / "config.toml")
    assert result.status == "finished" and result.final_step == saved.train.max_steps == 39
    assert saved.train.threads == 1 and saved.optim.warmup_iters == 3  # a tenth of the run at most
    assert len(metrics(run_dir, "eval")) == 8
    # A resume with another budget is refused, naming both; the run is untouched.
    before = (run_dir / "metrics.jsonl").read_bytes()
    with pytest.raises(ValueError, match=r"planned for a budget of 0.5 s, this asks for 9.0 s"):
        train(config.with_overrides(["train.budget_seconds=9"]), resume=True, quiet=True)
    assert (run_dir / "metrics.jsonl").read_bytes() == before


def test_resume_refuses_a_changed_recipe(data, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_module, "plan_budget", fixed_probe)
    stopped_clock(monkeypatch)
    run_dir = tmp_path / "run"
    config = config_for(data, run_dir, "train.budget_seconds=0.2")
    train(config, quiet=True)
    with pytest.raises(ValueError, match=r"the optimizer settings changed \(saved -> asked: optim.lr 0.003 -> 0.002"):
        train(config.with_overrides(["optim.lr=2e-3"]), resume=True, quiet=True)


def test_a_slow_machine_stops_at_the_budget_with_a_final_evaluation_and_checkpoint(data, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_module, "plan_budget", fixed_probe)
    clock = FakeClock()
    monkeypatch.setattr(trainer_module, "BudgetClock",
                        lambda config, used=0.0: BudgetClock(config, used=used, clock=clock))
    run_dir = tmp_path / "run"
    result = train(config_for(data, run_dir, "train.budget_seconds=0.5"), quiet=True)
    planned = load_config(run_dir / "config.toml").train.max_steps
    # Each step reads the fake clock once: 1 "second" a step against a budget of 0.5 s.
    assert result.status == "finished" and 0 < result.final_step < planned
    assert "the time budget (0.5 s) ran out at step" in result.message
    evals = metrics(run_dir, "eval")
    assert evals[-1]["step"] == result.final_step  # the last step was evaluated
    assert (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())


def test_cli_budget_flag_and_its_bad_values(data, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(trainer_module, "plan_budget", fixed_probe)
    stopped_clock(monkeypatch)
    base = ["train", "--config", str(CONFIGS / "tiny.toml"), "--set", f"data.train_path={data['train']}",
            "--set", f"data.val_path={data['val']}", "--set", "data.batch_size=4", "--quiet"]
    assert cli_main([*base, "--run-dir", str(tmp_path / "ok"), "--budget", "0.3s"]) == 0
    assert load_config(tmp_path / "ok" / "config.toml").train.budget_seconds == 0.3
    capsys.readouterr()
    assert cli_main([*base, "--run-dir", str(tmp_path / "bad"), "--budget", "25 minutes"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("scratchlm train: error: budget '25 minutes' is not a positive duration: write e.g. 25m, 1.5h, "
                   "900s or 900 (seconds)")
    assert not (tmp_path / "bad").exists()


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
