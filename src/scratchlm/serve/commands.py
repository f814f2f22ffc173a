"""`scratchlm serve RUN_OR_FOLDER`: an OpenAI-compatible completions (and chat completions) server with a
playground page.

The model comes from a run directory (its newest valid checkpoint), a checkpoint directory, or a run written by
`scratchlm import hf`; the tokenizer is the run's (as for `scratchlm generate`). It binds 127.0.0.1:8000 unless
told otherwise; any other address needs an API key (--api-key or SCRATCHLM_API_KEY), which clients send as
`Authorization: Bearer KEY`. fastapi and uvicorn come with the [serve] extra.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ipaddress
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from scratchlm.generate.commands import add_model_arguments, load_model_and_tokenizer

T = TypeVar("T")

API_KEY_ENV = "SCRATCHLM_API_KEY"
# The Limits fields with a flag (max_batch is --max-batch), in the order --help lists them, and what each means.
# max_logprobs has no flag: it keeps its default.
LIMIT_FLAGS = {
    "max_batch": "sequences decoded together",
    "max_queue": "sequences waiting for a slot before requests get 429",
    "max_tokens": "largest max_tokens a request may ask",
    "max_body_bytes": "largest request body",
    "max_choices": "prompts x n in one request",
    "request_timeout": "seconds a request may take",
}


@dataclass(frozen=True)
class Limits:
    """What one request may ask for and how much waiting the server accepts (docs/serving.md). A request over a
    limit gets an OpenAI error object: 413 for the body, 400 for a field, 429 with Retry-After for a full queue,
    504 after the request timeout."""

    max_body_bytes: int = 1_000_000  # a request body larger than this is refused (413) before it is parsed
    max_tokens: int = 2048  # the largest max_tokens a request may ask for (the context may allow fewer)
    max_batch: int = 16  # sequences decoded together; more wait in the queue
    max_queue: int = 64  # sequences waiting for a batch slot; past that, 429 with Retry-After
    max_choices: int = 16  # choices in one request: len(prompt list) x n
    max_logprobs: int = 20  # the largest `logprobs` (alternatives per token)
    request_timeout: float = 600.0  # seconds from arrival to the last token; then 504 (or a final error event)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_tokens", "max_batch", "max_queue", "max_choices", "max_logprobs"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"limit {name} must be a positive integer, got {value!r}")
        if not self.request_timeout > 0:
            raise ValueError(f"limit request_timeout must be a positive number of seconds, got {self.request_timeout}")


EPILOG = f"""examples:
  scratchlm serve runs/demo                          # http://127.0.0.1:8000 (playground at /)
  scratchlm serve runs/demo --port 9000 --max-batch 32
  {API_KEY_ENV}=secret scratchlm serve runs/demo --host 0.0.0.0   # other machines: a key is required

  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{{"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0.8}}'
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{"messages": [{{"role": "user", "content": "Hi!"}}]}}'     # a model with a chat template"""


def register(subparsers: argparse._SubParsersAction) -> None:
    defaults = Limits()
    parser = subparsers.add_parser(
        "serve", help="serve a model over the OpenAI completions and chat APIs, with a playground page", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve a model over HTTP: POST /v1/completions and, for a model with a chat template, POST "
                    "/v1/chat/completions (OpenAI's protocol, streaming included), GET /v1/models, GET /health, "
                    "and a playground page at /. Concurrent requests are decoded together (continuous batching). "
                    "Needs the [serve] extra.")
    parser.add_argument("checkpoint", type=Path, metavar="RUN_OR_FOLDER",
                        help="run directory (newest valid checkpoint), checkpoint directory or imported model run")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine "
                                                            "only; any other needs an API key)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    parser.add_argument("--api-key", default=None,
                        help=f"require Authorization: Bearer KEY on /v1/* (default: ${API_KEY_ENV}; prefer the "
                             f"variable: a flag is visible to other users in the process list)")
    parser.add_argument("--model-name", default=None, help="the model's id in the API (default: the run folder's "
                                                           "name)")
    add_model_arguments(parser)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's CPU threads (default: torch's choice; 1 is fastest on a busy small machine)")
    limits = parser.add_argument_group("limits")
    for name, meaning in LIMIT_FLAGS.items():
        default = getattr(defaults, name)
        shown = f"{default:g}" if isinstance(default, float) else default
        limits.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default,
                            help=f"{meaning} (default: {shown})")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="uvicorn's log level (default: info)")
    parser.set_defaults(func=run_serve, cs336_checkpoint=None, model_config=None, preset=None, model_overrides=[])


def run_serve(args: argparse.Namespace) -> int:
    import torch

    from scratchlm.errors import UserError
    from scratchlm.extras import require
    from scratchlm.train.checkpoint import run_dir_of

    require("fastapi", "serve", "scratchlm serve")
    uvicorn = require("uvicorn", "serve", "scratchlm serve")
    from scratchlm.generate.engine import Engine
    from scratchlm.serve.app import create_app

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if api_key is not None and not api_key.strip():
        raise UserError("the API key is empty")
    if not is_loopback(args.host) and api_key is None:
        raise UserError(f"--host {args.host} is reachable from other machines: give an API key (--api-key or "
                        f"{API_KEY_ENV}), or bind 127.0.0.1")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    try:
        limits = Limits(**{name: getattr(args, name) for name in LIMIT_FLAGS})
    except ValueError as error:  # "limit max_batch must be ..." names the field: say the flag
        raise UserError(str(error).replace("limit ", "--").replace("_", "-")) from None
    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)

    model, tokenizer = off_the_main_thread(lambda: load_model_and_tokenizer(args, "serve"))
    engine = Engine(model, tokenizer, eos_id=tokenizer.end_of_text_id, max_batch=limits.max_batch,
                    max_queue=limits.max_queue, compile=args.compile)
    model_name = args.model_name or run_dir_of(args.checkpoint).resolve().name
    app = create_app(engine, model_name=model_name, limits=limits, api_key=api_key)
    try:
        engine.start()
    except RuntimeError as error:
        raise UserError(f"cannot serve {args.checkpoint}: {error}") from None
    print(f"scratchlm serve: {model_name} ({model.num_parameters():,} parameters, context "
          f"{model.config.context_length}) on http://{args.host}:{args.port} - playground at /, API at /v1"
          f"{', API key required' if api_key else ''}", file=sys.stderr, flush=True)

    class Server(uvicorn.Server):
        """On SIGTERM (or Ctrl-C) the engine stops first: every in-flight sequence gets a `Failed("shutdown")`, so
        each open stream ends with a final error event and each waiting request with a 503; uvicorn meanwhile
        stops accepting connections and waits (up to 10 s) for the open ones to finish, and the process exits 0.
        uvicorn re-raises the signal it caught to the handler installed before it: one that ignores it."""

        def handle_exit(self, sig, frame) -> None:
            engine.request_stop()  # sets a flag only: safe in a signal handler
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="off",
                            timeout_graceful_shutdown=10.0)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.close()
    return 0


def off_the_main_thread(work: Callable[[], T]) -> T:
    """`work()` run on a thread that ends with it: its torch ops leave no OpenMP thread team behind.

    GNU OpenMP keeps a team of workers for every thread that ran a parallel op; once the teams outnumber the
    cores it puts workers to sleep after each op, and every small op of the engine thread pays a wake-up
    (docs/serving.md). A team ends with its thread, so the main thread (uvicorn's) runs no parallel torch op."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="scratchlm-load") as pool:
        return pool.submit(work).result()


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False
