"""Learning-rate schedules, as pure functions of the iteration.

Cosine (CS336 / LLaMA recipe): linear warm-up, cosine decay, then a flat floor.

    it < warmup_iters                      : max_lr * it / warmup_iters
    warmup_iters <= it <= cosine_cycle_iters: min_lr + (1 + cos(pi * (it - warmup) / (cycle - warmup))) / 2
                                                        * (max_lr - min_lr)
    it > cosine_cycle_iters                : min_lr

Warm-up, stable, decay (WSD; Hu et al. 2024, "MiniCPM"; Hägele et al. 2024): the rate stays at its peak for most
of the run and falls only over the last ``decay_fraction`` of ``total_iters``, linearly or as 1 - sqrt(progress).
Training at the peak rate for longer and cooling down at the end matches or beats cosine at a fixed budget, and
the cool-down is where most of the loss drop shows.

    it < warmup_iters        : max_lr * it / warmup_iters
    it < decay_start         : max_lr                        (decay_start = total - round(decay_fraction * total))
    decay_start <= it <= total: min_lr + (max_lr - min_lr) * (1 - p)  or  * (1 - sqrt(p)),
                                p = (it - decay_start) / (total - decay_start)

A resumed run recomputes the same rate without saving any state. A time-budgeted run moves its end as it goes
(train/budget.py), and a decay already under way must then continue from where it stands, never jump up: both
schedules take a ``Replanned`` (where the decay's progress p stands at an anchor step, and where it reaches 1) in
place of the p their formula gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Replanned:
    """A decay re-planned mid-run: from step ``anchor`` on, its progress runs linearly from ``anchor_progress`` to
    1 at step ``end``, so the rate continues from its value at the anchor and falls monotonically to min_lr.

    Steps before the anchor are the past, which a re-plan does not describe: they read as the anchor's progress
    (0 for a WSD decay that has not started: the stable phase). ``end`` > ``anchor``."""

    anchor: int
    anchor_progress: float
    end: int

    def progress(self, it: int) -> float:
        if it <= self.anchor:
            return self.anchor_progress
        if it >= self.end:
            return 1.0
        return self.anchor_progress + (1 - self.anchor_progress) * (it - self.anchor) / (self.end - self.anchor)


def _validate(it: int, max_lr: float, min_lr: float, warmup_iters: int, cosine_cycle_iters: int) -> None:
    if it < 0:
        raise ValueError(f"lr schedule: iteration must be >= 0, got {it}")
    if warmup_iters < 0:
        raise ValueError(f"lr schedule: warmup_iters must be >= 0, got {warmup_iters}")
    if warmup_iters > cosine_cycle_iters:
        raise ValueError(f"lr schedule: warmup_iters ({warmup_iters}) must not exceed cosine_cycle_iters "
                         f"({cosine_cycle_iters})")
    if not 0 <= min_lr <= max_lr:
        raise ValueError(f"lr schedule: need 0 <= min_lr <= max_lr, got min_lr={min_lr}, max_lr={max_lr}")


def lr_cosine_schedule(it: int, max_lr: float, min_lr: float, warmup_iters: int, cosine_cycle_iters: int,
                       replanned: Replanned | None = None) -> float:
    """Learning rate at iteration ``it`` (0-based); ``replanned`` (after the warm-up) replaces the cycle's end."""
    _validate(it, max_lr, min_lr, warmup_iters, cosine_cycle_iters)
    if it < warmup_iters:
        return max_lr * it / warmup_iters
    decay = replanned or Replanned(warmup_iters, 0.0, cosine_cycle_iters)
    if it > decay.end:
        return min_lr
    if decay.end == decay.anchor:  # warm-up ends exactly where the cycle ends: nothing to decay over
        return max_lr if it == warmup_iters else min_lr
    progress = decay.progress(it)  # in [0, 1]
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (max_lr - min_lr)


def lr_wsd_schedule(it: int, max_lr: float, min_lr: float, warmup_iters: int, total_iters: int,
                    decay_fraction: float, shape: str = "linear", replanned: Replanned | None = None) -> float:
    """Learning rate at iteration ``it`` (0-based) of a warm-up, stable, decay schedule over ``total_iters``;
    ``replanned`` replaces the decay's start and end (its anchor, with progress 0 while the decay has not begun)."""
    decay_iters = round(decay_fraction * total_iters)
    decay = replanned or Replanned(total_iters - decay_iters, 0.0, total_iters)
    _validate(it, max_lr, min_lr, warmup_iters, total_iters - decay_iters if replanned is None else warmup_iters)
    if shape not in ("linear", "1-sqrt"):
        raise ValueError(f"lr schedule: decay shape must be linear or 1-sqrt, got {shape!r}")
    if it < warmup_iters:
        return max_lr * it / warmup_iters
    if it < decay.anchor and decay.anchor_progress == 0:
        return max_lr
    if it >= decay.end or decay.end == decay.anchor:
        return min_lr
    progress = decay.progress(it)  # in [0, 1)
    remaining = 1 - progress if shape == "linear" else 1 - math.sqrt(progress)
    return min_lr + (max_lr - min_lr) * remaining
