"""Training within a time budget: measure a step on this machine, then plan the steps that fill the budget.

``scratchlm train --budget 25m`` (``train.budget_seconds``) asks for "the best model in 25 minutes here".
``plan_budget`` times a few real optimizer steps on the run's own tokens (``choose_threads``: on a busy CPU one
thread can beat the default count) and sets ``train.max_steps`` so that training, plus its ``EVALUATIONS``
evaluations when ``train.budget_includes_eval``, fills the budget; the schedule's warm-up and decay are laid over
exactly those steps.

The probe is a guess, so the run re-plans at every log step (``LivePlan``) on a ``BudgetClock`` that counts from the
command's start: the step time is the median of the last ``WINDOWS`` log windows; ``max_steps`` fills
``REPLANNED_SHARE`` of the budget after a reserve for the evaluations to come (their cadence set by the first one's
measured cost, within ``EVAL_SHARE``); the decay follows the new end (``optim.schedule.Replanned``), so the rate is
continuous and reaches min_lr at the end. The live plan is saved in every checkpoint, for a resume to carry on.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from scratchlm.config import RunConfig
from scratchlm.optim.schedule import Replanned

PLANNED_SHARE = 0.95  # of the budget; the rest absorbs step-time noise and the final checkpoint
# Once steps are measured, the plan is corrected every log step: the margin is left only for the steps after the
# last correction (a log window, ~2% of the run) running slower than measured.
REPLANNED_SHARE = 0.97
# Evaluations and checkpoints take at most this share of a budget that includes them: a learning curve of a few
# points is worth a few percent of the training, no more (a fixed count of evaluations can take far more of a
# short budget on a CPU; docs/benchmarks.md).
EVAL_SHARE = 0.05
WINDOWS = 5  # log windows in the step-time median, and measured before the first re-plan: a median of five
# outvotes two slow windows (a compile, a recompile at the first evaluation, a hiccup)
REPORTED_CHANGE = 0.02  # a re-plan that moves the end by more than this share of the steps is printed
EVALUATIONS = 8  # evaluations (and checkpoints) over a budgeted run: the learning curve's points
PROBE_STEPS = 3  # timed steps a side of the probe (after a warm-up step): a median of three outvotes one hiccup
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


def measure_step_seconds(config: RunConfig, train_tokens: np.ndarray, steps: int) -> float:
    """Seconds per optimizer step of this config on this machine: one warm-up step, then the median of `steps`,
    on batches of ``train_tokens`` (the run's training data, already opened and checked)."""
    from scratchlm.data.batches import BatchSampler
    from scratchlm.train.setup import build_model, build_optimizer, select_device
    from scratchlm.train.step import train_step

    device = select_device(config.train.device)
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


def choose_threads(config: RunConfig, train_tokens: np.ndarray) -> tuple[int, float]:
    """(torch threads, seconds per step): the default thread count, or 1 when that is clearly faster (a busy
    machine). Leaves torch set to the thread count it returns. PROBE_STEPS a side, as the probe is spent from the
    budget."""
    default = torch.get_num_threads()
    seconds = measure_step_seconds(config, train_tokens, PROBE_STEPS)
    if default > 1 and config.train.device in ("cpu", "auto") and not torch.cuda.is_available():
        torch.set_num_threads(1)
        single = measure_step_seconds(config, train_tokens, PROBE_STEPS)
        if single < 0.8 * seconds:
            return 1, single
        torch.set_num_threads(default)
    return default, seconds


def evaluation_cost_steps(config: RunConfig) -> float:
    """One evaluation's cost in training steps: eval_batches forward passes of a micro-batch, each about a third of
    that micro-batch's forward + backward."""
    return config.train.eval_batches / (3 * config.train.grad_accum_steps)


def plan_steps(config: RunConfig, step_seconds: float, threads: int = 1,
               spent: float = 0.0) -> tuple[RunConfig, BudgetPlan]:
    """The config with max_steps, the schedule's warm-up and the log/eval/checkpoint cadence fitted to what is left
    of train.budget_seconds after `spent` seconds of start-up, at `step_seconds` a step (a pure function: tests
    give it any step time)."""
    budget = config.train.budget_seconds
    eval_steps = 0.0
    if config.train.budget_includes_eval:  # EVALUATIONS of them, held to EVAL_SHARE of the budget; the last one stays
        cost = evaluation_cost_steps(config)
        eval_steps = min(EVALUATIONS * cost, max(cost, EVAL_SHARE * (budget - spent) / step_seconds))
    steps = int(PLANNED_SHARE * (budget - spent) / step_seconds - eval_steps)
    if steps < MIN_STEPS:
        needed = (MIN_STEPS + evaluation_cost_steps(config)) * step_seconds / PLANNED_SHARE
        raise ValueError(f"budget {budget:g} s is too small: a step takes {step_seconds:.2f} s here, so it buys "
                         f"{max(steps, 0)} steps (and its evaluations); give at least {math.ceil(needed + spent)} s")
    every = max(1, math.ceil(steps / EVALUATIONS))
    warmup = min(config.optim.warmup_iters, steps // 10)
    if config.optim.schedule == "wsd":
        warmup = min(warmup, steps - round(config.optim.decay_fraction * steps))
    planned = config.with_values(
        train={"max_steps": steps, "eval_every": every, "checkpoint_every": every, "log_every": max(1, steps // 50)},
        optim={"warmup_iters": warmup})
    return planned, BudgetPlan(budget, step_seconds, threads, steps, eval_steps)


def plan_budget(config: RunConfig, train_tokens: np.ndarray,
                started: float | None = None) -> tuple[RunConfig, BudgetPlan]:
    """Measure a step on this machine on ``train_tokens`` (``choose_threads``) and plan the run (plan_steps) over
    what is left of the budget since ``started`` (a time.perf_counter() reading: when the command began; None: the
    budget is whole)."""
    threads, step_seconds = choose_threads(config, train_tokens)
    spent = 0.0 if started is None else time.perf_counter() - started
    return plan_steps(config, step_seconds, threads, spent)


class BudgetClock:
    """A training session's clock: its training seconds (the loop's throughput and train_time, the live plan's step
    time) and the budget time used so far: training time, plus evaluation/checkpoint time when the budget
    includes it. It runs with or without a budget.

    The loop brackets each evaluation/checkpoint with ``begin_pause``/``end_pause``; read during one (a
    checkpoint records the time used), the clock stands at the pause's start. ``clock`` is injectable so tests
    never depend on the machine's speed. ``started`` (a reading of ``clock``: when the command began) counts the
    session's start-up (the probe, building the model, a restore) as used: a budget is the command's wall time,
    not only its training's.
    """

    def __init__(self, config: RunConfig, used: float = 0.0, clock: Callable[[], float] = time.perf_counter,
                 started: float | None = None) -> None:
        self.budget = config.train.budget_seconds
        self.includes_eval = config.train.budget_includes_eval
        self.clock = clock
        self.session_start = clock()
        startup = 0.0 if started is None else self.session_start - started
        self.used_before = used + startup  # earlier sessions of a resumed run, and this one's start-up
        self.paused = 0.0  # excluded pause time of this session
        self.all_paused = 0.0  # all pause time of this session, excluded or not
        self.pause_start: float | None = None

    def begin_pause(self) -> None:
        self.pause_start = self.clock()

    def end_pause(self) -> None:
        seconds = self.clock() - self.pause_start
        self.all_paused += seconds
        if not self.includes_eval:
            self.paused += seconds
        self.pause_start = None

    def training_seconds(self) -> float:
        """Seconds of this session spent training, without any pause: what the step time is measured on."""
        now = self.pause_start if self.pause_start is not None else self.clock()
        return now - self.session_start - self.all_paused

    def used(self) -> float:
        excluding = not self.includes_eval and self.pause_start is not None
        now = self.pause_start if excluding else self.clock()
        return self.used_before + now - self.session_start - self.paused

    def exceeded(self) -> bool:
        return self.budget is not None and self.used() >= self.budget


NO_PERIODIC_EVALUATION = 2**31 - 1  # an eval_every no step reaches: only the final evaluation remains


@dataclass
class LivePlan:
    """A budgeted run's plan as it is corrected during the run (module docstring); JSON-able for the checkpoint."""

    max_steps: int
    eval_every: int
    eval_batches: int
    planned_steps: int  # the probe's plan, for the final summary
    decay: list | None = None  # [anchor, anchor_progress] of the re-planned decay (None: the schedule's own)
    samples: list[float] = field(default_factory=list)  # mean step seconds of the last log windows
    point_cost: float | None = None  # seconds of one evaluation + checkpoint, measured on the first one
    replans: int = 0  # re-plans that changed max_steps
    reported_steps: int = 0  # max_steps at the last printed re-plan
    window: list | None = None  # [step, training seconds] where the current log window began (this session)

    @classmethod
    def start(cls, config: RunConfig, saved: dict | None) -> LivePlan:
        """The plan of a fresh run (from the probe's config) or the one a resumed run saved."""
        if saved is not None:
            plan = cls(**saved)
        else:
            train = config.train
            plan = cls(train.max_steps, train.eval_every, train.eval_batches, train.max_steps,
                       reported_steps=train.max_steps)
            if replans_decay(config):
                plan.decay = [_decay_start(config, train.max_steps), 0.0]
        return plan

    def to_dict(self) -> dict:
        return asdict(self)

    def applied(self, config: RunConfig) -> RunConfig:
        """``config`` with this plan's max_steps and evaluation/checkpoint cadence."""
        return config.with_values(train={"max_steps": self.max_steps, "eval_every": self.eval_every,
                                         "checkpoint_every": self.eval_every, "eval_batches": self.eval_batches})

    def replanned(self) -> Replanned | None:
        """The learning-rate schedule's decay under this plan (None: the schedule follows config as planned)."""
        return None if self.decay is None else Replanned(self.decay[0], self.decay[1], self.max_steps)

    def begin_session(self, step: int, clock: BudgetClock) -> None:
        """A session's first log window starts at its first step (a saved window holds another session's time)."""
        self.window = [step, clock.training_seconds()]

    def replan(self, step: int, clock: BudgetClock, config: RunConfig) -> str | None:
        """Measure the log window that ends at ``step`` and re-plan the rest of the run (module docstring); a line
        saying so when the end moved by more than REPORTED_CHANGE since the last such line."""
        now = clock.training_seconds()
        if self.window is not None and step > self.window[0]:
            self.samples = [*self.samples, (now - self.window[1]) / (step - self.window[0])][-WINDOWS:]
        self.window = [step, now]
        includes_eval = config.train.budget_includes_eval
        if includes_eval and self.point_cost is None and clock.all_paused > 0:
            self._plan_evaluations(clock.all_paused, config)
        step_seconds = statistics.median(self.samples) if len(self.samples) == WINDOWS else 0.0
        if step_seconds <= 0:  # not measured yet (or a clock that stands still)
            return None
        reserve = 0.0
        if includes_eval:  # the evaluations to come, the final one included
            point = self.point_cost if self.point_cost is not None else evaluation_cost_steps(config) * step_seconds
            periodic = (self.max_steps - 1) // self.eval_every - step // self.eval_every  # steps after this one
            reserve = point * (1 + periodic)
        remaining = REPLANNED_SHARE * config.train.budget_seconds - clock.used() - reserve
        total = step + max(1, math.floor(remaining / step_seconds))
        if total != self.max_steps:
            self._move_end(step, total, config)
        if abs(total - self.reported_steps) <= REPORTED_CHANGE * self.reported_steps:
            return None
        was, self.reported_steps = self.reported_steps, total
        decay = f"; the decay from step {self.decay[0]}" if self.decay is not None else ""
        return f"re-planned at step {step}: {step_seconds:.3f} s/step measured -> {total} steps (was {was}){decay}"

    def _move_end(self, step: int, total: int, config: RunConfig) -> None:
        if self.decay is not None:
            anchor, progress = self.decay
            if step < anchor and progress == 0:  # the decay has not begun: it starts where the new total puts it
                start = _decay_start(config, total) if config.optim.schedule == "wsd" else anchor
                self.decay = [min(total - 1, max(start, step)), 0.0]
            else:  # under way: frozen where it began, continued from where it stands to the new end
                self.decay = [step, self.replanned().progress(step)]
        self.max_steps = total
        self.replans += 1

    def _plan_evaluations(self, cost: float, config: RunConfig) -> None:
        """The cadence that keeps evaluations (with their checkpoints) within EVAL_SHARE, from the first one's
        ``cost``. Counted: the one already done, the final one and one spare for a run that grows, so
        ``affordable - 2`` periodic ones remain."""
        share = EVAL_SHARE * config.train.budget_seconds
        affordable = math.floor(share / cost)
        if affordable < 2:  # not even this one and the final one: evaluate on fewer batches (the checkpoint stays)
            self.eval_batches = max(1, math.floor(self.eval_batches * share / (2 * cost)))
            cost = share / 2
        self.point_cost = cost
        periodic = min(EVALUATIONS, affordable - 2)
        self.eval_every = max(1, math.ceil(self.max_steps / periodic)) if periodic > 0 else NO_PERIODIC_EVALUATION

    def summary(self, step: int, clock: BudgetClock) -> str:
        return (f"budget {clock.budget:g} s: {self.planned_steps} steps planned by the probe, {step} run "
                f"({self.replans} re-plan{'s' * (self.replans != 1)}), {clock.used():.0f} s of the budget used")


def replans_decay(config: RunConfig) -> bool:
    """Whether the schedule's decay follows max_steps, and so moves with a re-plan: WSD, and a cosine over the
    whole run (one with its own optim.cosine_cycle_iters keeps it)."""
    return config.optim.schedule == "wsd" or config.optim.cosine_cycle_iters is None


def _decay_start(config: RunConfig, total: int) -> int:
    """Where the schedule's decay begins in a run of ``total`` steps: WSD's last decay_fraction, cosine's warm-up."""
    if config.optim.schedule == "wsd":
        return max(config.optim.warmup_iters, total - round(config.optim.decay_fraction * total))
    return config.optim.warmup_iters
