"""Time-budgeted training: duration parsing, the plan (a pure function of a given step time), the graceful stop
at the budget on a fake clock, and resume keeping the plan. No test here depends on the machine's speed: the
probe is replaced by a fixed step time and the clock by a counter."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from scratchlm.cli import main as cli_main
from scratchlm.config import load_config
from scratchlm.data.token_file import write_token_file
from scratchlm.optim.schedule import Replanned
from scratchlm.train import budget as budget_module
from scratchlm.train import resolve as resolve_module
from scratchlm.train import trainer as trainer_module
from scratchlm.train.budget import BudgetClock, parse_duration, plan_steps
from scratchlm.train.checkpoint import CheckpointManager
from scratchlm.train.step import learning_rate
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
    # evaluations held to 5% of the budget (1.5 steps), not 8 of them: 2.85 / 0.1 - 1.5 -> 26 steps
    assert planned.train.max_steps == 26 and planned.optim.warmup_iters == 1  # 26 - round(0.95 * 26) = 1


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


def test_the_start_up_is_spent_from_the_budget(data, tmp_path):
    """A budget is the command's wall time: the seconds before the first step (the probe, building the model)
    leave fewer steps in the plan and count on the clock, but not in the step time it measures."""
    config = config_for(data, tmp_path, "train.budget_seconds=100")
    planned, _ = plan_steps(config, step_seconds=0.1, spent=20.0)
    assert planned.train.max_steps == int(0.95 * 80 / 0.1 - budget_module.EVALUATIONS) == 752
    with pytest.raises(ValueError, match=r"give at least 26 s"):  # 6 s of steps after the 20 s spent
        plan_steps(config.with_values(train={"budget_seconds": 21.0}), step_seconds=0.5, spent=20.0)
    now = [30.0]
    watch = BudgetClock(config, used=2.0, clock=lambda: now[0], started=18.0)  # 12 s of start-up this session
    now[0] += 5.0
    assert watch.used() == 2.0 + 12.0 + 5.0 and watch.training_seconds() == 5.0


class FakeClock:
    """perf_counter stand-in: each read advances one 'second'."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def fixed_probe(config, train_tokens, started=None):
    return budget_module.plan_steps(config, step_seconds=0.01, threads=1)


