"""Shared pieces of the serve tests: a tiny model with a byte tokenizer, and a server running in this process.

`running(app)` serves a FastAPI app with uvicorn on a free loopback port in a background thread (uvicorn installs
no signal handlers off the main thread) and yields its base URL; the SIGTERM test starts a real process instead
(tests/test_serve_process.py).
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import pytest
import torch

pytest.importorskip("fastapi", reason="the [serve] extra (fastapi, uvicorn) is not installed")
httpx = pytest.importorskip("httpx", reason="the test extra's httpx is not installed")
uvicorn = pytest.importorskip("uvicorn", reason="the [serve] extra (fastapi, uvicorn) is not installed")

from scratchlm.generate.engine import Engine  # noqa: E402
from scratchlm.model import ModelConfig, TransformerLM  # noqa: E402
from scratchlm.serve.app import create_app  # noqa: E402
from scratchlm.serve.commands import Limits  # noqa: E402
from scratchlm.tokenizer import Tokenizer  # noqa: E402

EOS = 256
CONTEXT = 128
MODEL_NAME = "tiny"


def byte_tokenizer() -> Tokenizer:
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])


def tiny_model(seed: int = 0, context: int = CONTEXT) -> TransformerLM:
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig.preset("tiny", vocab_size=257, context_length=context)).eval()
    with torch.no_grad():  # sharper logits than the init's: greedy paths then depend on every detail
        model.lm_head.weight.mul_(8)
    return model


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def running(app, port: int | None = None):
    """Serve `app` on 127.0.0.1 in a thread until the block ends; yields the base URL."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def serving(model: TransformerLM | None = None, *, start_engine: bool = True, api_key: str | None = None,
            tokenizer: Tokenizer | None = None, **limits):
    """An engine over `model` (default: tiny_model()) and `tokenizer` (default: byte_tokenizer()) and its app,
    served; yields (base URL, engine)."""
    model, tokenizer = model or tiny_model(), tokenizer or byte_tokenizer()
    settings = Limits(**limits)
    eos_id = tokenizer.special_id("<|endoftext|>") if "<|endoftext|>" in tokenizer.special_tokens else None
    engine = Engine(model, tokenizer, eos_id=eos_id, max_batch=settings.max_batch, max_queue=settings.max_queue)
    if start_engine:
        engine.start()
    try:
        with running(create_app(engine, model_name=MODEL_NAME, limits=settings, api_key=api_key)) as url:
            yield url, engine
    finally:
        engine.close()


def wait_until_idle(url: str, timeout: float = 20.0) -> dict:
    """GET /health until no sequence is active or waiting; returns the last answer."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{url}/health").json()
        if (health["active"], health["waiting"]) == (0, 0) or time.monotonic() > deadline:
            return health
        time.sleep(0.02)
