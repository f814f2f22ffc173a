"""The encode worker processes' side: each holds the tokenizer it was started with and dies with its parent.

Both encoders use it: data/encode.py (byte ranges of plain text) and data/document_encode.py (batches of
documents), so neither imports the other for it.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
import threading
import time

from scratchlm.tokenizer.tokenizer import Tokenizer

_WORKER_TOKENIZER: Tokenizer | None = None
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def init_worker(tokenizer: Tokenizer, parent: int) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer
    _die_with_parent(parent)
    # A worker's objects are the tokenizer's caches (str -> tuple of ints) and id lists: no reference cycles,
    # so the cyclic collector would only re-scan the growing caches, time spent freeing nothing.
    gc.disable()


def _die_with_parent(parent: int) -> None:
    """A worker ends when the encode that started it dies, even by SIGKILL (which runs no clean-up): otherwise
    it would wait on the task queue forever. Linux: the kernel sends SIGKILL (PR_SET_PDEATHSIG); elsewhere a
    daemon thread notices the new parent pid within a second."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            if os.getppid() != parent:  # the parent died before the prctl took effect
                os._exit(1)
            return
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def worker_tokenizer() -> Tokenizer:
    assert _WORKER_TOKENIZER is not None, "worker started without a tokenizer"
    return _WORKER_TOKENIZER