def metrics(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def stopped_clock(monkeypatch) -> None:
    """The budget's clock never advances: the run ends at its planned step whatever this machine's speed."""
    monkeypatch.setattr(trainer_module, "BudgetClock",
                        lambda config, used=0.0, started=None: BudgetClock(config, used=used, clock=lambda: 0.0))


def test_budgeted_run_is_planned_saved_and_resumed_with_its_plan(data, tmp_path, monkeypatch):
    monkeypatch.setattr(resolve_module, "plan_budget", fixed_probe)
    stopped_clock(monkeypatch)
    run_dir = tmp_path / "run"
    config = config_for(data, run_dir, "train.budget_seconds=0.5")
    result = train(config.with_overrides([]), quiet=True)
    saved = load_config(run_dir / "config.toml")
    assert result.status == "finished" and result.final_step == saved.train.max_steps == 45
    # 0.95 * 0.5 / 0.01 = 47.5 steps, less 2.5 of evaluations (5% of the budget) -> 45
    assert saved.train.threads == 1 and saved.optim.warmup_iters == 4  # a tenth of the run at most
    assert len(metrics(run_dir, "eval")) == 8
    # A resume with another budget is refused, naming both; the run is untouched.
    before = (run_dir / "metrics.jsonl").read_bytes()
    with pytest.raises(ValueError, match=r"planned for a budget of 0.5 s, this asks for 9.0 s"):
        train(config.with_overrides(["train.budget_seconds=9"]), resume=True, quiet=True)
    assert (run_dir / "metrics.jsonl").read_bytes() == before


def test_resume_refuses_a_changed_recipe(data, tmp_path, monkeypatch):
    monkeypatch.setattr(resolve_module, "plan_budget", fixed_probe)
    stopped_clock(monkeypatch)
    run_dir = tmp_path / "run"
    config = config_for(data, run_dir, "train.budget_seconds=0.2")
    train(config, quiet=True)
    with pytest.raises(ValueError, match=r"the optimizer settings changed \(saved -> asked: optim.lr 0.003 -> 0.002"):
        train(config.with_overrides(["optim.lr=2e-3"]), resume=True, quiet=True)


def test_a_slow_machine_stops_at_the_budget_with_a_final_evaluation_and_checkpoint(data, tmp_path, monkeypatch):
    monkeypatch.setattr(resolve_module, "plan_budget", fixed_probe)
    clock = FakeClock()
    monkeypatch.setattr(trainer_module, "BudgetClock",
                        lambda config, used=0.0, started=None: BudgetClock(config, used=used, clock=clock))
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
    monkeypatch.setattr(resolve_module, "plan_budget", fixed_probe)
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


# ---- re-planning on a simulated machine -------------------------------------------------------------------------

REAL_WORK = (trainer_module.train_step, trainer_module.evaluate, CheckpointManager.save)  # before any machine


class SimulatedMachine:
    """The budget's clock, advanced only by the work the run does: each training step by its (changing) step time,
    each evaluation and checkpoint by its cost. Records every step's learning rate and every checkpoint's plan."""

    def __init__(self, step_seconds, eval_seconds: float = 1.0, checkpoint_seconds: float = 0.5) -> None:
        self.step_seconds, self.eval_seconds, self.checkpoint_seconds = step_seconds, eval_seconds, checkpoint_seconds
        self.now = self.paused = 0.0
        self.lrs: list[float] = []
        self.plans: list[dict] = []  # the live plan saved with each checkpoint
        self.saved_steps: list[int] = []
        self.stop_after: int | None = None  # steps after which a SIGINT arrives

    def __call__(self) -> float:
        return self.now

    def install(self, monkeypatch) -> None:
        real_step, real_evaluate, real_save = REAL_WORK

        def train_step(*args, lr, **kwargs):
            self.lrs.append(lr)
            self.now += self.step_seconds(len(self.lrs) - 1)
            if len(self.lrs) == self.stop_after:
                signal.raise_signal(signal.SIGINT)  # the loop finishes this step, saves and returns
            return real_step(*args, lr=lr, **kwargs)

        def evaluate(*args, **kwargs):
            self.now += self.eval_seconds
            self.paused += self.eval_seconds
            return real_evaluate(*args, **kwargs)

        def save(manager, step, *args, extra, **kwargs):
            self.now += self.checkpoint_seconds
            self.paused += self.checkpoint_seconds
            self.plans.append(extra["plan"])
            self.saved_steps.append(step)
            return real_save(manager, step, *args, extra=extra, **kwargs)

        monkeypatch.setattr(trainer_module, "train_step", train_step)
        monkeypatch.setattr(trainer_module, "evaluate", evaluate)
        monkeypatch.setattr(CheckpointManager, "save", save)
        monkeypatch.setattr(trainer_module, "BudgetClock",
                            lambda config, used=0.0, started=None: BudgetClock(config, used=used, clock=self))
        monkeypatch.setattr(resolve_module, "plan_budget",  # the probe: 0.5 s
                            lambda config, train_tokens, started=None: plan_steps(config, step_seconds=0.5,
                                                                                  threads=1))


BUDGET = 120.0  # simulated seconds: the probe's 0.5 s a step plans int(0.95 * 120 / 0.5 - 8) = 220 steps


def simulated_config(data, run_dir: Path, *extra: str):
    return config_for(data, run_dir, f"train.budget_seconds={BUDGET}", "optim.schedule=wsd",
                      "optim.decay_fraction=0.3", "optim.warmup_iters=10", *extra)


def changing_speed(factor: float, at_step: int):
    return lambda step: 0.5 if step < at_step else 0.5 * factor


@pytest.mark.parametrize("factor, at_step", [(1.3, 160), (1 / 1.3, 160), (1.3, 60), (1 / 1.3, 60)],
                         ids=["slower-in-the-decay", "faster-in-the-decay", "slower-before-it", "faster-before-it"])
def test_a_run_re_planned_for_a_machine_that_changes_speed_ends_its_cool_down_inside_the_budget(
        data, tmp_path, monkeypatch, factor, at_step):
    machine = SimulatedMachine(changing_speed(factor, at_step))
    machine.install(monkeypatch)
    config = simulated_config(data, tmp_path / "run")
    result = train(config, quiet=True)
    lrs, plan = machine.lrs, machine.plans[-1]
    lr, min_lr = config.optim.lr, config.optim.min_lr
    initial_start = 220 - round(0.3 * 220)  # 154: the decay's start in the probe's plan (re-planning, even at the
    # probe's speed, moves it by a few steps: the re-plan's margin is smaller, and the evaluations are fewer)
    # The run ends at its (re-planned) last step, inside the budget, having used nearly all of it.
    assert result.status == "finished" and "ran out" not in result.message
    assert result.final_step == len(lrs) == plan["max_steps"] and plan["planned_steps"] == 220
    assert 0.9 * BUDGET <= machine.now <= BUDGET
    assert (plan["max_steps"] < 220) == (factor > 1)  # a slower machine runs fewer steps, a faster one more
    # The schedule: warm-up up, then never up again, and the cool-down complete: the schedule stands at min_lr at
    # the end, and the last step trains one decay step above it.
    peak = lrs.index(lr)
    assert lrs[:peak] == sorted(lrs[:peak]) and all(b <= a for a, b in zip(lrs[peak:], lrs[peak + 1:]))
    replanned = load_config(tmp_path / "run" / "config.toml").with_overrides([f"train.max_steps={len(lrs)}"])
    decay = Replanned(plan["decay"][0], plan["decay"][1], plan["max_steps"])
    assert learning_rate(len(lrs), replanned, decay) == min_lr
    assert learning_rate(len(lrs) - 1, replanned, decay) == lrs[-1]
    assert min_lr < lrs[-1] < min_lr + 0.05 * (lr - min_lr)
    decay_start = next(i for i in range(peak, len(lrs)) if lrs[i] < lr) - 1  # the last step at the peak
    follows_the_end = len(lrs) - round(0.3 * len(lrs))
    if at_step > initial_start:  # the decay had begun: its start stays, the rest is stretched or shrunk
        assert abs(decay_start - initial_start) <= 3 and decay_start < at_step and decay_start != follows_the_end
    else:  # not yet begun: it starts at decay_fraction of the new total
        assert decay_start == follows_the_end and abs(decay_start - initial_start) > 10
    # Evaluations and checkpoints kept to their share of the budget; the last step was evaluated and saved.
    assert machine.paused <= budget_module.EVAL_SHARE * BUDGET
    assert metrics(tmp_path / "run", "eval")[-1]["step"] == result.final_step


def test_a_re_planned_run_resumes_exactly_where_it_stopped(data, tmp_path, monkeypatch):
    # 0.5 s a step, then 0.625: dyadic times, so the unbroken and the resumed runs' clocks read the same numbers;
    # a checkpoint costs nothing, since its own time is not in the budget_used it records.
    speed = changing_speed(1.25, 100)
    unbroken = SimulatedMachine(speed, checkpoint_seconds=0.0)
    unbroken.install(monkeypatch)
    train(simulated_config(data, tmp_path / "unbroken"), quiet=True)
    # Stop at a checkpoint step after the slow-down (so after re-plans), then resume on the same machine.
    stop = next(step for step in unbroken.saved_steps if step > 120)
    resumed = SimulatedMachine(speed, checkpoint_seconds=0.0)
    resumed.install(monkeypatch)
    resumed.stop_after = stop
    run_dir = tmp_path / "resumed"
    first = train(simulated_config(data, run_dir), quiet=True)
    assert first.status == "interrupted" and first.final_step == stop
    resumed.stop_after = None
    second = train(simulated_config(data, run_dir), resume=True, quiet=True)
    assert second.status == "finished" and second.final_step == len(unbroken.lrs) != 220
    assert resumed.lrs == unbroken.lrs and resumed.plans[-1]["max_steps"] == unbroken.plans[-1]["max_steps"]
    for kind, fields in (("train", ("step", "loss", "lr")), ("eval", ("step", "val_loss"))):
        assert [[r[f] for f in fields] for r in metrics(run_dir, kind)] == \
            [[r[f] for f in fields] for r in metrics(tmp_path / "unbroken", kind)]
