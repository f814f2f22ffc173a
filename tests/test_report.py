"""Run reports: metrics parsing, config diffs, the self-contained HTML + Markdown, and a real browser render.

Run directories are written by hand here (config.toml + metrics.jsonl as in docs/architecture.md) so the tests
do not train anything. The browser test renders the HTML with headless Chromium when it is installed: it is
the "look at it as a person would" check (the PNG it writes is kept under pytest's tmp dir for inspection).
"""

from __future__ import annotations

import base64
import json
import math
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

from scratchlm.cli import main
from scratchlm.experiments.report import config_diff, write_report
from scratchlm.experiments.runs import load_run, read_metrics, run_status

BASE_CONFIG = {"model": {"d_model": 64, "norm": "rmsnorm"}, "optim": {"lr": 1e-3}, "train": {"run_dir": "x"}}


def make_run(root: Path, name: str, *, final_loss: float, status: str = "finished", steps: int = 50,
             changes: dict | None = None) -> Path:
    """A run directory like the trainer writes: a decaying loss curve, evals every 10 steps, an end record."""
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
    for step in range(1, steps + 1):
        loss = final_loss + 4.0 * math.exp(-step / 10)
        if status == "diverged" and step > steps // 2:
            loss = float("inf") if step == steps else loss * (step - steps // 2)
        records.append({"kind": "train", "step": step, "tokens": step * 256, "wall_time": step * 0.2, "loss": loss,
                        "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1280.0, "mfu": None})
        if step % 10 == 0 and (status != "diverged" or step <= steps // 2):
            records.append({"kind": "eval", "step": step, "tokens": step * 256, "wall_time": step * 0.2,
                            "val_loss": loss + 0.05, "val_ppl": math.exp(loss + 0.05)})
    message = "non-finite loss at step 50" if status == "diverged" else ""
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
    from scratchlm.experiments.report import _loss_limits

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
    assert '<td class="diverged">DIVERGED</td>' in page and "non-finite loss at step 50" in page
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
    from scratchlm.experiments.report import plot_curves
    from scratchlm.experiments.runs import RunRecord

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


def test_report_cli_expands_a_sweep_directory(runs, tmp_path, capsys):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for run in runs:
        shutil.move(run, sweep / run.name)
    points = [{"name": r.name, "run_dir": r.name, "status": "finished"} for r in runs]
    points.append({"name": "never-started", "run_dir": "never-started", "status": "new"})
    (sweep / "sweep.json").write_text(json.dumps({"points": points}))
    assert main(["report", str(sweep), "--title", "LR sweep"]) == 0
    assert str(sweep / "report" / "report.html") in capsys.readouterr().out
    assert "| lr-3e-2 | **DIVERGED** |" in (sweep / "report" / "report.md").read_text()
    assert main(["report", str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err
    (sweep / "sweep.json").write_text("{not json")
    assert main(["report", str(sweep)]) == 1
    assert f"{sweep / 'sweep.json'}: not a sweep summary" in capsys.readouterr().err


def _chromium() -> str | None:
    return next((p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))), None)


def test_rendered_report_screenshot(runs, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("headless Chromium not installed (apt-get install chromium) - cannot screenshot the report")
    html_path, _ = write_report(runs, out_dir=tmp_path / "out")
    shot = tmp_path / "out" / "screenshot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1280,1600", f"--screenshot={shot}", html_path.as_uri()],
                   check=True, capture_output=True, timeout=60)
    data = shot.read_bytes()
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert data.startswith(b"\x89PNG") and (width, height) == (1280, 1600)
    assert len(data) > 50_000  # a blank page compresses to a few KB; curves and a table do not


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
