"""Failing writes end clearly: the error names the file, and a folder made for the output does not stay behind.

A write that fails on a full disk raises ``OSError(ENOSPC)`` with no file name (``file.write`` knows only its
descriptor), so the user would read a bare "[Errno 28] No space left on device". ``naming(path)`` wraps the
writes of one output file and re-raises such an error with the path and the bytes it was writing (when the
caller knows); ``describe_os_error`` adds the space left on that filesystem. ``made_folder(path)`` creates an
output folder and removes it again, with the parents it created, when the block fails.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from scratchlm.output_paths import removed_on_failure

_FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left, disk quota exceeded


@contextmanager
def naming(path: str | Path, needed_bytes: int | None = None) -> Iterator[None]:
    """Re-raise an OSError without a file name from inside the block as one that names `path`."""
    try:
        yield
    except OSError as error:
        if error.filename is not None or isinstance(error, BrokenPipeError):
            raise
        raise OSError(error.errno, _explain(error, needed_bytes), str(path)) from error


def _explain(error: OSError, needed_bytes: int | None) -> str:
    reason = error.strerror or str(error)
    if needed_bytes is None or error.errno not in _FULL:
        return reason
    return f"{reason} (writing {needed_bytes:,} bytes)"


def describe_os_error(error: OSError) -> str:
    """One line for the CLI: 'PATH: reason', with the space left there after a full disk.

    The free space is measured here, when the command has failed and cleaned up its temporary files, so it is
    what the user has to work with (measured at the failing write, it would read 0)."""
    if error.filename is None:
        return str(error)
    target = f" -> {error.filename2}" if error.filename2 is not None else ""
    line = f"{error.filename}{target}: {error.strerror or error}"
    if error.errno in _FULL:
        try:
            folder = next(p for p in Path(error.filename).parents if p.exists())  # its own may have been cleaned up
            line += f"; {shutil.disk_usage(folder).free:,} bytes free on that filesystem"
        except OSError:
            pass  # the free space is a courtesy: the error is about the write, not about asking
    return line


@contextmanager
def made_folder(path: str | Path) -> Iterator[Path]:
    """mkdir -p `path`; when the block fails, remove the folders this call created with what the block put there
    (they did not exist before it, so all they hold is the half-written output)."""
    path = Path(path)
    with removed_on_failure(path):
        path.mkdir(parents=True, exist_ok=True)
        yield path
