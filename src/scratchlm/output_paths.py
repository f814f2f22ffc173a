"""Where a command may write: never over one of its inputs, never into somebody else's folder unasked.

The rules every writing command follows (data encode, tokenizer train, export hf, import hf, sweep, report):
- an output path that is, resolves to (symlink, hard link, ``..``) or contains one of the inputs is refused,
  --force or not; so is one inside an input folder, unless the command writes only new names there (report);
- an existing folder that holds files is refused without --force, unless it is this command's own earlier
  output (``ours``: a file only that command writes, such as sweep.json);
- a folder the command created is removed again when the command fails, so a refused or failed command leaves
  nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from scratchlm.errors import UserError


def _same(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False


def _inside(inner: Path, outer: Path) -> bool:
    return inner.resolve().is_relative_to(outer.resolve()) and not _same(inner, outer)


def refuse_inputs(out: Path, inputs: Iterable[Path], *, flag: str = "--out", inside_ok: bool = False) -> None:
    """Refuse an output that is, contains or (unless ``inside_ok``) lies inside one of ``inputs``."""
    for source in inputs:
        source = Path(source)
        if _same(out, source):
            raise UserError(f"{flag} {out} is the input {source}: writing it would destroy the input; "
                            f"choose another {flag}")
        if _inside(source, out):
            raise UserError(f"{flag} {out} holds the input {source}; choose another {flag}")
        if not inside_ok and _inside(out, source):
            raise UserError(f"{flag} {out} lies inside the input {source}; choose a path outside it")


def refuse_foreign_folder(out: Path, *, force: bool, flag: str = "--out", ours: tuple[str, ...] = ()) -> None:
    """Refuse a file at ``out``, or a folder holding files, unless ``force`` or it holds one of ``ours``."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {out} is a file; give a folder")
    if force or not out.is_dir():
        return
    names = sorted(p.name for p in out.iterdir())
    if names and not any(name in names for name in ours):
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise UserError(f"{flag} {out} already holds files ({shown}); choose a new folder, or pass --force to "
                        f"write into it anyway")


def missing_folders(path: Path) -> list[Path]:
    """``path`` and its parents that do not exist yet, deepest first."""
    missing = []
    for candidate in [path, *path.absolute().parents]:
        if candidate.exists():
            break
        missing.append(candidate)
    return missing


def remove_empty(folders: list[Path]) -> None:
    """rmdir each of ``folders`` (deepest first) that is empty; one that holds anything stays."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


@contextlib.contextmanager
def created_folder(out: Path, *, keep_results: bool = False) -> Iterator[Path]:
    """Create ``out`` (and missing parents) for the block. If the block fails, the folders created here are
    removed with what was written into them, or only when empty with ``keep_results`` (a sweep whose first
    points finished keeps them)."""
    missing = missing_folders(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        yield out
    except BaseException:
        if keep_results or not missing:
            remove_empty(missing)
        else:
            shutil.rmtree(missing[-1], ignore_errors=True)
        raise
