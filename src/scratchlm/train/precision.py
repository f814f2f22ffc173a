"""``train.dtype = "auto"``: bf16 autocast where this machine runs the run's step clearly faster, else fp32.

Why measure: bf16 autocast multiplies at about twice fp32's rate on hardware with bf16 units (GPUs since Ampere,
CPUs with AVX512-BF16 or AMX) and far below it where bf16 is emulated (AVX2-only CPUs), and the loss a step buys is
nearly the same (docs/recipes.md: 5 minutes of the modern recipe on an AVX512-BF16 Xeon, 399 bf16 steps reached
0.924 bits/byte against 252 fp32 steps at 0.994). Under a time budget more steps is more quality, so a run asks the
machine rather than its CPU flags: it times a few steps of each (budget.measure_step_seconds, the budget's own
probe) before the plan, and keeps bf16 only if it is at least ``BF16_MIN_SPEEDUP`` times as fast, as its rounding
costs a little loss per step. The choice is the run's: config.toml records the dtype it took, so a resume (and
every rank under torch.distributed) trains the same one.
"""

from __future__ import annotations

import numpy as np

from scratchlm.config import RunConfig
from scratchlm.train.budget import measure_step_seconds

BF16_MIN_SPEEDUP = 1.1
PROBE_STEPS = 3  # per dtype, after a warm-up step: enough to tell 1.1x from noise on a quiet machine


def choose_dtype(config: RunConfig, train_tokens: np.ndarray) -> tuple[str, str]:
    """(the dtype for train.dtype = auto, a line saying what was measured) on batches of ``train_tokens``."""
    fp32, bf16 = (measure_step_seconds(config.with_overrides([f"train.dtype={dtype}"]), train_tokens, PROBE_STEPS)
                  for dtype in ("fp32", "bf16"))
    chosen = "bf16" if fp32 >= BF16_MIN_SPEEDUP * bf16 else "fp32"
    return chosen, (f"train.dtype = auto: {chosen} (a step took {fp32:.3f} s in fp32, {bf16:.3f} s in bf16 autocast; "
                    f"bf16 is taken from {BF16_MIN_SPEEDUP}x as fast)")
