"""Where a command may write: never over one of its inputs, never into somebody else's folder unasked.

The rules every writing command follows (data encode, tokenizer train, export hf, import hf, sweep, report):
- an output path that is, resolves to (symlink, hard link, ``..``) or contains one of the inputs is refused,
  --force or not; so is one inside an input folder, unless the command writes only new names there (report);
- an existing folder that holds files is refused without --force, unless it is this command's own earlier
  output (``ours``: a file only that command writes, such as sweep.json);
- the folders a command creates are removed again when it fails, so a refused or failed command leaves nothing
  behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from scratchlm.errors import UserError


def same_path(a: Path, b: Path) -> bool:
    """Do ``a`` and ``b`` name one file or folder (after symlinks and `..`, or as hard links)?"""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False


def _inside(inner: Path, outer: Path) -> bool:
    return inner.resolve().is_relative_to(outer.resolve()) and not same_path(inner, outer)


def refuse_inputs(out: Path, inputs: Iterable[Path], *, flag: str = "--out", inside_ok: bool = False) -> None:
    """Refuse an output that is, contains or (unless ``inside_ok``) lies inside one of ``inputs``."""
    for source in inputs:
        source = Path(source)
        if same_path(out, source):
            raise UserError(f"{flag} {out} is the input {source}: writing it would destroy the input; "
                            f"choose another {flag}")
        if _inside(source, out):
            raise UserError(f"{flag} {out} holds the input {source}; choose another {flag}")
        if not inside_ok and _inside(out, source):
            raise UserError(f"{flag} {out} lies inside the input {source}; choose a path outside it")


def refuse_foreign_folder(out: Path, *, force: bool, flag: str = "--out", ours: tuple[str, ...] = ()) -> None:
    """Refuse a file at ``out``, or a folder holding files, unless ``force`` or it holds one of ``ours``."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {out} is a file; give a folder to write into")
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
def removed_on_failure(out: Path, *, keep_results: bool = False) -> Iterator[Path]:
    """For a block that creates ``out``: if it fails, ``out`` and the parents it created are removed with what
    was written into them, or only when empty with ``keep_results`` (a sweep whose first points finished keeps
    them). A folder that existed before the block is never removed."""
    missing = missing_folders(out)
    try:
        yield out
    except BaseException:
        if keep_results or not missing:
            remove_empty(missing)
        else:
            shutil.rmtree(missing[-1], ignore_errors=True)
        raise


def refuse_file(out: Path, *, force: bool, flag: str = "--out") -> None:
    """For a command that writes one file: refuse a folder at ``out``, and an existing file unless ``force``."""
    if out.is_dir():
        raise UserError(f"{flag} {out} is a folder; give the file to write")
    if out.exists() and not force:
        raise UserError(f"{flag} {out} already exists; choose a new file, or pass --force to replace it")
