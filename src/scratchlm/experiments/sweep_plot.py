"""A sweep's final validation loss against the swept value: where in the grid is the loss lowest?

One panel per swept key: x is that key's grid values (a log scale for learning rates, evenly spaced labels for
values that are not numbers), one line per combination of the other keys' values (a single line for a
one-key sweep). Only a finished point has a final loss (experiments/runs.py); a diverged point is an x at the
top edge above its value, which is where a learning-rate sweep usually ends; an interrupted point is left out.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scratchlm.experiments.runs import RunRecord, load_run
from scratchlm.experiments.sweep import read_summary

LEARNING_RATE_NAME = re.compile(r"(^|_)lr$")  # optim.lr, optim.min_lr, optim.head_lr, optim.muon_lr, ...
PANEL_WIDTH, PANEL_HEIGHT = 6.0, 4.5  # inches


@dataclass
class SweepResult:
    """One started point of a sweep: its grid values (raw strings, as in sweep.json) and its run."""

    overrides: dict[str, str]
    run: RunRecord


def load_sweep(sweep_dir: Path) -> tuple[dict[str, list[str]], list[SweepResult]]:
    """(grid, started points) of SWEEP; each point's run is read from its own directory."""
    summary = read_summary(sweep_dir)
    results = [SweepResult(point["overrides"], load_run(sweep_dir / point["run_dir"]))
               for point in summary["points"] if point["status"] != "new"]
    return summary["grid"], results


def _numbers(values: list[str]) -> list[float] | None:
    try:
        return [float(v) for v in values]
    except ValueError:
        return None


def _short(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _draw_panel(ax: Any, key: str, grid: dict[str, list[str]], results: list[SweepResult]) -> None:
    numbers = _numbers(grid[key])
    position = dict(zip(grid[key], numbers or range(len(grid[key]))))
    others = [k for k in grid if k != key]
    groups: dict[tuple[str | None, ...], list[SweepResult]] = {}
    for result in results:
        groups.setdefault(tuple(result.overrides.get(k) for k in others), []).append(result)
    for index, (combo, members) in enumerate(groups.items()):
        color = f"C{index % 10}"
        members = sorted(members, key=lambda r: position[r.overrides[key]])
        done = [r for r in members if r.run.status == "finished" and math.isfinite(r.run.final_val_loss)]
        label = ", ".join(f"{_short(k)}={v}" for k, v in zip(others, combo)) or "final validation loss"
        if done:
            ax.plot([position[r.overrides[key]] for r in done], [r.run.final_val_loss for r in done], "o-",
                    color=color, label=label)
        diverged = [position[r.overrides[key]] for r in members if r.run.status == "diverged"]
        if diverged:  # x in data coordinates, y at the top edge of the axes: its loss has no place on the scale
            ax.plot(diverged, [1.0] * len(diverged), "x", color=color, markersize=9, markeredgewidth=2,
                    transform=ax.get_xaxis_transform(), clip_on=False, label=f"{label}: diverged")
    if numbers is None:
        ax.set_xticks(range(len(grid[key])), grid[key])
    elif LEARNING_RATE_NAME.search(_short(key)) and min(numbers) > 0:
        ax.set_xscale("log")
    ax.set(xlabel=key, ylabel="final validation loss", title=f"final validation loss vs {_short(key)}")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=9)


def sweep_figure(grid: dict[str, list[str]], results: list[SweepResult], title: str = "") -> Any:
    """The matplotlib Figure: one panel per key of ``grid``, in grid order."""
    from scratchlm.extras import require

    require("matplotlib", "plot", "scratchlm report").use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(grid), figsize=(PANEL_WIDTH * len(grid), PANEL_HEIGHT), squeeze=False)
    for ax, key in zip(axes[0], grid):
        _draw_panel(ax, key, grid, results)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
