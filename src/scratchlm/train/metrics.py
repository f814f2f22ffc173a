"""Where a run's numbers go: metrics.jsonl (always), a progress bar (on a terminal), TensorBoard and Weights & Biases
(if asked; the ``[tracking]`` extra). Only rank 0 builds a MetricsLogger, and only at log/eval steps.

metrics.jsonl (schema: docs/architecture.md, "Run directory") gets one flushed line a record, so a killed run loses
at most a half-written last line; it is read back with ``experiments.runs.read_metrics``. A resume cuts it back to
the checkpoint's step (``truncate_records``) and purges later TensorBoard events; RUN/wandb_id makes a resumed run
continue the same W&B run.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from scratchlm.experiments.runs import read_metrics
from scratchlm.extras import require
from scratchlm.write_errors import naming

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_id"

# Dense peak FLOP/s from vendor datasheets, (bf16/fp16 tensor cores, plain fp32), matched against the CUDA device
# name. fp32 runs are measured against the fp32 peak (TF32 is off by default in torch matmuls).
PEAK_FLOPS = {
    "H200": (989e12, 67e12),
    "H100": (989e12, 67e12),  # SXM; the PCIe card is ~25% lower
    "A100": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12),
    "L4": (121e12, 30.3e12),
    "RTX 4090": (165e12, 82.6e12),
    "RTX 3090": (71e12, 35.6e12),
}


class MetricsLogger:
    """Appends records to RUN/metrics.jsonl and mirrors them to a progress bar and, optionally, TensorBoard and
    W&B."""

    def __init__(self, run_dir: Path, *, total_steps: int, start_step: int = 0, quiet: bool = False,
                 wandb_project: str | None = None, wandb_config: dict | None = None,
                 tensorboard: bool = False) -> None:
        # Trackers first: a missing [tracking] package is refused before any file is opened.
        self._wandb = _start_wandb(wandb_project, wandb_config, Path(run_dir)) if wandb_project else None
        self._tensorboard = _start_tensorboard(Path(run_dir), start_step) if tensorboard else None
        self.path = Path(run_dir) / METRICS_FILE
        self.records: list[dict[str, Any]] = read_metrics(self.path) if self.path.exists() else []
        self._file = self.path.open("a", encoding="utf-8")
        interactive = sys.stderr.isatty() and not quiet
        self._echo = not quiet and not interactive  # no terminal: one plain line per log record instead of a bar
        self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                         disable=not interactive)

    def log(self, record: dict[str, Any]) -> None:
        summary = describe(record)  # before _json_safe: a non-finite value is a float here, a string after
        record = {key: _json_safe(value) for key, value in record.items()}
        self.records.append(record)
        line = json.dumps(record) + "\n"
        with naming(self.path, len(line)):
            self._file.write(line)
            self._file.flush()
        if record["kind"] != "end":
            scalars = tracked_scalars(record)
            if self._wandb is not None:
                self._wandb.log(scalars, step=record["step"])
            if self._tensorboard is not None:
                for name, value in scalars.items():
                    self._tensorboard.add_scalar(name, value, global_step=record["step"])
                self._tensorboard.flush()  # a log step is rare: a crashed run keeps everything it logged
        if self._bar.disable:
            if self._echo:
                print(summary, file=sys.stderr, flush=True)
        elif record["kind"] == "end":
            self._bar.write(summary)
        else:
            self._bar.set_postfix_str(summary, refresh=False)

    def advance(self) -> None:
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()


def tracked_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a train/eval record as {"KIND/FIELD": value} (step and None-valued fields left out)."""
    return {f"{record['kind']}/{key}": value for key, value in record.items()
            if key not in ("kind", "step") and isinstance(value, int | float) and not isinstance(value, bool)}


def device_peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak FLOP/s of a known GPU for ``dtype`` ("fp32" | "bf16" | "fp16"), else None (then MFU is not reported)."""
    for key, (half, fp32) in PEAK_FLOPS.items():
        if key in device_name:
            return half if dtype in ("bf16", "fp16") else fp32  # the tensor cores run fp16 as fast as bf16
    return None


def describe(record: dict[str, Any]) -> str:
    """One human line for a record (progress bar postfix or stderr)."""
    step = record["step"]
    if record["kind"] == "train":
        mfu = f" mfu {record['mfu']:.1%}" if record.get("mfu") is not None else ""
        speed = f" {record['tokens_per_s']:,.0f} tok/s" if record.get("tokens_per_s") is not None else ""
        return (f"step {step} loss {record['loss']:.4f} lr {record['lr']:.2e} grad_norm {record['grad_norm']:.3f}"
                f"{speed}{mfu}")
    if record["kind"] == "eval":
        return f"step {step} val_loss {record['val_loss']:.4f} val_ppl {record['val_ppl']:.2f}"
    return f"step {step}: {record['status']}" + (f": {record['message']}" if record.get("message") else "")


def truncate_records(path: Path, last_step: int) -> None:
    """Keep the records up to ``last_step`` (the resumed checkpoint) and drop any ``end`` record, atomically."""
    if not path.exists():
        return
    kept = [r for r in read_metrics(path) if r["kind"] != "end" and r["step"] <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)


def _json_safe(value: Any) -> Any:
    """JSON has no NaN/inf: a diverged loss is written as a string ("nan", "inf") rather than invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _start_wandb(project: str, config: dict | None, run_dir: Path) -> Any:
    """A W&B run; the same one again when RUN/wandb_id holds its id (written before init, so a crash keeps it)."""
    wandb = require("wandb", "tracking", "train.wandb = true")
    id_file = run_dir / WANDB_ID_FILE
    if id_file.is_file():
        run_id = id_file.read_text(encoding="utf-8").strip()
    else:
        run_id = wandb.util.generate_id()
        id_file.write_text(run_id + "\n", encoding="utf-8")
    return wandb.init(project=project, config=config, dir=str(run_dir), name=run_dir.name, id=run_id,
                      resume="allow")


def _start_tensorboard(run_dir: Path, start_step: int) -> Any:
    """A SummaryWriter on RUN/tensorboard/; a resume drops the events logged after the checkpoint it resumes."""
    require("tensorboard", "tracking", "train.tensorboard = true")  # torch.utils.tensorboard imports it
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=start_step + 1 if start_step else None)
