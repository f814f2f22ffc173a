"""Grid sweeps: every combination of a few config overrides, one run directory each, resumable.

`scratchlm sweep --config base.toml --grid optim.lr=1e-4,1e-3 --grid data.batch_size=16,64` trains the cartesian
product of the grids, one point after another, each in a run directory named after its overrides
(``SWEEP/lr-1e-4__batch_size-16``); every point's config is validated before any trains. The sweep's state lives
in the run directories: a point whose metrics.jsonl ends finished or diverged is done, an interrupted one resumes
from its checkpoint, so rerunning the same command continues where it stopped; ``SWEEP/sweep.json`` is rebuilt
from them after every point. A rerun whose settings changed is refused before anything trains (a started point's
config must equal its RUN_DIR/config.toml). ``--shard i/n`` trains points i, i+n, ... (one process per GPU);
every shard writes the whole summary.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scratchlm.experiments.runs import (
    CONFIG_FILE,
    DONE_STATUSES,
    METRICS_FILE,
    config_diff,
    flatten,
    load_run,
    run_status,
)

SUMMARY_FILE = "sweep.json"
_SAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9.+-]")
_TOP_LEVEL_COMMAS = re.compile(r",(?![^()\[\]]*[)\]])")  # commas not inside (...) or [...] (tuple values)


@dataclass(frozen=True)
class Axis:
    """One --grid: a dotted config key and the raw value strings to try (parsed later by config.py)."""

    key: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class SweepPoint:
    name: str  # the run directory's name inside the sweep directory
    overrides: tuple[tuple[str, str], ...]  # ((dotted key, raw value), ...) in grid order

    def override_strings(self) -> list[str]:
        return [f"{key}={value}" for key, value in self.overrides]


@dataclass
class SweepSpec:
    base_config: Path
    axes: list[Axis]
    out_dir: Path
    overrides: list[str] = field(default_factory=list)  # --set, applied to every point before its grid values
    shard: tuple[int, int] = (0, 1)  # (index, count)


def parse_axis(text: str) -> Axis:
    """``"optim.lr=1e-4,3e-4"`` -> Axis("optim.lr", ("1e-4", "3e-4")); tuple values go in brackets."""
    key, sep, raw_values = text.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_]\w*\.[A-Za-z_]\w*", key):
        raise ValueError(f"--grid {text!r} must look like section.key=v1,v2,... e.g. optim.lr=1e-4,3e-4,1e-3")
    values = tuple(v.strip() for v in _TOP_LEVEL_COMMAS.split(raw_values))
    if not values or any(not v for v in values):
        raise ValueError(f"--grid {text!r} has an empty value; separate values with single commas")
    if len(set(values)) != len(values):
        raise ValueError(f"--grid {text!r} repeats a value")
    return Axis(key, values)


def parse_shard(text: str) -> tuple[int, int]:
    """``"1/4"`` -> (1, 4): this process trains points 1, 5, 9, ... (indices are 0-based)."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match or not 0 <= int(match[1]) < int(match[2]):
        raise ValueError(f"--shard {text!r} must be i/n with 0 <= i < n, e.g. 0/2 and 1/2 for two GPUs")
    return int(match[1]), int(match[2])


def _name_part(key: str, value: str, short: bool) -> str:
    label = key.rsplit(".", 1)[1] if short else key
    return f"{label}-{_SAFE_NAME_CHARS.sub('_', value)}"


def sweep_points(axes: list[Axis]) -> list[SweepPoint]:
    """The cartesian product of the axes, first axis varying slowest, each with a unique directory name."""
    if not axes:
        raise ValueError("a sweep needs at least one --grid section.key=v1,v2,...")
    keys = [axis.key for axis in axes]
    if len(set(keys)) != len(keys):
        raise ValueError(f"--grid keys must be distinct, got {keys}")
    short = len({k.rsplit('.', 1)[1] for k in keys}) == len(keys)  # "lr" unless two sections share a key name
    points = []
    for combo in itertools.product(*(axis.values for axis in axes)):
        pairs = tuple(zip(keys, combo))
        points.append(SweepPoint("__".join(_name_part(k, v, short) for k, v in pairs), pairs))
    names = [p.name for p in points]
    if len(set(names)) != len(names):
        raise ValueError(f"grid values map to the same run directory name: {sorted(names)}")
    return points


def point_config(spec: SweepSpec, point: SweepPoint) -> Any:
    """The validated RunConfig of one point: base file, then --set, then the grid values, then its run_dir; a
    model.vocab_size left out is the tokenizer's, as train sets it (so a rerun compares it with the saved one)."""
    from scratchlm.config import load_config
    from scratchlm.errors import UserError
    from scratchlm.train.tokenizer_identity import bind_vocab_size

    chosen = [*spec.overrides, *point.override_strings()]
    if any(item.partition("=")[0].strip() == "train.run_dir" for item in chosen):
        raise ValueError("a sweep names each point's train.run_dir itself (SWEEP/POINT): choose SWEEP with --out")
    overrides = [*chosen, f"train.run_dir={spec.out_dir / point.name}"]
    try:
        return bind_vocab_size(load_config(spec.base_config, overrides))
    except (ValueError, UserError) as error:
        raise ValueError(f"sweep point {point.name}: {error}") from None


