"""The report's learning-curve figure: every run overlaid on the same panels, one legend below them all.

Two rows of loss panels (validation, training) against optimizer steps, tokens seen and wall-clock seconds, and a
row of training dynamics against steps: the learning rate and the gradient norm before clipping (a spike there
usually comes before a loss spike). Values come from metrics.jsonl only (experiments/runs.py). A diverged run's
training-loss line ends with an x at its first bad step, on the top edge when that loss is off the scale.
matplotlib is imported inside the functions: the rest of scratchlm does not need it.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

from scratchlm.experiments.runs import RunRecord
from scratchlm.train.plots import wants_log_scale

LINE_STYLES, COLORS = ("-", "--", "-.", ":"), 10  # run i: color C(i % 10), then the next dash every ten runs
# Past this many runs a line repeats an earlier run's color and dash, so a legend entry could not tell which it is;
# the rest are summed up in one last entry (the table names them all), which also bounds the legend's height.
MAX_LEGEND_ENTRIES = COLORS * len(LINE_STYLES)
LEGEND_COLUMNS = 4
WIDTH, PANELS_HEIGHT, LEGEND_ROW_HEIGHT, LEGEND_PAD = 15.0, 11.0, 0.22, 0.2  # inches


@dataclass(frozen=True)
class Panel:
    source: str  # the RunRecord list the values come from: "evals" or "train"
    y_key: str
    y_label: str
    x_key: str
    x_label: str

    @property
    def title(self) -> str:
        return f"{self.y_label} vs {self.x_label.split(' (')[0]}"


LOSS_X_AXES = (("step", "step"), ("tokens", "tokens"), ("wall_time", "wall-clock time (s)"))
VALIDATION_PANELS = [Panel("evals", "val_loss", "validation loss", x, label) for x, label in LOSS_X_AXES]
TRAINING_PANELS = [Panel("train", "loss", "training loss", x, label) for x, label in LOSS_X_AXES]
DYNAMICS_PANELS = [Panel("train", "lr", "learning rate", "step", "step"),
                   Panel("train", "grad_norm", "gradient norm", "step", "step")]


def _finite(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]


def _series(records: list[dict[str, Any]], x_key: str, y_key: str) -> list[tuple[float, float]]:
    return _finite([(float(r[x_key]), float(r[y_key])) for r in records
                    if r.get(x_key) is not None and r.get(y_key) is not None])


def _loss_limits(all_series: list[list[tuple[float, float]]]) -> tuple[float, float] | None:
    """y-range from the best value up to the highest *starting* loss (of the runs that did not diverge), so a
    diverged run's exploding tail cannot flatten the curves that matter; it is drawn cut off at the top."""
    non_empty = [s for s in all_series if s]
    if not non_empty:
        return None
    low = min(y for s in non_empty for _, y in s)
    high = max(max(y for _, y in s[: max(1, len(s) // 10)]) for s in non_empty)
    pad = 0.04 * max(high - low, 1e-3)
    return low - pad, high + pad


def _x_at_step(run: RunRecord, x_key: str, step: int) -> float | None:
    """``x_key`` at ``step``: the step itself, or scaled by the last record's x per step (tokens per step is
    fixed; seconds per step is the run's average so far, an estimate). None when no record has the value."""
    if x_key == "step":
        return float(step)
    known = [r for r in (*run.train, *run.evals) if r.get(x_key) is not None and r["step"] > 0]
    return float(known[-1][x_key]) / known[-1]["step"] * step if known else None


def divergence_point(run: RunRecord, x_key: str, top: float | None) -> tuple[float, float] | None:
    """Where a diverged run's training-loss line ends: (x at the first bad step, its loss, or ``top`` when the
    loss is above it or not finite); None for a run that did not diverge or where x or y cannot be placed."""
    if run.divergence is None:
        return None
    step, loss = run.divergence
    x = _x_at_step(run, x_key, step)
    y = loss if math.isfinite(loss) and (top is None or loss <= top) else top
    return None if x is None or y is None else (x, y)


def _label(run: RunRecord) -> str:
    return run.name if run.divergence is None else f"{run.name} (diverged at step {run.divergence[0]})"


def _style(index: int) -> dict[str, Any]:
    return {"linestyle": LINE_STYLES[(index // COLORS) % len(LINE_STYLES)], "color": f"C{index % COLORS}"}


def _draw_panel(ax: Any, panel: Panel, runs: list[RunRecord]) -> None:
    """One panel, every run a line. Loss panels are cut to the healthy runs' range (a diverged run's training
    loss ends in an x); learning rate and gradient norm go on a log scale when they span a decade or more."""
    series = [_series(getattr(run, panel.source), panel.x_key, panel.y_key) for run in runs]
    is_loss = panel not in DYNAMICS_PANELS
    healthy = [points for run, points in zip(runs, series) if run.status != "diverged"]
    limits = _loss_limits(healthy if any(healthy) else series) if is_loss else None
    if limits:
        ax.set_ylim(*limits)
    for index, (run, points) in enumerate(zip(runs, series)):
        end = divergence_point(run, panel.x_key, limits[1] if limits else None) if panel in TRAINING_PANELS else None
        if end:
            points = [p for p in points if p[0] < end[0]] + [end]
            # Outside the clip box, so an x on the top edge shows whole; no label: the line carries the legend entry.
            ax.plot(*end, "x", color=_style(index)["color"], markersize=9, markeredgewidth=2, clip_on=False)
        if points:
            ax.plot(*zip(*points), **_style(index), linewidth=1.4, marker="o" if len(points) < 3 else None,
                    label=_label(run))
    if not is_loss and wants_log_scale([y for points in series for _, y in points]):
        ax.set_yscale("log")


def curves_figure(runs: list[RunRecord]) -> Any:
    """The matplotlib Figure: loss panels (3 per row, 2 rows), then learning rate and gradient norm (2 wide)."""
    from scratchlm.extras import require

    require("matplotlib", "plot", "scratchlm report").use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, MaxNLocator

    entries = min(len(runs), MAX_LEGEND_ENTRIES + 1)
    legend_height = LEGEND_ROW_HEIGHT * math.ceil(entries / LEGEND_COLUMNS) + LEGEND_PAD
    fig = plt.figure(figsize=(WIDTH, PANELS_HEIGHT + legend_height))
    grid = fig.add_gridspec(3, 6)  # 6 columns: three loss panels of 2 columns each, two dynamics panels of 3
    placed = [(grid[row, 2 * col:2 * col + 2], panel) for row, panels in enumerate((VALIDATION_PANELS, TRAINING_PANELS))
              for col, panel in enumerate(panels)]
    placed += [(grid[2, 3 * col:3 * col + 3], panel) for col, panel in enumerate(DYNAMICS_PANELS)]
    for cell, panel in placed:
        ax = fig.add_subplot(cell)
        _draw_panel(ax, panel, runs)
        if panel.x_key in ("step", "tokens"):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if panel.x_key == "tokens":
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 1.5M, not 1500000: long labels overlap
        ax.set(xlabel=panel.x_label, ylabel=panel.y_label, title=panel.title)
        ax.grid(True, alpha=0.3)
    _add_legend(fig)
    fig.tight_layout(rect=(0, legend_height / fig.get_figheight(), 1, 1))
    return fig


def panel_axes(fig: Any, panel: Panel) -> Any:
    """The axes of ``panel`` in a figure from ``curves_figure``."""
    return next(ax for ax in fig.axes if ax.get_title() == panel.title)


def _add_legend(fig: Any) -> None:
    """One legend below the panels for all of them; runs past MAX_LEGEND_ENTRIES are counted in a last entry."""
    from matplotlib.lines import Line2D

    handles, labels = panel_axes(fig, TRAINING_PANELS[0]).get_legend_handles_labels()
    if not handles:
        handles, labels = panel_axes(fig, VALIDATION_PANELS[0]).get_legend_handles_labels()
    if not handles:
        return
    if len(handles) > MAX_LEGEND_ENTRIES:
        hidden = len(handles) - MAX_LEGEND_ENTRIES
        handles = [*handles[:MAX_LEGEND_ENTRIES], Line2D([], [], linestyle="none")]
        labels = [*labels[:MAX_LEGEND_ENTRIES], f"... and {hidden} more runs (see the table)"]
    fig.legend(handles, labels, loc="lower center", ncol=min(LEGEND_COLUMNS, len(labels)), frameon=False,
               fontsize=10)


def png_bytes(fig: Any) -> bytes:
    """Render and close ``fig`` (pyplot keeps every open figure alive otherwise)."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def plot_curves(runs: list[RunRecord]) -> bytes:
    """The learning-curve figure of ``runs`` as PNG bytes."""
    return png_bytes(curves_figure(runs))
