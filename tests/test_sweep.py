"""Grid sweeps: grid parsing, point names, sharding, divergence records and resuming an interrupted sweep.

A fake trainer stands in for scratchlm.train.trainer.train: it writes the run directory files the real one
writes (config.toml, metrics.jsonl, checkpoints/) so the sweep logic is tested in milliseconds.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from scratchlm.cli import main
from scratchlm.experiments.runs import run_status
from scratchlm.experiments.sweep import Axis, SweepSpec, parse_axis, parse_shard, run_sweep, sweep_points


def write_base(folder: Path) -> Path:
    path = folder / "base.toml"
    path.write_text('[model]\npreset = "tiny"\n[optim]\nwarmup_iters = 2\n[train]\nmax_steps = 5\n')
    return path


class FakeTrainer:
    """Writes a run like the trainer: lr >= 1e-2 diverges; `interrupt_at` simulates Ctrl-C mid-run."""

    def __init__(self, interrupt_at: str | None = None):
        self.calls: list[tuple[str, bool]] = []
        self.interrupt_at = interrupt_at

    def __call__(self, config, *, resume: bool = False, quiet: bool = False):
        run_dir = Path(config.train.run_dir)
        self.calls.append((run_dir.name, resume))
        run_dir.mkdir(parents=True, exist_ok=True)
        config.save_toml(run_dir / "config.toml")
        (run_dir / "checkpoints" / "step_0000002").mkdir(parents=True, exist_ok=True)
        records = [{"kind": "train", "step": 1, "tokens": 64, "wall_time": 0.1, "loss": 5.0, "lr": config.optim.lr,
                    "grad_norm": 1.0, "tokens_per_s": 640.0, "mfu": None}]
        if run_dir.name == self.interrupt_at:
            self.interrupt_at = None
            records.append({"kind": "end", "step": 2, "status": "interrupted", "message": "Ctrl-C"})
        elif config.optim.lr >= 1e-2:
            records.append({"kind": "end", "step": 2, "status": "diverged", "message": "loss is nan at step 2"})
        else:
            loss = 4.0 + abs(config.optim.lr - 1e-3) * 100
            records += [{"kind": "eval", "step": 5, "tokens": 320, "wall_time": 0.5, "val_loss": loss, "val_ppl": 1.0},
                        {"kind": "end", "step": 5, "status": "finished", "message": ""}]
        with (run_dir / "metrics.jsonl").open("a") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in records)


def spec_for(tmp_path: Path, *grids: str, shard=(0, 1)) -> SweepSpec:
    return SweepSpec(base_config=write_base(tmp_path), axes=[parse_axis(g) for g in grids],
                     out_dir=tmp_path / "sweep", shard=shard)


def test_parse_axis_splits_values_but_not_inside_brackets():
    assert parse_axis("optim.lr=1e-4, 3e-4,1e-3") == Axis("optim.lr", ("1e-4", "3e-4", "1e-3"))
    assert parse_axis("optim.betas=(0.9,0.95),(0.9,0.99)").values == ("(0.9,0.95)", "(0.9,0.99)")


@pytest.mark.parametrize("bad", ["optim.lr", "lr=1,2", "optim.lr=", "optim.lr=1,,2", "optim.lr=1,1", "a.b.c=1"])
def test_parse_axis_rejects_bad_syntax_naming_the_grid(bad):
    with pytest.raises(ValueError, match="--grid"):
        parse_axis(bad)


def test_points_are_the_cartesian_product_with_readable_unique_names():
    points = sweep_points([parse_axis("optim.lr=1e-3,3e-3"), parse_axis("data.batch_size=8,16,32")])
    assert len(points) == 6
    assert points[0].name == "lr-1e-3__batch_size-8"
    assert points[-1].override_strings() == ["optim.lr=3e-3", "data.batch_size=32"]
    clashing = sweep_points([parse_axis("optim.eps=1e-8"), parse_axis("model.norm_eps=1e-5,1e-6")])
    assert len({p.name for p in clashing}) == 2
    with pytest.raises(ValueError, match="same run directory name"):
        sweep_points([parse_axis("model.norm=a b,a_b")])


@pytest.mark.parametrize("text,expected", [("0/1", (0, 1)), ("3/4", (3, 4)), (" 1 / 2 ", (1, 2))])
def test_parse_shard(text, expected):
    assert parse_shard(text) == expected


@pytest.mark.parametrize("bad", ["2/2", "1", "-1/2", "a/b", "0/0"])
def test_parse_shard_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="--shard"):
        parse_shard(bad)


def test_sweep_trains_every_point_and_records_divergence(tmp_path):
    trainer = FakeTrainer()
    summary = run_sweep(spec_for(tmp_path, "optim.lr=1e-4,1e-3,3e-2"), train_fn=trainer, log=lambda _: None)
    assert [name for name, _ in trainer.calls] == ["lr-1e-4", "lr-1e-3", "lr-3e-2"]
    statuses = {p["name"]: p["status"] for p in summary["points"]}
    assert statuses == {"lr-1e-4": "finished", "lr-1e-3": "finished", "lr-3e-2": "diverged"}
    assert summary["best"] == "lr-1e-3"
    on_disk = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert on_disk == summary
    diverged = on_disk["points"][2]
    assert diverged["final_val_loss"] is None and "nan" in diverged["message"]
    written = (tmp_path / "sweep" / "lr-1e-3" / "config.toml").read_text()  # in the point's train.run_dir
    assert "lr = 0.001" in written


def test_rerun_resumes_interrupted_point_and_skips_done_ones(tmp_path):
    spec = spec_for(tmp_path, "optim.lr=1e-4,1e-3,3e-2")
    first = FakeTrainer(interrupt_at="lr-1e-3")
    run_sweep(spec, train_fn=first, log=lambda _: None)
    assert first.calls == [("lr-1e-4", False), ("lr-1e-3", False)]  # the sweep stops when a point is interrupted
    assert run_status(spec.out_dir / "lr-1e-3") == "interrupted"
    second = FakeTrainer()
    summary = run_sweep(spec, train_fn=second, log=lambda _: None)
    assert second.calls == [("lr-1e-3", True), ("lr-3e-2", False)]
    assert [p["status"] for p in summary["points"]] == ["finished", "finished", "diverged"]
    third = FakeTrainer()
    run_sweep(spec, train_fn=third, log=lambda _: None)
    assert third.calls == []


def test_rerun_with_other_settings_is_refused_naming_the_changed_key(tmp_path):
    spec = spec_for(tmp_path, "optim.lr=1e-4,1e-3")
    run_sweep(spec, train_fn=FakeTrainer(interrupt_at="lr-1e-3"), log=lambda _: None)
    summary_before = (spec.out_dir / "sweep.json").read_text()
    trainer = FakeTrainer()
    with pytest.raises(ValueError, match=r"sweep point lr-1e-4: .*lr-1e-4/config.toml was trained with other "
                                         r"settings .*\(train.max_steps: 5 -> 7\).*new sweep directory with --out"):
        run_sweep(dataclasses.replace(spec, overrides=["train.max_steps=7"]), train_fn=trainer, log=lambda _: None)
    spec.base_config.write_text(spec.base_config.read_text() + "seed = 3\n")  # an edited base config: the same
    with pytest.raises(ValueError, match=r"sweep point lr-1e-4: .*\(train.seed: 0 -> 3\)"):
        run_sweep(spec, train_fn=trainer, log=lambda _: None)
    assert trainer.calls == [] and (spec.out_dir / "sweep.json").read_text() == summary_before
    spec.base_config.write_text(spec.base_config.read_text().replace("seed = 3\n", ""))
    run_sweep(spec, train_fn=trainer, log=lambda _: None)  # the original settings still resume the sweep
    assert trainer.calls == [("lr-1e-3", True)]


def test_shards_partition_the_points(tmp_path):
    grids = ("optim.lr=1e-4,3e-4,1e-3", "data.batch_size=8,16")
    seen = []
    for index in range(2):
        trainer = FakeTrainer()
        summary = run_sweep(spec_for(tmp_path, *grids, shard=(index, 2)), train_fn=trainer, log=lambda _: None)
        seen.append({name for name, _ in trainer.calls})
    assert seen[0].isdisjoint(seen[1]) and len(seen[0] | seen[1]) == 6
    assert all(p["status"] == "finished" for p in summary["points"])  # the last shard's summary sees all points


def test_unknown_key_or_bad_value_fails_before_any_training(tmp_path):
    trainer = FakeTrainer()
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['lrr'\]"):
        run_sweep(spec_for(tmp_path, "optim.lrr=1e-3"), train_fn=trainer)
    with pytest.raises(ValueError, match=r"sweep point lr-fast: .*optim.lr='fast': expected float"):
        run_sweep(spec_for(tmp_path, "optim.lr=1e-3,fast"), train_fn=trainer)
    with pytest.raises(ValueError, match="names each point's train.run_dir itself"):
        run_sweep(spec_for(tmp_path, "train.run_dir=a,b"), train_fn=trainer)
    assert trainer.calls == []


def test_cli_reports_bad_grid_as_one_line(tmp_path, capsys):
    code = main(["sweep", "--config", str(write_base(tmp_path)), "--grid", "optim.lr"])
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("scratchlm sweep: error: --grid 'optim.lr' must look like") and "\n" not in err
    code = main(["sweep", "--config", str(tmp_path / "missing.toml"), "--grid", "optim.lr=1e-3"])
    assert code == 1 and "config file not found" in capsys.readouterr().err


ABLATIONS = {"no-rmsnorm": {"model.norm": ("rmsnorm", "none")},
             "post-norm": {"model.norm_position": ("pre", "post")},
             "nope": {"model.position": ("rope", "nope")},
             "silu-ffn": {"model.ffn": ("swiglu", "silu"), "model.d_ff": (384, 512)},
             "tied-embeddings": {"model.tie_embeddings": (False, True)}}


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_ablation_presets_are_small_diffs_of_the_base(name):
    from scratchlm.config import load_config
    from scratchlm.experiments.runs import config_diff, flatten

    configs = Path(__file__).resolve().parents[1] / "configs"
    base = flatten(load_config(configs / "tinystories-cpu.toml").to_dict())
    ablated = load_config(configs / "ablations" / f"{name}.toml")
    assert config_diff(flatten(ablated.to_dict()), base) == ABLATIONS[name]
    assert ablated.train.run_dir == f"runs/ablation-{name}"
