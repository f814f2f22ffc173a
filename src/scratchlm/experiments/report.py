"""Compare runs side by side: a self-contained HTML report and a Markdown twin.

`write_report(run_dirs, out_dir=...)` reads each run directory (experiments/runs.py), draws the learning
curves of all runs overlaid (experiments/curves.py: loss against steps, tokens and wall-clock seconds, learning
rate and gradient norm) and, for a sweep, its final loss against the swept values (experiments/sweep_plot.py),
and tabulates final validation loss, perplexity, the difference to a baseline run, throughput and status,
with each run's config diff against the baseline (only the keys that changed, so an ablation reads as its
one-line diff). The HTML inlines its figures as base64 PNGs and its CSS, so the single file can be mailed or
committed; the Markdown links the same figures written beside it (curves.png, sweep.png).
"""

from __future__ import annotations

import base64
import html
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scratchlm.experiments.curves import plot_curves, png_bytes
from scratchlm.experiments.runs import IGNORED_DIFF_KEYS, RunRecord, config_diff, load_run


@dataclass
class Figure:
    """One image of the report: inlined into the HTML, written beside the Markdown as ``file``."""

    alt: str
    file: str
    png: bytes


@dataclass
class Row:
    """One line of the results table, already computed against the baseline."""

    run: RunRecord
    is_baseline: bool
    delta: float  # final val loss minus the baseline's (nan when either is missing)
    diff: dict[str, tuple[Any, Any]]  # key -> (baseline value, this run's value)


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


def render_markdown(title: str, rows: list[Row], figures: list[Figure]) -> str:
    lines = [f"# {title}", ""] + [f"![{figure.alt}]({figure.file})" for figure in figures] + ["",
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


def render_html(title: str, rows: list[Row], figures: list[Figure]) -> str:
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
    images = "".join(f'<img alt="{esc(f.alt)}" src="data:image/png;base64,{base64.b64encode(f.png).decode()}">\n'
                     for f in figures)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f"<style>{CSS}</style></head><body>\n<h1>{esc(title)}</h1>\n"
            f"{images}"
            f'<h2>Results</h2>\n<p class="note">{esc(NOTE)}</p>\n'
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>\n"
            f"<h2>Config diff vs the baseline</h2>\n{''.join(diffs)}\n</body></html>\n")


def write_report(run_dirs: list[str | Path], *, out_dir: str | Path, baseline: str | Path | None = None,
                 title: str = "scratchlm runs", sweeps: Sequence[str | Path] = ()) -> tuple[Path, Path]:
    """Write OUT/report.html (self-contained), OUT/report.md and OUT/curves.png; returns the two report paths.

    The baseline defaults to the first run; a baseline not among the runs is added to them. Each sweep
    directory in ``sweeps`` adds its final-loss-against-hyperparameter figure (OUT/sweep.png, sweep-2.png, ...).
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
    rows = [Row(run=r, is_baseline=r is base_run, delta=r.final_val_loss - base_run.final_val_loss,
                diff=config_diff(r.config, base_run.config)) for r in runs]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = [Figure("learning curves", "curves.png", plot_curves(runs)), *sweep_figures(sweeps)]
    for figure in figures:
        (out / figure.file).write_bytes(figure.png)
    md_path, html_path = out / "report.md", out / "report.html"
    md_path.write_text(render_markdown(title, rows, figures), encoding="utf-8")
    html_path.write_text(render_html(title, rows, figures), encoding="utf-8")
    return html_path, md_path


def sweep_figures(sweeps: Sequence[str | Path]) -> list[Figure]:
    from scratchlm.experiments.sweep_plot import load_sweep, sweep_figure

    figures = []
    for number, sweep_dir in enumerate(map(Path, sweeps), start=1):
        png = png_bytes(sweep_figure(*load_sweep(sweep_dir), title=f"sweep {sweep_dir.resolve().name}"))
        figures.append(Figure(f"final loss of sweep {sweep_dir.name}", "sweep.png" if number == 1 else
                              f"sweep-{number}.png", png))
    return figures
