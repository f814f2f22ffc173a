"""Learning curves as a PNG: loss against optimizer steps and against wall-clock time, train and validation,
and below them the learning rate and the gradient norm (before clipping) against steps.

Drawn from metrics.jsonl records alone (so any run directory can be re-plotted) with matplotlib's Agg backend
(no display needed). The file is written to a temporary name and renamed, so a viewer never sees half a PNG.
matplotlib is optional (the ``[plot]`` extra): without it a run trains on without curves, saying so once.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

from scratchlm.extras import optional_import

CURVES_FILE = "curves.png"


def can_draw_curves() -> bool:
    """Whether matplotlib is installed; if not, one warning line (metrics.jsonl still has every number)."""
    if optional_import("matplotlib") is None:
        print(f"scratchlm: warning: matplotlib is not installed, so no {CURVES_FILE} is drawn "
              f"(pip install 'scratchlm[plot]')", file=sys.stderr, flush=True)
        return False
    return True


def plot_curves(records: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Write the four-panel learning-curve PNG for ``records`` (metrics.jsonl dicts) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r["kind"] == "train" and _finite(r["loss"])]
    evals = [r for r in records if r["kind"] == "eval" and _finite(r["val_loss"])]
    fig, ((by_step, by_time), (lr, grad_norm)) = plt.subplots(2, 2, figsize=(11, 7.5))
    by_time.sharey(by_step)
    for axis, x_key, x_label in ((by_step, "step", "optimizer step"), (by_time, "wall_time", "wall-clock time (s)")):
        axis.plot([r[x_key] for r in train], [r["loss"] for r in train], label="train", linewidth=1)
        axis.plot([r[x_key] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation", markersize=3)
        axis.set_xlabel(x_label)
        axis.grid(alpha=0.3)
    by_step.set_ylabel("cross-entropy loss (nats/token)")
    by_step.legend()
    for axis, key, label in ((lr, "lr", "learning rate"), (grad_norm, "grad_norm", "gradient norm")):
        points = [(r["step"], r[key]) for r in train if _finite(r.get(key))]
        if points:
            axis.plot(*zip(*points), linewidth=1)
            if wants_log_scale([y for _, y in points]):
                axis.set_yscale("log")
        axis.set(xlabel="optimizer step", ylabel=label)
        axis.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def wants_log_scale(values: list[float]) -> bool:
    """A log y-axis for positive values spanning a decade or more (a learning-rate sweep, a diverging run's
    gradient norm); a linear one otherwise, where log ticks would be unreadable (2x10^0, 2.1x10^0)."""
    return bool(values) and min(values) > 0 and max(values) >= 10 * min(values)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)
