"""Read a finished (or half-finished) run directory back: its resolved config and its metrics.jsonl.

Sweeps ask "is this point done?" and reports ask "what happened in this run?"; both only read the files the
trainer writes (docs/architecture.md, "Run directory"), so neither depends on the trainer's code. A run that
was killed has no ``end`` record; a line cut short by the kill (the last line, unterminated) is ignored, but a
malformed line anywhere else is an error naming the file and the line, never silently skipped.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

DONE_STATUSES = ("finished", "diverged")  # a sweep never reruns these
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.toml"
# The end message of a diverged run, as train/step.py (DivergenceWatch.check) writes it: the first bad step and
# its loss. The end record's own step is where the trainer noticed (the next log step), not where it diverged.
_DIVERGED_AT = re.compile(r"diverged at step (\d+): loss=(\S+?),")


@dataclass
class RunRecord:
    """Everything a report needs about one run, in plain Python values."""

    path: Path
    name: str
    config: dict[str, Any]  # flattened: {"optim.lr": 3e-3, "model.norm": "rmsnorm", ...}
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    # Evaluations written after the end record (e.g. an eval appended to a finished run): shown, never "final".
    late_evals: list[dict[str, Any]] = field(default_factory=list)

    @property
    def status(self) -> str:
        """finished | diverged | interrupted (an end record saying so, or none at all: the process died)."""
        return self.end["status"] if self.end else "interrupted"

    @property
    def final_val_loss(self) -> float:
        """The last evaluation's loss; nan when there is none or the run diverged (its last one is stale)."""
        if not self.evals or self.status == "diverged":
            return math.nan
        return float(self.evals[-1]["val_loss"])

    @property
    def final_val_ppl(self) -> float:
        loss = self.final_val_loss
        if math.isnan(loss):
            return math.nan
        ppl = self.evals[-1].get("val_ppl")
        return float(ppl) if ppl is not None else (math.exp(loss) if loss < 700 else math.inf)

    @property
    def tokens_per_s(self) -> float:
        """Median throughput over the logged steps (the first step includes compile/warm-up, the median shrugs)."""
        rates = [float(r["tokens_per_s"]) for r in self.train if r.get("tokens_per_s") is not None]
        return statistics.median(rates) if rates else math.nan

    @property
    def steps(self) -> int:
        candidates = [r["step"] for r in (*self.train, *self.evals)] + ([self.end["step"]] if self.end else [])
        return int(max(candidates)) if candidates else 0

    @property
    def missing_start(self) -> int | None:
        """The first logged step when metrics.jsonl lacks the run's start (deleted, then resumed), else None.

        A complete file logs its first record at step min(log_every, eval_every, last step); the config says
        which (the trainer's defaults when it does not)."""
        steps = [r["step"] for r in (*self.train, *self.evals)]
        if not steps:
            return None
        expected = min(int(self.config.get("train.log_every", 10)), int(self.config.get("train.eval_every", 100)),
                       self.steps)
        return min(steps) if min(steps) > expected else None

    @property
    def divergence(self) -> tuple[int, float] | None:
        """(first bad step, its loss) of a diverged run, else None; (end step, nan) when its message lacks them."""
        if self.status != "diverged":
            return None
        match = _DIVERGED_AT.search(str(self.end.get("message") or ""))
        if match is None:
            return int(self.end["step"]), math.nan
        return int(match[1]), float(match[2])

    @property
    def wall_time(self) -> float:
        times = [float(r["wall_time"]) for r in (*self.train, *self.evals) if r.get("wall_time") is not None]
        return max(times) if times else math.nan


# Keys that differ between any two runs by construction (where each run writes), never an experimental change.
# data.tokenizer_hash: recorded by train (a resolved sweep point has none yet); data.tokenizer: a run's config
# names its own copy (RUN/tokenizer), a resolved sweep point the original (train checks that their hashes agree).
IGNORED_DIFF_KEYS = frozenset({"train.out_dir", "train.run_dir", "train.run_name", "train.name", "data.tokenizer_hash",
                               "data.tokenizer"})
