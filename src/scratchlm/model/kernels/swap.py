"""`swapped`: attributes set for the length of a block, what they held before put back on exit."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager


@contextmanager
def swapped(settings: Iterable[tuple[object, str, object]]) -> Iterator[None]:
    """Within the block, `setattr(owner, name, value)` for each (owner, name, value) of `settings`; on exit, even by
    an exception, each attribute gets back the value it had when the block was entered."""
    settings = list(settings)
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in settings]
    try:
        for owner, name, value in settings:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
