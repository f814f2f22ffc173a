"""`scratchlm serve` as a process: SIGTERM ends in-flight streams with a final error event and exits 0; a host
other machines can reach is refused without an API key; the key never reaches the logs; without the [serve]
extra the command says so in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from scratchlm.cli import main
from scratchlm.compat.commands import write_run
from scratchlm.model import ModelConfig, TransformerLM, kernels
from scratchlm.tokenizer import Tokenizer
from serve_helpers import byte_tokenizer, free_port, httpx

SRC = Path(__file__).resolve().parents[1] / "src"
KEY = "k3y-that-must-not-leak"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.preset("tiny", vocab_size=257, context_length=4096)).eval()
    run = tmp_path_factory.mktemp("serve") / "demo"
    write_run(model, byte_tokenizer(), run)
    return run


@pytest.fixture(scope="module")
def endless_run_dir(tmp_path_factory):
    """A run whose tokenizer has no end-of-text token: its streams end only at max_tokens, so a stream is still
    running when the test signals the server, however the sampled tokens fall."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.preset("tiny", vocab_size=256, context_length=4096)).eval()
    run = tmp_path_factory.mktemp("serve") / "endless"
    write_run(model, Tokenizer({i: bytes([i]) for i in range(256)}, [], []), run)
    return run


def _start(run: Path, port: int, *extra: str, env: dict | None = None) -> subprocess.Popen:
    environment = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   "SCRATCHLM_API_KEY": KEY, **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "scratchlm", "serve", str(run), "--port", str(port), *extra],
                            env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(process: subprocess.Popen, url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited early:\n{process.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise AssertionError("the server did not come up")


def test_sigterm_ends_streams_with_an_error_event_and_exits_0_and_the_key_is_never_logged(endless_run_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = _start(endless_run_dir, port, "--max-tokens", "4000")
    try:
        _wait_for(process, url)
        headers = {"Authorization": f"Bearer {KEY}"}
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "a"}, headers={
            "Authorization": "Bearer wrong-key-also-secret"}).status_code == 401
        request = {"prompt": "x", "max_tokens": 4000, "stream": True, "temperature": 1.0}
        with httpx.stream("POST", f"{url}/v1/completions", json=request, headers=headers, timeout=60) as response:
            assert response.status_code == 200
            events = (line for line in response.iter_lines() if line)
            first = next(events)
            process.send_signal(signal.SIGTERM)
            rest = list(events)
        assert first.startswith("data: "), first
        assert json.loads(first[len("data: "):])["choices"][0]["finish_reason"] is None
        last = json.loads(rest[-1][len("data: "):])
        assert last["error"]["code"] == "shutdown" and "shutting down" in last["error"]["message"]
        assert "data: [DONE]" not in rest
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert KEY not in output and "wrong-key-also-secret" not in output
    assert "API key required" in output and "Shutting down" in output


def test_a_host_reachable_from_elsewhere_needs_an_api_key(run_dir, capsys, monkeypatch):
    monkeypatch.delenv("SCRATCHLM_API_KEY", raising=False)
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.com"):
        assert main(["serve", str(run_dir), "--host", host]) == 1
        err = capsys.readouterr().err
        assert f"--host {host} is reachable from other machines: give an API key" in err
        assert len(err.strip().splitlines()) == 1


def test_without_the_serve_extra_the_command_names_it(run_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)
    assert main(["serve", str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'scratchlm[serve]'" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-batch", "0"], "--max-batch must be a positive integer, got 0"),
    (["--request-timeout", "0"], "--request-timeout must be a positive number"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
])
def test_bad_limits_are_one_line(run_dir, capsys, argv, message):
    assert main(["serve", str(run_dir), *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_server_whose_engine_cannot_decode_exits_1_with_the_reason(run_dir, capsys, monkeypatch):
    """Not a healthy-looking server that never answers: one line naming why, and exit 1, before HTTP starts."""
    def broken_decoding(model, compile=False, batch=None):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(kernels, "decoding", broken_decoding)
    assert main(["serve", str(run_dir), "--port", str(free_port())]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert err[0].startswith(f"scratchlm serve: error: cannot serve {run_dir}: the decoding engine failed: "
                             f"RuntimeError: mkldnn_reorder_linear_weight")
