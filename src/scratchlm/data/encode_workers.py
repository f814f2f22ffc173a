"""The encoders' worker processes: each holds the tokenizer it was started with and dies with its parent.

Both encoders use them: data/encode.py (byte ranges of plain text) and data/document_encode.py (batches of
documents), so neither imports the other for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from scratchlm.tokenizer.tokenizer import Tokenizer

_WORKER_TOKENIZER: Tokenizer | None = None
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@contextlib.contextmanager
def worker_pool(tokenizer: Tokenizer, workers: int) -> Iterator[ProcessPoolExecutor]:
    """``workers`` processes holding ``tokenizer``; an error (or Ctrl-C) in the block cancels the queued tasks
    and waits for the running ones before it propagates."""
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                             initargs=(tokenizer, os.getpid())) as pool:
        try:
            yield pool
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def _init_worker(tokenizer: Tokenizer, parent: int) -> None:
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


def in_worker(function: Callable[..., Any], *args: Any) -> Any:
    """``function(tokenizer, *args)`` with the worker's tokenizer: the task to submit to a ``worker_pool``."""
    assert _WORKER_TOKENIZER is not None, "worker started without a tokenizer"
    return function(_WORKER_TOKENIZER, *args)
