"""Keep freed memory in the process: a speed path for training on a CPU under Linux (glibc).

Each step allocates and frees the same large buffers (the logits alone are batch x context x vocab floats). glibc
serves such blocks with ``mmap`` and returns them with ``munmap``, so every step page-faults them in again; telling
malloc never to mmap nor trim keeps the pages, at the cost of a higher peak RSS (benchmarks/bench_allocator.py).
Elsewhere (CUDA's own allocator, other C libraries) ``keep_freed_memory`` does nothing.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's <malloc.h>
M_MMAP_MAX = -4
NEVER_TRIM = 2**31 - 1  # the largest value mallopt takes


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse (no mmap'd blocks, no trimming); True when applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt  # glibc; absent under musl
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)) and bool(mallopt(M_MMAP_MAX, 0))
