"""The learning-rate schedule: linear warm-up, cosine decay, then a flat floor (CS336 / LLaMA recipe).

    it < warmup_iters                      : max_lr * it / warmup_iters
    warmup_iters <= it <= cosine_cycle_iters: min_lr + (1 + cos(pi * (it - warmup) / (cycle - warmup))) / 2
                                                        * (max_lr - min_lr)
    it > cosine_cycle_iters                : min_lr

It is a pure function of the iteration, so a resumed run recomputes the same rate without saving any state;
the trainer writes the value into each ``param_group["lr"]`` before ``optimizer.step()``.
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
