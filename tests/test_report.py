"""Run reports: metrics parsing, config diffs, the self-contained HTML + Markdown, and a real browser render.

Run directories are written by hand here (config.toml + metrics.jsonl as in docs/architecture.md) so the tests
do not train anything. The browser test renders the HTML with headless Chromium when it is installed: it is
the "look at it as a person would" check (the PNG it writes is kept under pytest's tmp dir for inspection).
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import shutil
import subprocess
import warnings
from collections.abc import Callable
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from scratchlm.cli import main
from scratchlm.experiments.curves import DYNAMICS_PANELS, TRAINING_PANELS, curves_figure, panel_axes
from scratchlm.experiments.report import write_report
from scratchlm.experiments.runs import RunRecord, config_diff, load_run, read_metrics, run_status
from scratchlm.experiments.sweep import Axis, SweepSpec, summarize, sweep_points, write_summary
from scratchlm.experiments.sweep_plot import load_sweep, sweep_figure

BASE_CONFIG = {"model": {"d_model": 64, "norm": "rmsnorm"}, "optim": {"lr": 1e-3}, "train": {"run_dir": "x"}}


DIVERGED_AT = 45  # a diverged fixture run's first bad step; the trainer notices it at the next log step (50)


def make_run(root: Path, name: str, *, final_loss: float, status: str = "finished", steps: int = 50,
             changes: dict | None = None) -> Path:
    """A run directory like the trainer writes: a decaying loss curve, evals every 10 steps, an end record.

    A diverged run's loss climbs after half of its steps; its records stop before DIVERGED_AT, which its end
    message names, as the trainer's do (it stops before logging the bad step)."""
    run = root / name
    run.mkdir(parents=True)
    config = json.loads(json.dumps(BASE_CONFIG))
    config["train"]["run_dir"] = str(run)
    for dotted, value in (changes or {}).items():
        section, key = dotted.split(".")
        config[section][key] = value
    lines = [f"[{s}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in t.items()) for s, t in config.items()]
    (run / "config.toml").write_text("\n".join(lines))
    records = []
    last_logged = steps if status != "diverged" else DIVERGED_AT - 1
    for step in range(1, last_logged + 1):
        loss = final_loss + 4.0 * math.exp(-step / 10)
        if status == "diverged" and step > steps // 2:
            loss *= step - steps // 2
        records.append({"kind": "train", "step": step, "tokens": step * 256, "wall_time": step * 0.2,
                        "train_time": step * 0.15, "loss": loss, "lr": 1e-3 * min(1.0, step / 20),
                        "grad_norm": 0.5 + 1 / step, "tokens_per_s": 1280.0, "mfu": None})
        if step % 10 == 0 and (status != "diverged" or step <= steps // 2):
            records.append({"kind": "eval", "step": step, "tokens": step * 256, "wall_time": step * 0.2,
                            "val_loss": loss + 0.05, "val_ppl": math.exp(loss + 0.05)})
    message = f"diverged at step {DIVERGED_AT}: loss=inf, grad_norm=nan" if status == "diverged" else ""
    records.append({"kind": "end", "step": steps, "status": status, "message": message})
    text = "\n".join(json.dumps(r) for r in records) + "\n"
    (run / "metrics.jsonl").write_text(text)
    return run


@pytest.fixture
def runs(tmp_path) -> list[Path]:
    return [make_run(tmp_path, "baseline", final_loss=2.0),
            make_run(tmp_path, "no-norm", final_loss=2.3, changes={"model.norm": "none"}),
            make_run(tmp_path, "lr-3e-2", final_loss=2.0, status="diverged", changes={"optim.lr": 3e-2})]


def test_load_run_summarizes_metrics(runs):
    run = load_run(runs[0])
    assert run.status == "finished" and run.steps == 50
    assert run.final_val_loss == pytest.approx(2.05 + 4 * math.exp(-5))
    assert run.tokens_per_s == 1280.0 and run.wall_time == pytest.approx(10.0)
    assert run.config["optim.lr"] == 1e-3


def test_killed_writer_truncated_last_line_is_ignored_but_corruption_elsewhere_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1, "loss": 3.0}\n{"kind": "tra')
    assert [r["step"] for r in read_metrics(path)] == [1]
    assert run_status(tmp_path) == "interrupted"
    path.write_text('{"kind": "train", "step": 1, "loss": 3.0}\nnot json\n'
                    '{"kind": "end", "step": 1, "status": "finished"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: not a JSON object")):
        read_metrics(path)
    path.write_text('[1, 2]\n')
    with pytest.raises(ValueError, match=":1: expected an object with a 'kind' field"):
        read_metrics(path)


@pytest.mark.parametrize(("record", "message"), [
    ({"kind": "eval", "step": 10, "val_ppl": 9.0}, "'eval' record without a 'val_loss' field"),
    ({"kind": "end", "step": 10, "message": ""}, "'end' record without a 'status' field"),
    ({"kind": "train", "loss": 3.0}, "'train' record without a 'step' field"),
    ({"kind": "train", "step": "ten", "loss": 3.0}, "'train' record with an invalid step 'ten'"),
    ({"kind": "eval", "step": 10, "val_loss": None}, "'eval' record with an invalid val_loss None"),
    ({"kind": "end", "step": 10, "status": "done"}, "'end' record with an invalid status 'done'"),
    ({"kind": ["end"], "step": 10}, "expected an object with a 'kind' field"),
])
def test_record_missing_a_required_field_names_the_file_and_line(tmp_path, capsys, record, message):
    run = make_run(tmp_path, "run", final_loss=2.0)
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], json.dumps(record), *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{metrics}:2: {message}")):
        read_metrics(metrics)
    assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 1  # one line, no traceback
    assert f"{metrics}:2: {message}" in capsys.readouterr().err


def test_missing_run_dir_or_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_run(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="metrics.jsonl not found"):
        load_run(tmp_path)


def test_config_diff_lists_only_changed_keys_and_ignores_run_dir():
    base = {"model.norm": "rmsnorm", "optim.lr": 1e-3, "train.run_dir": "a", "model.d_ff": 128}
    run = {"model.norm": "none", "optim.lr": 1e-3, "train.run_dir": "b", "model.tie_embeddings": True}
    assert config_diff(run, base) == {"model.d_ff": (128, "(unset)"), "model.norm": ("rmsnorm", "none"),
                                      "model.tie_embeddings": ("(unset)", True)}
    assert config_diff(base, base) == {}


def test_loss_axis_ignores_the_exploding_tail_of_a_curve():
    from scratchlm.experiments.curves import _loss_limits

    low, high = _loss_limits([[(s, 7.6 - s / 10) for s in range(20)] + [(20, 40.0)], [(s, 7.0) for s in range(5)]])
    assert 5.6 < low < 5.7 and 7.6 < high < 7.8
    assert _loss_limits([[], []]) is None


def test_report_is_self_contained_and_tabulates_deltas_and_divergence(runs, tmp_path):
    html_path, md_path = write_report(runs, out_dir=tmp_path / "out", title="Ablations <test>")
    page = html_path.read_text()
    assert not re.search(r"(src|href)=\"(?!data:)", page)  # every asset is inline
    assert "<title>Ablations &lt;test&gt;</title>" in page
    image = re.search(r'src="data:image/png;base64,([^"]+)"', page)[1]
    assert base64.b64decode(image).startswith(b"\x89PNG")
    assert (tmp_path / "out" / "curves.png").read_bytes() == base64.b64decode(image)
    base_loss, ablated_loss = load_run(runs[0]).final_val_loss, load_run(runs[1]).final_val_loss
    assert f"{ablated_loss - base_loss:+.4f}" == "+0.3000" and "+0.3000" in page
    assert '<td class="diverged">DIVERGED</td>' in page and f"diverged at step {DIVERGED_AT}: loss=inf" in page
    assert "<code>model.norm</code>: <code>&#x27;rmsnorm&#x27;</code> → <code>&#x27;none&#x27;</code>" in page
    assert "train.run_dir" not in page
    assert "<summary>full config</summary>" in page and "<td>model.d_model</td><td>64</td>" in page
    markdown = md_path.read_text()
    assert "![learning curves](curves.png)" in markdown
    assert "| no-norm | finished | 50 |" in markdown
    assert "| lr-3e-2 | **DIVERGED** | 50 | — | — | — | 1280 |" in markdown  # a stale loss is no result
    assert "- **lr-3e-2**: optim.lr: 0.001 → 0.03" in markdown


def test_baseline_outside_the_list_is_added_and_used(runs, tmp_path):
    _, md_path = write_report(runs[1:2], out_dir=tmp_path / "out", baseline=runs[0])
    markdown = md_path.read_text()
    assert "| baseline | finished | 50 |" in markdown and "| baseline |" in markdown.split("\n")[6]
    assert "+0.3000" in markdown


def test_many_runs_cap_the_legend_instead_of_squeezing_the_panels_away():
    from scratchlm.experiments.curves import plot_curves

    def png_height(count: int) -> int:
        runs = [RunRecord(path=Path(f"r{i}"), name=f"run{i}", config={}, end={"step": 3, "status": "finished"},
                          train=[{"step": s, "wall_time": s, "loss": 5 - s / 10} for s in range(1, 4)])
                for i in range(count)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # was: "Tight layout not applied" and a legend over the panels
            png = plot_curves(runs)
        return int.from_bytes(png[20:24], "big")

    assert png_height(4) < png_height(130) == png_height(500)  # the legend grows with the runs, up to a cap


def test_runs_sharing_parent_and_name_get_distinct_labels_and_a_repeated_run_is_refused(tmp_path):
    first = make_run(tmp_path / "a" / "lr", "run", final_loss=2.0)
    second = make_run(tmp_path / "b" / "lr", "run", final_loss=2.1)
    _, md_path = write_report([first, second], out_dir=tmp_path / "out")
    markdown = md_path.read_text()
    assert "| lr/run | finished |" in markdown and "| lr/run #2 | finished |" in markdown
    with pytest.raises(ValueError, match=re.escape(f"run directory {tmp_path / 'a/lr/../lr/run'} is given twice")):
        write_report([first, second, tmp_path / "a/lr/../lr/run"], out_dir=tmp_path / "out")


def make_sweep(root: Path, grid: dict[str, list[str]], final_loss: Callable[[dict[str, str]], float | None]) -> Path:
    """A sweep directory as `scratchlm sweep` leaves it: one fixture run per point, sweep.json by sweep.py.

    ``final_loss(overrides)``: the point's final loss, or None for a point that diverged."""
    sweep_dir = root / "sweep"
    spec = SweepSpec(base_config=root / "base.toml", axes=[Axis(k, tuple(v)) for k, v in grid.items()],
                     out_dir=sweep_dir)
    points = sweep_points(spec.axes)
    for point in points:
        loss = final_loss(dict(point.overrides))
        make_run(sweep_dir, point.name, final_loss=2.0 if loss is None else loss,
                 status="diverged" if loss is None else "finished")
    write_summary(sweep_dir, summarize(spec, points))
    return sweep_dir


def test_report_cli_expands_a_sweep_directory_and_plots_its_final_losses(tmp_path, capsys):
    sweep = make_sweep(tmp_path, {"optim.lr": ["1e-3", "3e-2"]}, lambda o: 2.0 if o["optim.lr"] == "1e-3" else None)
    shutil.rmtree(sweep / "lr-3e-2")  # a point not started yet: status new, left out
    write_summary(sweep, {**json.loads((sweep / "sweep.json").read_text()),
                          "points": [*json.loads((sweep / "sweep.json").read_text())["points"][:1],
                                     {"name": "lr-3e-2", "overrides": {"optim.lr": "3e-2"}, "run_dir": "lr-3e-2",
                                      "status": "new"}]})
    assert main(["report", str(sweep), "--title", "LR sweep"]) == 0
    assert str(sweep / "report" / "report.html") in capsys.readouterr().out
    markdown = (sweep / "report" / "report.md").read_text()
    assert "| lr-1e-3 | finished |" in markdown and "lr-3e-2" not in markdown
    assert "![final loss of sweep sweep](sweep.png)" in markdown
    page = (sweep / "report" / "report.html").read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert [base64.b64decode(i) for i in images] == [(sweep / "report" / name).read_bytes()
                                                     for name in ("curves.png", "sweep.png")]
    assert main(["report", str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err
    for text, problem in [("{not json", "Expecting property name"), ('{"points": []}', "no 'grid' object"),
                          ('{"grid": {}, "points": [{"run_dir": "a", "status": "new"}]}',
                           "point 1 lacks a run_dir, status or overrides")]:
        (sweep / "sweep.json").write_text(text)
        assert main(["report", str(sweep)]) == 1
        assert f"{sweep / 'sweep.json'}: not a sweep summary ({problem}" in capsys.readouterr().err


def test_sweep_plot_points_are_the_runs_final_losses_one_line_per_other_key(tmp_path):
    grid = {"optim.lr": ["1e-3", "1e-2", "1e-1"], "data.batch_size": ["16", "64"]}

    def final_loss(overrides: dict[str, str]) -> float | None:
        lr, batch = float(overrides["optim.lr"]), int(overrides["data.batch_size"])
        return None if (lr, batch) == (1e-1, 64) else 3.0 + (math.log10(lr) + 2) ** 2 - batch / 100

    sweep = make_sweep(tmp_path, grid, final_loss)
    fig = sweep_figure(*load_sweep(sweep))
    by_lr, by_batch = fig.axes
    assert by_lr.get_title() == "final validation loss vs lr" and by_lr.get_xscale() == "log"
    assert by_batch.get_title() == "final validation loss vs batch_size" and by_batch.get_xscale() == "linear"
    lines = {line.get_label(): line for line in by_lr.lines}
    assert set(lines) == {"batch_size=16", "batch_size=64", "batch_size=64: diverged"}
    for batch, lrs in (("16", ["1e-3", "1e-2", "1e-1"]), ("64", ["1e-3", "1e-2"])):
        names = [f"lr-{lr}__batch_size-{batch}" for lr in lrs]
        assert list(lines[f"batch_size={batch}"].get_xdata()) == [float(lr) for lr in lrs]
        assert list(lines[f"batch_size={batch}"].get_ydata()) == [load_run(sweep / n).final_val_loss for n in names]
    assert list(lines["batch_size=64: diverged"].get_xdata()) == [0.1]  # drawn at the top edge, not at a loss
    assert {line.get_label() for line in by_batch.lines} == {"lr=1e-3", "lr=1e-2", "lr=1e-1", "lr=1e-1: diverged"}
    plt.close(fig)


def test_sweep_plot_of_values_that_are_not_numbers_spaces_them_evenly(tmp_path):
    sweep = make_sweep(tmp_path, {"model.norm": ["rmsnorm", "none"]}, lambda o: {"rmsnorm": 2.0, "none": 2.4}[
        o["model.norm"]])
    fig = sweep_figure(*load_sweep(sweep))
    (line,) = fig.axes[0].lines
    assert list(line.get_xdata()) == [0, 1] and list(line.get_ydata()) == pytest.approx([2.0, 2.4], abs=0.1)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["rmsnorm", "none"]
    plt.close(fig)


def test_curves_figure_draws_loss_against_steps_tokens_and_time_and_the_lr_and_grad_norm(runs):
    records = [load_run(r) for r in runs]
    fig = curves_figure(records)
    titles = {ax.get_title() for ax in fig.axes}
    assert titles == {f"{kind} loss vs {x}" for kind in ("validation", "training")
                      for x in ("step", "tokens", "wall-clock time")} | {"learning rate vs step",
                                                                          "gradient norm vs step"}
    baseline = records[0].train
    expected = {("training loss vs tokens", "tokens", "loss"), ("validation loss vs tokens", "tokens", "val_loss"),
                ("training loss vs wall-clock time", "wall_time", "loss"), ("learning rate vs step", "step", "lr"),
                ("gradient norm vs step", "step", "grad_norm")}
    for title, x_key, y_key in expected:
        ax = next(a for a in fig.axes if a.get_title() == title)
        line = next(line for line in ax.lines if line.get_label() == "baseline")
        source = records[0].evals if y_key == "val_loss" else baseline
        assert list(line.get_xdata()) == [r[x_key] for r in source]
        assert list(line.get_ydata()) == [r[y_key] for r in source]
    assert panel_axes(fig, DYNAMICS_PANELS[0]).get_yscale() == "log"  # warm-up: 5e-5 to 1e-3, a decade and more
    assert panel_axes(fig, DYNAMICS_PANELS[1]).get_yscale() == "linear"  # 0.52 to 1.5: log ticks would be noise
    plt.close(fig)


def test_a_diverged_run_stays_on_the_plot_up_to_its_divergence_step(runs):
    diverged = load_run(runs[2])
    assert diverged.divergence == (DIVERGED_AT, math.inf)
    # Diverged before its first log: no train record at all (the case that used to vanish from the plot).
    early = RunRecord(path=Path("early"), name="lr-1", config={}, end={
        "step": 10, "status": "diverged", "message": "diverged at step 6: loss=10.4289, grad_norm=2.25 "
                                                     "(train.max_loss = 10.0)"})
    fig = curves_figure([load_run(runs[0]), diverged, early])
    for panel, divergence_x in zip(TRAINING_PANELS, (DIVERGED_AT, DIVERGED_AT * 256, DIVERGED_AT * 0.2)):
        ax = panel_axes(fig, panel)
        top = ax.get_ylim()[1]
        line = next(line for line in ax.lines if line.get_label() == f"lr-3e-2 (diverged at step {DIVERGED_AT})")
        xs, ys = list(line.get_xdata()), list(line.get_ydata())
        assert xs[-1] == pytest.approx(divergence_x) and ys[-1] == top and all(x < xs[-1] for x in xs[:-1])
        assert len(xs) == DIVERGED_AT  # steps 1..44 as logged, then the divergence
    ax = panel_axes(fig, TRAINING_PANELS[0])
    (line,) = [line for line in ax.lines if line.get_label() == "lr-1 (diverged at step 6)"]
    assert list(line.get_xdata()) == [6] and list(line.get_ydata()) == [ax.get_ylim()[1]]  # 10.43 is off the scale
    assert not [ln for ln in panel_axes(fig, TRAINING_PANELS[1]).lines if ln.get_label().startswith("lr-1 ")]
    plt.close(fig)
    early.end["message"] = "stopped"  # not the trainer's divergence message: the end step, loss unknown
    assert early.divergence[0] == 10 and math.isnan(early.divergence[1])


def test_a_runs_own_curves_png_has_learning_rate_and_gradient_norm_panels(runs, tmp_path, monkeypatch):
    from scratchlm.train.plots import plot_curves

    records = read_metrics(runs[0] / "metrics.jsonl")
    closed = []
    monkeypatch.setattr(plt, "close", closed.append)  # keep the figure plot_curves draws, to look at its axes
    path = plot_curves(records, tmp_path / "curves.png", title="baseline")
    assert path.read_bytes().startswith(b"\x89PNG")
    axes = {ax.get_ylabel(): ax for ax in closed[0].axes}
    train = [r for r in records if r["kind"] == "train"]
    for label, key, scale in (("learning rate", "lr", "log"), ("gradient norm", "grad_norm", "linear")):
        (line,) = axes[label].lines
        assert list(line.get_xdata()) == [r["step"] for r in train]
        assert list(line.get_ydata()) == [r[key] for r in train]
        assert axes[label].get_yscale() == scale
    plt.close(closed[0])


def _chromium() -> str | None:
    return next((p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))), None)


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def test_rendered_report_screenshot(runs, tmp_path):
    """The report as a person sees it: curves drawn and the diverged row in red, in a real browser.

    Skipped on a machine without Chromium, but not in CI (CI set): .ci/run installs it, so there it must run."""
    browser = _chromium()
    if browser is None:
        if _in_ci():
            pytest.fail("CI is set but headless Chromium is not installed (.ci/run installs the Debian package "
                        "chromium); the report's browser check cannot be skipped in CI")
        pytest.skip("headless Chromium not installed (apt-get install chromium) - cannot screenshot the report")
    html_path, _ = write_report(runs, out_dir=tmp_path / "out")
    shot = tmp_path / "out" / "screenshot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1280,1600", f"--screenshot={shot}", html_path.as_uri()],
                   check=True, capture_output=True, timeout=120)
    pixels = (plt.imread(shot)[..., :3] * 255).round().astype(int)  # (1600, 1280, 3)
    assert pixels.shape == (1600, 1280, 3)

    def share(rgb: tuple[int, int, int]) -> float:
        return float((abs(pixels - rgb).max(axis=-1) <= 8).mean())

    assert share((31, 119, 180)) > 1e-4  # matplotlib's C0, the baseline's lines: the figure was drawn
    assert share((253, 232, 232)) > 1e-4  # #fde8e8, the diverged run's row: the table and its CSS were applied
    assert share((255, 255, 255)) < 0.95  # not a blank page


def test_an_eval_after_the_end_record_is_not_the_final_loss(tmp_path):
    run = make_run(tmp_path, "run", final_loss=2.0)
    final = load_run(run).final_val_loss
    with open(run / "metrics.jsonl", "a") as metrics:
        metrics.write(json.dumps({"kind": "eval", "step": 50, "val_loss": 0.001, "val_ppl": 1.001}) + "\n")
    loaded = load_run(run)
    assert loaded.final_val_loss == final and [r["val_loss"] for r in loaded.late_evals] == [0.001]


def test_a_metrics_file_that_lacks_the_start_of_the_run_is_reported_as_such(tmp_path):
    """metrics.jsonl deleted, then the run resumed at step 30: the report must not pass it off as a whole run."""
    run = make_run(tmp_path, "run", final_loss=2.0)
    assert load_run(run).missing_start is None
    metrics = run / "metrics.jsonl"
    kept = [line for line in metrics.read_text().splitlines() if json.loads(line)["step"] > 30]
    metrics.write_text("\n".join(kept) + "\n")
    assert load_run(run).missing_start == 31
    assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 0
    assert "finished (metrics.jsonl starts at step 31)" in (tmp_path / "out" / "report.md").read_text()
