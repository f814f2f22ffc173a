"""One writer per run directory: two real trainers on one run, readers waiting for a save, stale temporaries."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from scratchlm.data.token_file import TokenFileWriter
from scratchlm.train import run_lock
from scratchlm.train.checkpoint import CheckpointManager, verify
from scratchlm.train.run_lock import RunLock, RunLocked

REPO = Path(__file__).resolve().parents[1]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "scratchlm", *args]


def wait_for(condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_second_trainer_is_refused_naming_the_holder_and_the_first_finishes_intact(tmp_path):
    tokens = tmp_path / "train.tok"
    with TokenFileWriter(tokens, vocab_size=256) as writer:
        writer.write(np.random.default_rng(0).integers(0, 256, 20_000))
    run = tmp_path / "run"
    args = ["train", "--config", str(REPO / "configs" / "tiny.toml"), "--set", f"data.train_path={tokens}",
            "--set", "train.max_steps=20", "--set", "train.checkpoint_every=5", "--run-dir", str(run), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    first = subprocess.Popen(cli(*args), env=env, stderr=subprocess.PIPE, text=True)
    try:
        # Freeze the first trainer while it holds the lock, so the second surely meets a live run.
        wait_for(lambda: (run / ".lock").is_file() and f"pid {first.pid}" in (run / ".lock").read_text())
        first.send_signal(signal.SIGSTOP)
        for second_args in (args, [*args, "--resume"]):  # a second trainer, and a --resume of the live run
            second = subprocess.run(cli(*second_args), env=env, capture_output=True, text=True, timeout=120)
            assert second.returncode == 1
            assert f"run directory {run} is in use by pid {first.pid} on host" in second.stderr
            assert second.stderr.count("\n") == 1
        first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=300) == 0, first.stderr.read()
    finally:
        first.kill()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1] == {"kind": "end", "step": 20, "status": "finished", "message": ""}
    checkpoints = CheckpointManager(run).checkpoints()
    assert checkpoints and all(verify(path) is None for path in checkpoints)
    assert not (run / ".lock").exists()  # released and removed on exit
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_lock_of_a_dead_holder_is_free_and_released_lock_can_be_taken_again(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                           "from scratchlm.train.run_lock import RunLock; RunLock(sys.argv[2]).acquire()",
                           str(REPO / "src"), str(tmp_path)], check=True)
    assert dead.returncode == 0 and (tmp_path / ".lock").exists()  # it died holding the lock: the file remains
    lock = RunLock(tmp_path).acquire()  # the kernel released it
    with pytest.raises(RunLocked, match=f"is in use by pid {os.getpid()} on host"):
        RunLock(tmp_path).acquire()
    lock.release()
    RunLock(tmp_path).acquire().release()


def test_reader_waits_for_a_save_in_progress_or_is_refused(tmp_path):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    with run_lock.reading(directory):  # no save ever ran: nothing to wait for
        pass
    saving = run_lock.saving(directory)
    saving.__enter__()
    with pytest.raises(RunLocked, match="a checkpoint save in .* has been in progress"), \
            run_lock.reading(directory, wait_s=0.2):
        pass
    threading.Timer(0.3, saving.__exit__, (None, None, None)).start()
    start = time.monotonic()
    with run_lock.reading(directory, wait_s=10):
        assert time.monotonic() - start >= 0.25  # it waited for the save to end
