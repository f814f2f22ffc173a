"""`scratchlm train-tokenizer`'s peak-memory line reports the command's own peak, not its parent's."""

import subprocess
import sys

import pytest

from scratchlm.tokenizer.commands import peak_memory_mb

PARENT_MB = 600


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux carries ru_maxrss over exec")
def test_own_peak_is_not_the_parents():
    """Linux's ru_maxrss starts a process started from a 600 MB one at 600 MB: the command must not say so."""
    resident = bytearray(PARENT_MB * 2**20)
    resident[::4096] = b"\1" * len(resident[::4096])  # touch every page: resident, not just reserved
    code = "from scratchlm.tokenizer.commands import peak_memory_mb; print(peak_memory_mb()[0])"
    own = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    del resident
    assert 0 < own < PARENT_MB / 2, own


def test_this_process_has_a_peak():
    own, children = peak_memory_mb()
    assert own > 0 and children >= 0
