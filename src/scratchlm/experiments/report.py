"""Compare runs side by side: a self-contained HTML report and a Markdown twin.

`write_report(run_dirs, out_dir=...)` reads each run directory (experiments/runs.py), draws the learning
curves of all runs overlaid (validation and training loss, against steps and against wall-clock seconds),
and tabulates final validation loss, perplexity, the difference to a baseline run, throughput and status,
with each run's config diff against the baseline (only the keys that changed, so an ablation reads as its
one-line diff). The HTML inlines its figure as a base64 PNG and its CSS, so the single file can be mailed or
committed; the Markdown links the same figure written beside it as curves.png.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scratchlm.experiments.runs import RunRecord, load_run

# Keys that differ between any two runs by construction (where each run writes), never an experimental change.
# data.tokenizer_hash: recorded by train (a resolved sweep point has none yet); data.tokenizer shows a change.
IGNORED_DIFF_KEYS = frozenset({"train.out_dir", "train.run_dir", "train.run_name", "train.name", "data.tokenizer_hash"})
MISSING = "(unset)"
LINE_STYLES, COLORS = ("-", "--", "-.", ":"), 10  # run i: color C(i % 10), then the next dash every ten runs
# Past this many runs a line repeats an earlier run's color and dash, so a legend entry could not tell which it is;
# the rest are summed up in one last entry (the table names them all), which also bounds the legend's height.
MAX_LEGEND_ENTRIES = COLORS * len(LINE_STYLES)
LEGEND_COLUMNS = 4
PANELS_HEIGHT, LEGEND_ROW_HEIGHT, LEGEND_PAD = 8.0, 0.22, 0.2  # inches


@dataclass
class Row:
    """One line of the results table, already computed against the baseline."""

    run: RunRecord
    is_baseline: bool
    delta: float  # final val loss minus the baseline's (nan when either is missing)
    diff: dict[str, tuple[Any, Any]]  # key -> (baseline value, this run's value)


def config_diff(run: dict[str, Any], baseline: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Changed keys only: {"model.norm": ("rmsnorm", "none")}; keys present on one side show as (unset)."""
    keys = sorted((set(run) | set(baseline)) - IGNORED_DIFF_KEYS)
    pairs = {k: (baseline.get(k, MISSING), run.get(k, MISSING)) for k in keys}
    return {k: (old, new) for k, (old, new) in pairs.items() if old != new}


def unique_names(paths: list[Path]) -> list[str]:
    """Short run labels: the directory name, or parent/name where two runs share a directory name, numbered
    ("name #2") where even that repeats (runs/a/x/run and runs/b/x/run)."""
    resolved = [p.resolve() for p in paths]
    names = [p.name for p in resolved]
    if len(set(names)) < len(names):
        names = [f"{p.parent.name}/{p.name}" for p in resolved]
    seen: Counter[str] = Counter()
    labels = []
    for name in names:
        seen[name] += 1
        labels.append(name if seen[name] == 1 else f"{name} #{seen[name]}")
    return labels


def build_rows(runs: list[RunRecord], baseline: RunRecord) -> list[Row]:
    return [Row(run=r, is_baseline=r is baseline, delta=r.final_val_loss - baseline.final_val_loss,
                diff=config_diff(r.config, baseline.config)) for r in runs]


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


