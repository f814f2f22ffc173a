"""Keep freed memory in the process: a speed path for training on a CPU under Linux (glibc).

Every training step allocates the same large buffers (the logits alone are batch x context x vocab floats, 64 MB
for the modern recipe) and frees them again. glibc's malloc serves such blocks with a fresh ``mmap`` and hands
them back with ``munmap`` (and trims the top of its heap back to the OS), so the next step page-faults every page
in again and the kernel zeroes it: system time that grows with the step's buffers. Asking malloc never to use
``mmap`` and never to trim keeps those pages in the process for the next step. The cost is memory: freed blocks
are reused from the heap rather than returned, and its fragmentation raises the peak RSS.
benchmarks/bench_allocator.py measures both sides (figures: docs/benchmarks.md, "bench_allocator").

Wins on: CPU training with glibc (Linux). CUDA memory has PyTorch's own caching allocator, and other C libraries
(macOS, musl, Windows) are left alone: there ``keep_freed_memory`` does nothing and training takes the default
path. The trainer applies it (and the budget probe runs after it, so the plan measures the same speed).
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