MISSING = "(unset)"


def config_diff(run: dict[str, Any], baseline: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Changed keys only: {"model.norm": ("rmsnorm", "none")}; keys present on one side show as (unset)."""
    keys = sorted((set(run) | set(baseline)) - IGNORED_DIFF_KEYS)
    pairs = {k: (baseline.get(k, MISSING), run.get(k, MISSING)) for k in keys}
    return {k: (old, new) for k, (old, new) in pairs.items() if old != new}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}: the dotted names users type in overrides."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file; a truncated final line (a killed writer) is dropped."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte {raw[error.start]:#04x}): a binary or damaged "
                         f"line") from None
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            is_cut_short = number == len(lines) and not text.endswith("\n")
            if is_cut_short:
                break
            raise ValueError(f"{path}:{number}: not a JSON object ({error.msg}): {line[:80]!r}") from None
        if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
            raise ValueError(f"{path}:{number}: expected an object with a 'kind' field, got {line[:80]!r}")
        if problem := _field_problem(record):
            raise ValueError(f"{path}:{number}: {problem}: {line[:80]!r}")
        records.append(record)
    return records


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_loss(value: Any) -> bool:
    """A number, or the string a non-finite loss is written as ("nan", "inf"): what ``float()`` reads back."""
    if isinstance(value, bool):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _is_status(value: Any) -> bool:
    return value in (*DONE_STATUSES, "interrupted")


# The fields readers index without a default, per kind (the trainer writes all of them; reports and sweeps read
# the rest with .get, so a record missing one of these would otherwise surface as a bare KeyError far away).
REQUIRED_FIELDS: dict[str, dict[str, Callable[[Any], bool]]] = {
    "train": {"step": _is_step, "loss": _is_loss},
    "eval": {"step": _is_step, "val_loss": _is_loss},
    "end": {"step": _is_step, "status": _is_status},
}


def _field_problem(record: dict[str, Any]) -> str | None:
    """What is wrong with a record's required fields (None when nothing is): a record of unknown kind has none."""
    kind = record["kind"]
    for name, is_valid in REQUIRED_FIELDS.get(kind, {}).items():
        if name not in record:
            return f"{kind!r} record without a {name!r} field"
        if not is_valid(record[name]):
            return f"{kind!r} record with an invalid {name} {record[name]!r}"
    return None


def run_status(run_dir: Path) -> str:
    """new (nothing written yet) | finished | diverged | interrupted — what a sweep needs to decide."""
    metrics = Path(run_dir) / METRICS_FILE
    if not metrics.exists():
        return "new"
    ends = [r for r in read_metrics(metrics) if r["kind"] == "end"]
    return ends[-1]["status"] if ends else "interrupted"


def load_run(run_dir: str | Path, name: str | None = None) -> RunRecord:
    """A RunRecord for RUN_DIR; errors name the missing or malformed file."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.exists():
        raise FileNotFoundError(f"{metrics_path} not found: is {run_dir} a run directory written by `scratchlm train`?")
    config_path = run_dir / CONFIG_FILE
    config: dict[str, Any] = {}
    if config_path.exists():
        try:
            config = flatten(tomllib.loads(config_path.read_text(encoding="utf-8")))
        except tomllib.TOMLDecodeError as error:
            raise ValueError(f"{config_path}: invalid TOML ({error})") from None
    record = RunRecord(path=run_dir, name=name or run_dir.resolve().name, config=config)
    for entry in read_metrics(metrics_path):
        if entry["kind"] == "train":
            record.train.append(entry)
        elif entry["kind"] == "eval":
            (record.late_evals if record.end else record.evals).append(entry)
        elif entry["kind"] == "end":
            record.end = entry
    return record
