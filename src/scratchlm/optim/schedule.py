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

Being pure functions of the iteration, a resumed run recomputes the same rate without saving any state; the
trainer writes the value into each ``param_group["lr"]`` before ``optimizer.step()``.
"""

from __future__ import annotations

import math


def _validate(max_lr: float, min_lr: float, warmup_iters: int, cosine_cycle_iters: int) -> None:
    if warmup_iters < 0:
        raise ValueError(f"lr schedule: warmup_iters must be >= 0, got {warmup_iters}")
    if warmup_iters > cosine_cycle_iters:
        raise ValueError(f"lr schedule: warmup_iters ({warmup_iters}) must not exceed cosine_cycle_iters "
                         f"({cosine_cycle_iters})")
    if not 0 <= min_lr <= max_lr:
        raise ValueError(f"lr schedule: need 0 <= min_lr <= max_lr, got min_lr={min_lr}, max_lr={max_lr}")


def lr_cosine_schedule(it: int, max_lr: float, min_lr: float, warmup_iters: int, cosine_cycle_iters: int) -> float:
    """Learning rate at iteration ``it`` (0-based)."""
    _validate(max_lr, min_lr, warmup_iters, cosine_cycle_iters)
    if it < 0:
        raise ValueError(f"lr schedule: iteration must be >= 0, got {it}")
    if it < warmup_iters:
        return max_lr * it / warmup_iters
    if it > cosine_cycle_iters:
        return min_lr
    decay_iters = cosine_cycle_iters - warmup_iters
    if decay_iters == 0:  # warm-up ends exactly where the cycle ends: nothing to decay over
        return max_lr if it == warmup_iters else min_lr
    progress = (it - warmup_iters) / decay_iters  # in [0, 1]
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (max_lr - min_lr)


def lr_wsd_schedule(it: int, max_lr: float, min_lr: float, warmup_iters: int, total_iters: int,
                    decay_fraction: float, shape: str = "linear") -> float:
    """Learning rate at iteration ``it`` (0-based) of a warm-up, stable, decay schedule over ``total_iters``."""
    decay_iters = round(decay_fraction * total_iters)
    _validate(max_lr, min_lr, warmup_iters, total_iters - decay_iters)
    if shape not in ("linear", "1-sqrt"):
        raise ValueError(f"lr schedule: decay shape must be linear or 1-sqrt, got {shape!r}")
    if it < 0:
        raise ValueError(f"lr schedule: iteration must be >= 0, got {it}")
    if it < warmup_iters:
        return max_lr * it / warmup_iters
    decay_start = total_iters - decay_iters
    if it < decay_start:
        return max_lr
    if it >= total_iters or decay_iters == 0:
        return min_lr
    progress = (it - decay_start) / decay_iters  # in [0, 1)
    remaining = 1 - progress if shape == "linear" else 1 - math.sqrt(progress)
    return min_lr + (max_lr - min_lr) * remaining
