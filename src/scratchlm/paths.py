"""Where scratchlm finds the real corpora it trains and tests on.

The shared data folder (TinyStories, OpenWebText sample, GPT-2 vocab/merges, fixtures) is never copied into
the repository. It is found, in order, at ``$SCRATCHLM_DATA_DIR``, at ``../shared/data`` beside the current
working directory's repository, and at ``../shared/data`` beside this source checkout.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "SCRATCHLM_DATA_DIR"


def _candidates() -> list[Path]:
    found = []
    if env := os.environ.get(DATA_DIR_ENV):
        found.append(Path(env))
    found.append(Path.cwd().parent / "shared" / "data")
    repo_root = Path(__file__).resolve().parents[2]  # src/scratchlm/paths.py -> repo root
    found.append(repo_root.parent / "shared" / "data")
    return list(dict.fromkeys(found))  # run from the checkout itself, the last two are the same folder


def shared_data_dir() -> Path | None:
    """The shared data folder, or None when none of the candidate locations exists."""
    for candidate in _candidates():
        if candidate.is_dir():
            return candidate
    return None


def shared_data_file(relative: str) -> Path | None:
    """A file inside the shared data folder, e.g. ``"tinystories/TinyStories-train.txt"``, or None if absent."""
    root = shared_data_dir()
    if root is None:
        return None
    path = root / relative
    return path if path.exists() else None


def describe_search() -> str:
    """A human-readable list of where shared data was looked for (for skip reasons and errors)."""
    return ", ".join(str(p) for p in _candidates())
