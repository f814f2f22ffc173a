"""Progress bars that cost nothing when hidden: tqdm is imported only for a bar that is shown.

Why: importing tqdm is a visible share of a short command's start-up (`data encode`, BPE training on a small file;
figures in docs/benchmarks.md), and those commands hide their bars when not on a terminal or with --quiet, so a
hidden bar must not pay for the import.
"""

from __future__ import annotations


def progress_bar(total: int, shown: bool, **options):
    """A tqdm bar over `total` units (``options`` go to tqdm), or a stand-in whose update and close do nothing."""
    if not shown:
        return _HiddenBar()
    from tqdm import tqdm

    return tqdm(total=total, **options)


class _HiddenBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass
