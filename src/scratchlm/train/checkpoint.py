"""Checkpoint files: the CS336 single-file form, and the trainer's atomic, verifiable, resumable checkpoints.
What goes into them and back is checkpoint_state.py.

CS336 form: ``save_checkpoint`` / ``load_checkpoint`` put model + optimizer state dicts and the iteration in one
``torch.save`` file (a path or a binary file object), as the assignment specifies.

Trainer form (``CheckpointManager``), one directory per step, no pickle anywhere::

    RUN/checkpoints/step_0000100/
      model.safetensors      weights of the unwrapped module; tied tensors stored once (aliases in metadata)
      optimizer.safetensors  every tensor of the optimizer state, keyed "{param index}.{name}"
      optimizer.json         the rest of the optimizer state: param_groups and non-tensor per-param values
      config.json            the resolved RunConfig as a dict, its paths relative to RUN (config.run_relative)
      rng.json               python, numpy, torch (and cuda) RNG states
      trainer.json           step, val_loss, sampler state, the trainer's extra running values
      meta.json              format_version, scratchlm version, step, val_loss, sha256 + size of every file
    RUN/checkpoints/best.json  {"step", "val_loss", "name"} of the lowest-val_loss checkpoint kept

Atomicity: everything is written and fsynced into a hidden ``.tmp-*`` directory, ``meta.json`` last (the
completeness marker), then renamed into place: a crash or a full disk never touches earlier checkpoints. Only the
holder of the run's lock removes others' temporaries (``remove_stale_temporaries``). A save holds
RUN/checkpoints/.save.lock, so a reader never sees its checkpoint pruned (run_lock.py). ``latest_valid`` re-hashes
the files and skips a corrupt checkpoint with a warning; a malformed best.json is rebuilt from the meta.json files.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

import scratchlm
from scratchlm.config import located_at, run_relative
from scratchlm.errors import UserError
from scratchlm.train import run_lock
from scratchlm.train.checkpoint_state import (
    capture_rng_state,
    load_model_state,
    model_tensors,
    optimizer_parts,
    optimizer_state_from_parts,
    read_model_tensors,
    restore_rng_state,
    unwrap,
)

FORMAT_VERSION = 1
META_FILE = "meta.json"
BEST_FILE = "best.json"
STEP_PREFIX = "step_"


class CheckpointError(UserError, OSError):
    """A checkpoint could not be written (disk full, permissions): the previous checkpoints are intact."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped, or best.json rebuilt, because it is incomplete or corrupt."""


# ---- CS336 single-file form -------------------------------------------------------------------------------

