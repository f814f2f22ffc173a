"""Where scratchlm finds the real corpora it trains and tests on.

The shared data folder (TinyStories, OpenWebText sample, GPT-2 vocab/merges, fixtures) is never copied into
the repository. It is ``$SCRATCHLM_DATA_DIR`` when that is set (a folder that does not exist is an error, not a
reason to look elsewhere); otherwise the first folder that exists of ``CWD/../shared/data`` (``shared/data``
beside the working directory: beside the repository when run from its root) and ``CHECKOUT/../shared/data``
(beside the source checkout this module was imported from).
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "SCRATCHLM_DATA_DIR"
# The modern recipe (configs/recipes/modern.toml in the checkout): the default of `demo` and `plan`.
DEFAULT_RECIPE = Path(__file__).resolve().parents[2] / "configs" / "recipes" / "modern.toml"
DEFAULT_FINETUNE = DEFAULT_RECIPE.parents[1] / "finetune.toml"  # `scratchlm finetune` without --config


def _candidates() -> list[Path]:
    found = []
    if env := os.environ.get(DATA_DIR_ENV):
        found.append(Path(env))
    found.append(Path.cwd().parent / "shared" / "data")
    repo_root = Path(__file__).resolve().parents[2]  # src/scratchlm/paths.py -> repo root
    found.append(repo_root.parent / "shared" / "data")
    return list(dict.fromkeys(found))  # run from the checkout itself, the last two are the same folder


def shared_data_dir() -> Path | None:
    """The shared data folder, or None when none of the candidate locations exists (and the variable is unset)."""
    if (env := os.environ.get(DATA_DIR_ENV)) and not Path(env).is_dir():  # a typo must not silently use other data
        raise FileNotFoundError(f"{DATA_DIR_ENV}={env}: no such folder (point it at the shared data folder, or "
                                "unset it to look beside the repository)")
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
