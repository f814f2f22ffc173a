"""Training within a time budget: measure a step on this machine, then plan the steps that fill the budget.

``scratchlm train --budget 25m`` (``train.budget_seconds``) asks for "the best model in 25 minutes here". Before
the run, ``plan_budget`` builds the model and optimizer once, times a few real optimizer steps (after a warm-up
step, which pays one-off allocation costs) and sets ``train.max_steps`` so that training, plus its evaluations when
``train.budget_includes_eval`` is on, fills the budget. The warm-up and the decay of the learning-rate schedule are
then laid over exactly those steps, so the schedule ends where the time does. The plan also spreads
``EVALUATIONS`` evaluations (each with a checkpoint) over the run.

If the machine slows down mid-run (another busy process), the loop stops at the budget anyway, through the same
graceful path as the last step: a final evaluation and a checkpoint (``BudgetClock``). A resumed run keeps its
plan: the planned fields are saved in the run's config.toml and a resume never re-plans.

On a CPU shared with other busy processes, PyTorch's worker threads wait on each other and one thread can be
several times faster than the default; the probe tries both and keeps the faster (``choose_threads``).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from scratchlm.config import RunConfig

PLANNED_SHARE = 0.95  # of the budget; the rest absorbs step-time noise and the final checkpoint
EVALUATIONS = 8  # evaluations (and checkpoints) over a budgeted run: the learning curve's points
MIN_STEPS = 10  # a budget that buys fewer steps than this (plus one evaluation) is refused
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smh]?)\s*$")


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``25m``, ``1.5h``, ``900s`` or ``900`` (seconds)."""
    match = _DURATION.match(text)
    seconds = float(match.group(1)) * _UNITS[match.group(2)] if match else 0.0
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"budget {text!r} is not a positive duration: write e.g. 25m, 1.5h, 900s or 900 (seconds)")
    return seconds


@dataclass(frozen=True)
class BudgetPlan:
    """What the probe measured and what it planned."""

    budget_seconds: float
    step_seconds: float
    threads: int
    max_steps: int
    eval_steps: float  # the evaluations' estimated cost, in training steps (0 when the budget excludes them)

    def describe(self, config: RunConfig, train_tokens: int) -> str:
        tokens = self.max_steps * config.tokens_per_step
        return (f"budget {self.budget_seconds / 60:g} min: {self.step_seconds:.3f} s/step measured with "
                f"{self.threads} thread{'s' * (self.threads > 1)} -> {self.max_steps} steps of "
                f"{config.tokens_per_step:,} tokens ({tokens / 1e6:.2f}M tokens, {tokens / train_tokens:.1f} epochs "
                f"of the training data)")


def measure_step_seconds(config: RunConfig, steps: int = 5) -> float:
    """Seconds per optimizer step of this config on this machine: one warm-up step, then the median of `steps`."""
    from scratchlm.data.batches import BatchSampler
    from scratchlm.train.setup import build_model, build_optimizer, open_data, select_device
    from scratchlm.train.step import train_step

    device = select_device(config.train.device)
    train_tokens, _ = open_data(config)
    model = build_model(config, device)
    optimizer = build_optimizer(model, config)
    sampler = BatchSampler(train_tokens, config.micro_batch_size, config.model.context_length, device, seed=0)
    times = []
    for _ in range(steps + 1):
        batches = [sampler.next() for _ in range(config.train.grad_accum_steps)]
        start = time.perf_counter()
        loss, _ = train_step(model, optimizer, batches, lr=config.optim.lr, grad_clip=config.optim.grad_clip,
                             dtype=config.train.dtype)
        loss.item()  # wait for the device
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def choose_threads(config: RunConfig) -> tuple[int, float]:
    """(torch threads, seconds per step): the default thread count, or 1 when that is clearly faster (a busy
    machine). Leaves torch set to the thread count it returns."""
    default = torch.get_num_threads()
    seconds = measure_step_seconds(config)
    if default > 1 and config.train.device in ("cpu", "auto") and not torch.cuda.is_available():
        torch.set_num_threads(1)
        single = measure_step_seconds(config)
        if single < 0.8 * seconds:
            return 1, single
        torch.set_num_threads(default)
    return default, seconds


def evaluation_cost_steps(config: RunConfig) -> float:
    """One evaluation's cost in training steps: eval_batches forward passes of a micro-batch, each about a third of
    that micro-batch's forward + backward."""
    return config.train.eval_batches / (3 * config.train.grad_accum_steps)


def plan_steps(config: RunConfig, step_seconds: float, threads: int = 1) -> tuple[RunConfig, BudgetPlan]:
    """The config with max_steps, the schedule's warm-up and the log/eval/checkpoint cadence fitted to
    train.budget_seconds at `step_seconds` a step (a pure function: tests give it any step time)."""
    budget = config.train.budget_seconds
    if budget is None:
        raise ValueError("plan_steps needs train.budget_seconds")
    eval_steps = EVALUATIONS * evaluation_cost_steps(config) if config.train.budget_includes_eval else 0.0
    steps = int(PLANNED_SHARE * budget / step_seconds - eval_steps)
    if steps < MIN_STEPS:
        needed = (MIN_STEPS + evaluation_cost_steps(config)) * step_seconds / PLANNED_SHARE
        raise ValueError(f"budget {budget:g} s is too small: a step takes {step_seconds:.2f} s here, so it buys "
                         f"{max(steps, 0)} steps (and its evaluations); give at least {math.ceil(needed)} s")
    every = max(1, math.ceil(steps / EVALUATIONS))
    warmup = min(config.optim.warmup_iters, steps // 10)
    if config.optim.schedule == "wsd":
        warmup = min(warmup, steps - round(config.optim.decay_fraction * steps))
    planned = config.with_overrides([
        f"train.max_steps={steps}", f"train.eval_every={every}", f"train.checkpoint_every={every}",
        f"train.log_every={max(1, steps // 50)}", f"optim.warmup_iters={warmup}"])
    return planned, BudgetPlan(budget, step_seconds, threads, steps, eval_steps)


def plan_budget(config: RunConfig,
                measure: Callable[[RunConfig], tuple[int, float]] = choose_threads) -> tuple[RunConfig, BudgetPlan]:
    """Measure a step on this machine (``measure`` -> (threads, seconds)) and plan the run: see plan_steps."""
    threads, step_seconds = measure(config)
    return plan_steps(config, step_seconds, threads)


class BudgetClock:
    """Budget time used so far: training time, plus evaluation/checkpoint time when the budget includes it.

    The loop brackets each evaluation/checkpoint with ``begin_pause``/``end_pause``; read during one (a
    checkpoint records the time used), the clock stands at the pause's start. ``clock`` is injectable so tests
    never depend on the machine's speed.
    """

    def __init__(self, config: RunConfig, used: float = 0.0, clock: Callable[[], float] = time.perf_counter) -> None:
        self.budget = config.train.budget_seconds
        self.includes_eval = config.train.budget_includes_eval
        self.clock = clock
        self.used_before = used  # from earlier sessions of a resumed run
        self.session_start = clock()
        self.paused = 0.0  # excluded pause time of this session
        self.pause_start: float | None = None

    def begin_pause(self) -> None:
        self.pause_start = self.clock()

    def end_pause(self) -> None:
        if not self.includes_eval:
            self.paused += self.clock() - self.pause_start
        self.pause_start = None

    def used(self) -> float:
        excluding = not self.includes_eval and self.pause_start is not None
        now = self.pause_start if excluding else self.clock()
        return self.used_before + now - self.session_start - self.paused

    def exceeded(self) -> bool:
        return self.budget is not None and self.used() >= self.budget