def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, iteration: int,
                    out: str | os.PathLike | IO[bytes]) -> None:
    """Write model and optimizer state and the iteration number to ``out`` (path or binary file object)."""
    torch.save({"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                "iteration": int(iteration)}, out)


def load_checkpoint(src: str | os.PathLike | IO[bytes], model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore model and optimizer from ``src`` written by ``save_checkpoint``; return the saved iteration."""
    state = torch.load(src, map_location="cpu", weights_only=True)
    load_model_state(unwrap(model), state["model"], where=str(getattr(src, "name", src)))
    optimizer.load_state_dict(state["optimizer"])
    return int(state["iteration"])


# ---- files: fsync'd writes, checksums ------------------------------------------------------------------------

def _write_json(path: Path, value: Any) -> None:
    with open(path, "wb") as handle:
        handle.write(json.dumps(value, indent=1, default=os.fspath).encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as error:
        # The Rust writer reports a failed write (full disk, file size limit) as a SafetensorError, not an OSError;
        # its message ends "(os error N)": raise that OSError, so save() reports it like any other failed write.
        if (found := re.search(r"\(os error (\d+)\)", str(error))) is None:
            raise
        number = int(found.group(1))
        raise OSError(number, os.strerror(number), str(path)) from error
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    if hasattr(os, "O_DIRECTORY"):  # POSIX: make the rename itself durable
        descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def verify(path: Path) -> str | None:
    """None when the checkpoint directory is complete and intact, else a sentence saying what is wrong."""
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        return f"{META_FILE} is missing (the save did not finish)"
    try:
        meta = _read_json(meta_path)
        files = meta["files"]
        version = meta["format_version"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{META_FILE} is unreadable ({error!r})"
    if not isinstance(version, int) or version > FORMAT_VERSION:
        return f"format_version {version!r} is not supported (this scratchlm reads up to {FORMAT_VERSION})"
    if not isinstance(files, dict) or not all(isinstance(info, dict) and {"bytes", "sha256"} <= info.keys()
                                              for info in files.values()):
        return f"{META_FILE} is malformed: 'files' must map each file name to its bytes and sha256"
    for name, info in files.items():
        file = Path(path) / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != info["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, expected {info['bytes']} (truncated?)"
        if _sha256(file) != info["sha256"]:
            return f"{name} fails its sha256 checksum (corrupt)"
    return None


# ---- the trainer's checkpoints -----------------------------------------------------------------------------

class CheckpointManager:
    """Atomic step checkpoints in RUN/checkpoints, keeping the newest ``keep_last`` plus the best by val_loss."""

    def __init__(self, run_dir: str | os.PathLike, keep_last: int = 3) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.run_dir = Path(run_dir)
        self.directory = self.run_dir / "checkpoints"
        self.keep_last = keep_last

    def checkpoints(self) -> list[Path]:
        """Step directories, oldest first (complete or not)."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir()
                 if p.is_dir() and p.name.startswith(STEP_PREFIX) and p.name[len(STEP_PREFIX):].isdigit()]
        return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, *, config: dict,
             sampler_state: dict, extra: dict | None = None, val_loss: float | None = None) -> Path:
        """Write step ``step`` atomically; on failure raise CheckpointError and leave earlier ones intact."""
        final = self.directory / f"{STEP_PREFIX}{step:07d}"
        self._prepare_directory()
        with run_lock.saving(self.directory):
            self._save_locked(final, step, model, optimizer, config, sampler_state, extra, val_loss)
            self._update_best(final, step, val_loss)
            self._prune(final)
        return final

    def _save_locked(self, final: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                     config: dict, sampler_state: dict, extra: dict | None, val_loss: float | None) -> None:
        temp = self.directory / f".tmp-{final.name}-{_writer_id()}"
        try:
            temp.mkdir()
            tensors, aliases = model_tensors(model)
            _save_tensors(temp / "model.safetensors", tensors, {"aliases": json.dumps(aliases)})
            optimizer_tensors, optimizer_rest = optimizer_parts(optimizer)
            _save_tensors(temp / "optimizer.safetensors", optimizer_tensors)
            _write_json(temp / "optimizer.json", optimizer_rest)
            _write_json(temp / "config.json", run_relative(config, self.run_dir))  # the run may be moved
            _write_json(temp / "rng.json", capture_rng_state())
            _write_json(temp / "trainer.json", {"step": step, "val_loss": val_loss, "sampler_state": sampler_state,
                                                "extra": extra})
            files = {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size} for p in sorted(temp.iterdir())}
            _write_json(temp / META_FILE, {"format_version": FORMAT_VERSION,  # written last: the completeness mark
                                           "scratchlm_version": scratchlm.__version__, "step": step,
                                           "val_loss": val_loss, "files": files})
            _fsync_dir(temp)
            _replace_dir(temp, final)
            _fsync_dir(self.directory)
        except OSError as error:
            previous = self.checkpoints()
            kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
            raise CheckpointError(error.errno, f"could not write checkpoint {final}: "
                                  f"{error.strerror or error}; {kept}") from error
        finally:
            shutil.rmtree(temp, ignore_errors=True)

    def _prepare_directory(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise CheckpointError(error.errno, f"run directory {self.run_dir} is not writable: "
                                  f"{error.strerror or error}") from error
        if not os.access(self.directory, os.W_OK):
            raise CheckpointError(errno.EACCES, f"run directory {self.run_dir} is not writable: "
                                  f"cannot write {self.directory}")

    def remove_stale_temporaries(self) -> None:
        """Delete what crashed saves left behind. Only for the holder of the run's lock: another live writer's
        temporaries look exactly like a dead one's."""
        if not self.directory.is_dir():
            return
        for leftover in self.directory.glob(".tmp-*"):  # a save that crashed before its rename
            original = self.directory / leftover.name.removeprefix(".tmp-old-").rsplit("-", 1)[0]
            if leftover.name.startswith(".tmp-old-") and not original.exists():
                os.rename(leftover, original)  # crashed between the two renames of _replace_dir: put it back
            elif leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)  # a best.json temporary of a crash inside _write_best

    def _update_best(self, path: Path, step: int, val_loss: float | None) -> None:
        best = self._best_record()
        if val_loss is None or not np.isfinite(val_loss) or (best is not None and best["val_loss"] <= val_loss):
            return
        self._write_best({"step": step, "val_loss": val_loss, "name": path.name})

    def _write_best(self, record: dict) -> None:
        temp = self.directory / f".tmp-{BEST_FILE}-{_writer_id()}"
        _write_json(temp, record)
        os.replace(temp, self.directory / BEST_FILE)
        _fsync_dir(self.directory)

    def best(self) -> Path | None:
        """The checkpoint with the lowest recorded val_loss, if it still exists."""
        record = self._best_record()
        if record is None:
            return None
        path = self.directory / record["name"]
        return path if path.is_dir() else None

    def _best_record(self) -> dict | None:
        """best.json's record, or None without one. A malformed best.json (edited, or damaged outside a save, which
        replaces it atomically) must not stop training, nor let pruning remove the best checkpoint: it is rebuilt
        from the val_loss in the checkpoints' meta.json, with a warning."""
        path = self.directory / BEST_FILE
        if not path.is_file():
            return None
        try:
            record = _read_json(path)
            if _is_best_record(record):
                return record
            problem = f"is not a {{'step', 'val_loss', 'name'}} record: {record!r:.80}"
        except (OSError, ValueError) as error:  # ValueError: not JSON, or not UTF-8
            problem = f"is unreadable ({error})"
        warnings.warn(f"{path} {problem}; rebuilding it from the checkpoints' {META_FILE}", CheckpointWarning,
                      stacklevel=2)
        rebuilt = self._best_from_meta()
        if rebuilt is None:
            path.unlink()
        else:
            self._write_best(rebuilt)
        return rebuilt

    def _best_from_meta(self) -> dict | None:
        candidates = []
        for path in self.checkpoints():  # oldest first: min() keeps the earliest of equal losses, as _update_best
            try:
                meta = _read_json(path / META_FILE)
                step, val_loss = meta["step"], meta["val_loss"]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # incomplete or corrupt: latest_valid names it
            if isinstance(val_loss, (int, float)) and np.isfinite(val_loss):
                candidates.append({"step": step, "val_loss": val_loss, "name": path.name})
        return min(candidates, key=lambda record: record["val_loss"], default=None)

    def _prune(self, saved: Path) -> None:
        """Keep the newest ``keep_last`` up to the one just saved, plus the best. Directories of later steps can
        only be leftovers that failed verification when the run resumed from an earlier step: they do not take a
        place among the kept ones (they are replaced when the run reaches their step again)."""
        timeline = self.checkpoints()
        timeline = timeline[:timeline.index(saved) + 1]
        keep = set(timeline[-self.keep_last:])
        if (best := self.best()) is not None:
            keep.add(best)
        for path in timeline:
            if path not in keep:
                shutil.rmtree(path)

    def latest_valid(self) -> Path | None:
        """The newest checkpoint whose files verify; corrupt or incomplete ones are skipped with a warning."""
        for path in reversed(self.checkpoints()):
            problem = verify(path)
            if problem is None:
                return path
            warnings.warn(f"skipping checkpoint {path}: {problem}", CheckpointWarning, stacklevel=2)
        return None

    def load(self, path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
        """Restore weights, optimizer and RNG states; return trainer.json: {"step", "val_loss", "sampler_state",
        "extra"}."""
        path = Path(path)
        if (problem := verify(path)) is not None:
            raise ValueError(f"checkpoint {path} cannot be loaded: {problem}")
        load_model_state(unwrap(model), read_model_tensors(path / "model.safetensors"), where=str(path))
        if optimizer is not None:
            state = optimizer_state_from_parts(load_file(str(path / "optimizer.safetensors")),
                                               _read_json(path / "optimizer.json"))
            try:
                optimizer.load_state_dict(state)
            except ValueError as error:
                raise ValueError(f"checkpoint {path}: its optimizer state does not fit this optimizer: {error}") \
                    from error
        restore_rng_state(_read_json(path / "rng.json"))
        return _read_json(path / "trainer.json")

    def config_of(self, path: str | os.PathLike) -> dict:
        """The run config a checkpoint of this run was saved with, its paths located at the run (a dict, as saved)."""
        return located_at(_read_json(Path(path) / "config.json"), self.run_dir)


def _is_best_record(value: Any) -> bool:
    return (isinstance(value, dict) and isinstance(value.get("name"), str) and value["name"].startswith(STEP_PREFIX)
            and isinstance(value.get("val_loss"), (int, float)))


def _writer_id() -> str:
    """Names a temporary after its writer: the pid (for a person reading the folder) and a random part."""
    return f"{os.getpid()}.{uuid.uuid4().hex[:8]}"


def _replace_dir(temp: Path, final: Path) -> None:
    """Rename ``temp`` to ``final``; an existing ``final`` (the same step saved again) is swapped out first."""
    if not final.exists():
        os.rename(temp, final)
        return
    old = final.with_name(f".tmp-old-{final.name}-{os.getpid()}")
    os.rename(final, old)
    os.rename(temp, final)
    shutil.rmtree(old, ignore_errors=True)


def load_for_inference(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """(TransformerLM in eval mode, RunConfig) from a run directory (newest valid checkpoint) or a checkpoint.

    A save in progress in that run is waited for (briefly), and none prunes the chosen checkpoint while it loads."""
    from scratchlm.config import RunConfig
    from scratchlm.model import TransformerLM

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no run or checkpoint directory at {path}")
    is_checkpoint = (path / META_FILE).exists()
    with run_lock.reading(path.parent if is_checkpoint else path / "checkpoints"):
        if is_checkpoint:
            if (problem := verify(path)) is not None:
                raise ValueError(f"checkpoint {path} cannot be loaded: {problem}")
        elif not (path / "checkpoints").is_dir():
            raise FileNotFoundError(f"{path} is neither a checkpoint directory (no {META_FILE}) nor a run "
                                    f"directory (no checkpoints/)")
        elif (found := CheckpointManager(path).latest_valid()) is None:
            raise FileNotFoundError(f"run directory {path} has no valid checkpoint in {path / 'checkpoints'}")
        else:
            path = found
        config = RunConfig.from_dict(located_at(_read_json(path / "config.json"), run_dir_of(path)))
        model = TransformerLM(config.model, device=device)
        load_model_state(model, read_model_tensors(path / "model.safetensors"), where=str(path))
        return model.eval(), config


def run_dir_of(path: str | os.PathLike) -> Path:
    """The run directory of a run directory or of one of its checkpoint directories (RUN/checkpoints/step_N)."""
    path = Path(path)
    return path.parent.parent if (path / META_FILE).exists() and path.parent.name == "checkpoints" else path
