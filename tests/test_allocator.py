"""allocator.keep_freed_memory: freed blocks stay in the process instead of going back to the OS."""

from __future__ import annotations

import sys

import psutil
import pytest
import torch

from scratchlm.train.allocator import keep_freed_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a glibc (Linux) speed path")


def _rss_drop_after_freeing(megabytes: int) -> float:
    """MB of resident memory given back when a freshly written `megabytes` tensor is freed."""
    process = psutil.Process()
    block = torch.ones(megabytes * 2**20 // 4)  # written, so every page is resident
    before = process.memory_info().rss
    del block
    return (before - process.memory_info().rss) / 2**20


def test_freed_blocks_stay_resident_once_applied():
    # Without it, glibc munmaps a 64 MB block on free and the RSS drops by about that much; after it, the block
    # stays for the next allocation. (Applying it to this test process is harmless: it only keeps memory.)
    assert keep_freed_memory()
    _rss_drop_after_freeing(64)  # the first block may still be an old mmap threshold's
    assert _rss_drop_after_freeing(64) < 8
