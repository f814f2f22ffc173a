"""One writer per run directory: an advisory ``fcntl.flock`` on RUN/.lock, held for the whole run.

Two trainers on one run directory (or a ``--resume`` of a live run) destroy each other's saves, prunes and metrics.
The kernel releases a flock however its holder dies, so a crashed run never blocks its resume; the file holds the
holder's pid, host and start time only to name it in the refusal. Readers of checkpoints take a finer lock:
a save holds RUN/checkpoints/.save.lock exclusively, a reader shared (waiting up to ``READ_WAIT_S``), so the
checkpoint it picked is not pruned under it. flock is advisory and may not work across hosts on network filesystems.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from scratchlm.errors import UserError
from scratchlm.output_paths import missing_folders, remove_empty

LOCK_FILE = ".lock"
SAVE_LOCK_FILE = ".save.lock"
READ_WAIT_S = 30.0
T = TypeVar("T")


class RunLocked(UserError):
    """Another process holds the run directory (or a checkpoint save in it)."""


class RunLock:
    """The exclusive lock of one run directory; ``release`` removes the lock file (nothing is left behind)."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock or raise RunLocked naming the holder; the run directory must exist."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 400).decode("utf-8", errors="replace").strip() or "another process"
                os.close(fd)
                raise RunLocked(f"run directory {self.run_dir} is in use by {holder}; wait for it to finish, "
                                f"stop it, or choose another --run-dir") from None
            # The previous holder may have removed the file between our open and flock: lock the file in place.
            if _same_file(fd, self.path):
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()} (since {started})\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # still held: a newcomer that opened the old file retries on a new one
        os.close(self._fd)
        self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def holding_run(run_dir: Path) -> Iterator[RunLock]:
    """Create ``run_dir`` if needed and hold its lock; a run that fails leaves no folder it created empty behind."""
    created = missing_folders(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(run_dir).acquire()
    except OSError as error:
        remove_empty(created)
        raise PermissionError(f"cannot write to run directory {run_dir}: {error.strerror or error}") from None
    try:
        yield lock
    finally:
        lock.release()
        remove_empty(created)  # a run that failed before writing anything; a run that wrote is not empty


def locks_run(train_fn: Callable[..., T]) -> Callable[..., T]:
    """Decorate ``train(config, ...)``: the main process holds config.train.run_dir's lock for the whole call."""

    @functools.wraps(train_fn)
    def locked(config, *args, **kwargs) -> T:
        from scratchlm.train.distributed import rank_and_world_size

        if rank_and_world_size()[0] != 0:  # only rank 0 writes the run directory, so only it locks
            return train_fn(config, *args, **kwargs)
        with holding_run(Path(config.train.run_dir)):
            return train_fn(config, *args, **kwargs)

    return locked


# ---- checkpoint saves and their readers -------------------------------------------------------------------

@contextlib.contextmanager
def saving(checkpoint_dir: Path) -> Iterator[None]:
    """Held by a checkpoint save (write, rename, prune): readers wait for it."""
    fd = os.open(checkpoint_dir / SAVE_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def reading(checkpoint_dir: Path, wait_s: float = READ_WAIT_S) -> Iterator[None]:
    """Held while a checkpoint of ``checkpoint_dir`` is chosen and loaded, so no save prunes it meanwhile.

    A folder no save ever ran in has no lock file and needs none; one that cannot be opened (read-only copy of a
    run) is read unlocked. A save that lasts longer than ``wait_s`` is an error: try again."""
    try:
        fd = os.open(checkpoint_dir / SAVE_LOCK_FILE, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RunLocked(f"a checkpoint save in {checkpoint_dir} has been in progress for over "
                                    f"{wait_s:.0f} s; try again when it is done") from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)