def plot_curves(runs: list[RunRecord]) -> bytes:
    """A 2x2 PNG: (validation, training) loss x (steps, wall-clock seconds), all runs overlaid, one legend."""
    from scratchlm.extras import require

    require("matplotlib", "plot", "scratchlm report").use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [("evals", "val_loss", "validation loss"), ("train", "loss", "training loss")]
    axes_x = [("step", "step"), ("wall_time", "wall-clock time (s)")]
    entries = min(len(runs), MAX_LEGEND_ENTRIES + 1)
    legend_height = LEGEND_ROW_HEIGHT * math.ceil(entries / LEGEND_COLUMNS) + LEGEND_PAD
    fig, axes = plt.subplots(2, 2, figsize=(12, PANELS_HEIGHT + legend_height), squeeze=False)
    for row, (source, y_key, y_label) in enumerate(panels):
        for col, (x_key, x_label) in enumerate(axes_x):
            ax = axes[row][col]
            series = [_series(getattr(run, source), x_key, y_key) for run in runs]
            for index, (run, points) in enumerate(zip(runs, series)):
                if points:
                    label = run.name + (" (diverged)" if run.status == "diverged" else "")
                    style = LINE_STYLES[(index // COLORS) % len(LINE_STYLES)]
                    ax.plot(*zip(*points), style, color=f"C{index % COLORS}", linewidth=1.4,
                            marker="o" if len(points) < 3 else None, label=label)
            healthy = [points for run, points in zip(runs, series) if run.status != "diverged"]
            if limits := _loss_limits(healthy if any(healthy) else series):
                ax.set_ylim(*limits)
            if x_key == "step":
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel(x_label)
            ax.set_ylabel(y_label)
            ax.set_title(f"{y_label} vs {x_label.split(' (')[0]}")
            ax.grid(True, alpha=0.3)
    _add_legend(fig, axes)
    fig.tight_layout(rect=(0, legend_height / fig.get_figheight(), 1, 1))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def _add_legend(fig: Any, axes: Any) -> None:
    """One legend below the panels for all of them; runs past MAX_LEGEND_ENTRIES are counted in a last entry."""
    from matplotlib.lines import Line2D

    handles, labels = axes[1][0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes[0][0].get_legend_handles_labels()
    if not handles:
        return
    if len(handles) > MAX_LEGEND_ENTRIES:
        hidden = len(handles) - MAX_LEGEND_ENTRIES
        handles = [*handles[:MAX_LEGEND_ENTRIES], Line2D([], [], linestyle="none")]
        labels = [*labels[:MAX_LEGEND_ENTRIES], f"... and {hidden} more runs (see the table)"]
    fig.legend(handles, labels, loc="lower center", ncol=min(LEGEND_COLUMNS, len(labels)), frameon=False,
               fontsize=10)


def _num(value: float, digits: int) -> str:
    return f"{value:.{digits}f}" if math.isfinite(value) else "—"


def _delta(row: Row) -> str:
    if row.is_baseline:
        return "baseline"
    return f"{row.delta:+.4f}" if math.isfinite(row.delta) else "—"


def _status(run: RunRecord) -> str:
    status = "DIVERGED" if run.status == "diverged" else run.status
    return status if run.missing_start is None else f"{status} (metrics.jsonl starts at step {run.missing_start})"


def _diff_text(diff: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k}: {base!r} → {new!r}" for k, (base, new) in diff.items())


def _cells(row: Row) -> list[str]:
    run = row.run
    return [run.name, _status(run), str(run.steps), _num(run.final_val_loss, 4), _num(run.final_val_ppl, 2),
            _delta(row), _num(run.tokens_per_s, 0), _num(run.wall_time, 1)]


NOTE = ("Final val loss: the last evaluation before the run's end record (none for a diverged run). Δ vs baseline: "
        "final val loss minus the baseline's (negative is better). tokens/s: median over logged steps.")
HEADER = ["run", "status", "steps", "final val loss", "val ppl", "Δ vs baseline", "tokens/s", "wall time (s)"]


def render_markdown(title: str, rows: list[Row], figure_name: str) -> str:
    lines = [f"# {title}", "", f"![learning curves]({figure_name})", "",
             "| " + " | ".join(HEADER) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(HEADER) - 2)) + "|"]
    for row in rows:
        cells = [c.replace("|", "\\|") for c in _cells(row)]
        if row.run.status == "diverged":
            cells[1] = f"**{cells[1]}**"
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", NOTE, "", "## Config diff vs the baseline", ""]
    for row in rows:
        config_file = row.run.path / "config.toml"
        text = f"baseline (full config: `{config_file}`)" if row.is_baseline else (_diff_text(row.diff) or "no changes")
        lines.append(f"- **{row.run.name}**: {text}")
        if row.run.end and row.run.end.get("message"):
            lines.append(f"  - end: {row.run.end['message']}")
    return "\n".join(lines) + "\n"


CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1200px;
       color: #222; padding: 0 1em; }
table { border-collapse: collapse; margin: 1em 0; font-size: 14px; }
th, td { border: 1px solid #ccc; padding: 4px 10px; text-align: right; }
th { background: #f0f0f0; } td:first-child, td:nth-child(2), th:first-child, th:nth-child(2) { text-align: left; }
p.note { color: #555; font-size: 14px; }
tr.diverged td { background: #fde8e8; } td.diverged { color: #b00; font-weight: bold; }
tr.baseline td { background: #eef5ff; }
details table td { text-align: left; padding: 1px 8px; } summary { cursor: pointer; color: #555; }
img { max-width: 100%; } code { background: #f4f4f4; padding: 1px 4px; font-size: 13px; }
"""


def render_html(title: str, rows: list[Row], png: bytes) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in HEADER)
    body = []
    for row in rows:
        cells = _cells(row)
        css = "diverged" if row.run.status == "diverged" else ("baseline" if row.is_baseline else "")
        tds = "".join(f'<td class="diverged">{esc(c)}</td>' if i == 1 and css == "diverged" else f"<td>{esc(c)}</td>"
                      for i, c in enumerate(cells))
        body.append(f'<tr class="{css}">{tds}</tr>')
    diffs = []
    for row in rows:
        if row.is_baseline:
            settings = "".join(f"<tr><td>{esc(k)}</td><td>{esc(repr(v))}</td></tr>" for k, v in row.run.config.items()
                               if k not in IGNORED_DIFF_KEYS)
            items = f"<li>baseline<details><summary>full config</summary><table>{settings}</table></details></li>"
        else:
            items = "".join(f"<li><code>{esc(k)}</code>: <code>{esc(repr(a))}</code> → <code>{esc(repr(b))}</code></li>"
                            for k, (a, b) in row.diff.items()) or "<li>no changes</li>"
        message = row.run.end.get("message") if row.run.end else None
        note = f"<li>end: {esc(str(message))}</li>" if message else ""
        diffs.append(f"<h3>{esc(row.run.name)}</h3><ul>{items}{note}</ul>")
    image = base64.b64encode(png).decode("ascii")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f"<style>{CSS}</style></head><body>\n<h1>{esc(title)}</h1>\n"
            f'<img alt="learning curves" src="data:image/png;base64,{image}">\n'
            f'<h2>Results</h2>\n<p class="note">{esc(NOTE)}</p>\n'
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>\n"
            f"<h2>Config diff vs the baseline</h2>\n{''.join(diffs)}\n</body></html>\n")


def write_report(run_dirs: list[str | Path], *, out_dir: str | Path, baseline: str | Path | None = None,
                 title: str = "scratchlm runs") -> tuple[Path, Path]:
    """Write OUT/report.html (self-contained), OUT/report.md and OUT/curves.png; returns the two report paths.

    The baseline defaults to the first run; a baseline not among the runs is added to them.
    """
    if not run_dirs:
        raise ValueError("no run directories given to report on")
    paths = [Path(p) for p in run_dirs]
    resolved = [p.resolve() for p in paths]
    for index, path in enumerate(resolved):
        if path in resolved[:index]:  # its curves would be drawn twice, under two labels
            raise ValueError(f"run directory {paths[index]} is given twice (also as {paths[resolved.index(path)]})")
    if baseline is not None and Path(baseline).resolve() not in resolved:
        paths.insert(0, Path(baseline))
    runs = [load_run(p, name) for p, name in zip(paths, unique_names(paths))]
    base_path = Path(baseline).resolve() if baseline is not None else paths[0].resolve()
    base_run = next(r for r in runs if r.path.resolve() == base_path)
    rows = build_rows(runs, base_run)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = plot_curves(runs)
    (out / "curves.png").write_bytes(png)
    md_path, html_path = out / "report.md", out / "report.html"
    md_path.write_text(render_markdown(title, rows, "curves.png"), encoding="utf-8")
    html_path.write_text(render_html(title, rows, png), encoding="utf-8")
    return html_path, md_path