def check_unchanged(run_dir: Path, point: SweepPoint, config: Any) -> None:
    """Refuse a started point whose RUN_DIR/config.toml differs from the config this sweep now resolves for it."""
    from scratchlm.config import load_config

    saved_path = run_dir / CONFIG_FILE
    if not saved_path.exists():
        return
    # Both sides as RunConfigs, so defaults, tuples and float spellings compare equal; train.run_dir is ignored.
    diff = config_diff(flatten(config.to_dict()), flatten(load_config(saved_path).to_dict()))
    if diff:
        changes = ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in diff.items())
        raise ValueError(f"sweep point {point.name}: {saved_path} was trained with other settings than this sweep "
                         f"now gives ({changes}); rerun with the original --config and --set to continue that sweep, "
                         f"or choose a new sweep directory with --out")


def summarize(spec: SweepSpec, points: list[SweepPoint]) -> dict[str, Any]:
    """The sweep as read back from disk: each point's status and final validation loss, and the best point."""
    rows = []
    for point in points:
        run_dir = spec.out_dir / point.name
        status = run_status(run_dir)
        row: dict[str, Any] = {"name": point.name, "overrides": dict(point.overrides), "run_dir": point.name,
                               "status": status}
        if status != "new":
            run = load_run(run_dir)
            row.update(steps=run.steps, final_val_loss=_json_float(run.final_val_loss),
                       message=(run.end or {}).get("message"))
        rows.append(row)
    finished = [r for r in rows if r["status"] == "finished" and r.get("final_val_loss") is not None]
    best = min(finished, key=lambda r: r["final_val_loss"])["name"] if finished else None
    return {"base_config": str(spec.base_config), "overrides": spec.overrides,
            "grid": {axis.key: list(axis.values) for axis in spec.axes}, "best": best, "points": rows}


def _json_float(value: float) -> float | None:
    return value if value == value and abs(value) != float("inf") else None  # JSON has no NaN/inf


def write_summary(out_dir: Path, summary: dict[str, Any]) -> Path:
    """Atomically replace SWEEP/sweep.json (shards may write at the same time; the last complete one wins)."""
    path = out_dir / SUMMARY_FILE
    with tempfile.NamedTemporaryFile("w", dir=out_dir, prefix=".sweep-", suffix=".json", delete=False) as handle:
        json.dump(summary, handle, indent=2)
        handle.write("\n")
    os.replace(handle.name, path)
    return path


def is_sweep_dir(path: Path) -> bool:
    """A sweep directory holds sweep.json and is not a run directory itself."""
    return (path / SUMMARY_FILE).is_file() and not (path / METRICS_FILE).exists()


def read_summary(sweep_dir: Path) -> dict[str, Any]:
    """SWEEP/sweep.json as ``write_summary`` wrote it; anything else is an error naming the file."""
    path = sweep_dir / SUMMARY_FILE
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
        problem = _summary_problem(summary)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        problem = str(error)
    if problem:
        raise ValueError(f"{path}: not a sweep summary ({problem})")
    return summary


def _summary_problem(summary: Any) -> str | None:
    """What a report needs of sweep.json and is missing (None when nothing is)."""
    if not isinstance(summary, dict) or not isinstance(summary.get("grid"), dict):
        return "no 'grid' object"
    if not isinstance(summary.get("points"), list):
        return "no 'points' list"
    for number, point in enumerate(summary["points"], start=1):
        if not (isinstance(point, dict) and isinstance(point.get("run_dir"), str)
                and isinstance(point.get("status"), str) and isinstance(point.get("overrides"), dict)):
            return f"point {number} lacks a run_dir, status or overrides"
    return None


def _has_checkpoint(run_dir: Path) -> bool:
    checkpoints = run_dir / "checkpoints"
    return checkpoints.is_dir() and any(checkpoints.iterdir())


def run_sweep(spec: SweepSpec, *, train_fn: Callable[..., Any] | None = None, quiet: bool = False,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train this shard's points that are not done yet; returns (and writes) the summary of the whole sweep.

    ``train_fn(config, resume=..., quiet=...)`` defaults to scratchlm.train.trainer.train.
    """
    points = sweep_points(spec.axes)
    configs = {p.name: point_config(spec, p) for p in points}  # every mistake surfaces before any training
    if train_fn is None:
        from scratchlm.train.trainer import train as train_fn
    index, count = spec.shard
    mine = points[index::count]
    for point in mine:  # only this shard's: another shard may be writing its points' config.toml right now
        if run_status(spec.out_dir / point.name) != "new":
            check_unchanged(spec.out_dir / point.name, point, configs[point.name])
    spec.out_dir.mkdir(parents=True, exist_ok=True)
    for number, point in enumerate(mine, start=1):
        run_dir = spec.out_dir / point.name
        status = run_status(run_dir)
        if status in DONE_STATUSES:
            log(f"[{number}/{len(mine)}] {point.name}: already {status}, skipped")
            continue
        resume = status == "interrupted" and _has_checkpoint(run_dir)
        log(f"[{number}/{len(mine)}] {point.name}: {'resuming' if resume else 'training'} "
            f"({', '.join(point.override_strings())})")
        train_fn(configs[point.name], resume=resume, quiet=quiet)
        write_summary(spec.out_dir, summarize(spec, points))
        if run_status(run_dir) not in DONE_STATUSES:  # the trainer stopped early (Ctrl-C): so does the sweep
            log(f"{point.name} was interrupted; rerun the same command to resume the sweep")
            break
    summary = summarize(spec, points)
    write_summary(spec.out_dir, summary)
    return summary
