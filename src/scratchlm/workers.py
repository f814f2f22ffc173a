"""How many worker processes a CPU-bound command (``tokenizer train``, ``data encode``) starts by default.

Every core this process may run on (its affinity mask, which a container or ``taskset`` narrows), capped at
MAX_DEFAULT_WORKERS: past that, each worker's own copy of the tokenizer and its start-up cost outweigh the gain
on the corpora people train on, and a shared machine is not taken over by default. ``--workers N`` goes higher.
"""

from __future__ import annotations

import os

MAX_DEFAULT_WORKERS = 8


def default_workers() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, MAX_DEFAULT_WORKERS)
