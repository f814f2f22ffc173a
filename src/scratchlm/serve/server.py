"""Run the app under uvicorn, with the shutdown `scratchlm serve` promises on SIGTERM (and Ctrl-C).

On the signal the engine stops first: every in-flight sequence gets a `Failed("shutdown")`, so each open stream
ends with a final error event and each waiting request with a 503; uvicorn meanwhile stops accepting connections
and waits (up to `graceful_seconds`) for the open ones to finish. Then `serve` returns normally, so the process
exits 0. (uvicorn re-raises the signal it caught once it is done, to the handler that was installed before it:
ours, which ignores it, since the shutdown has already happened.)
"""

from __future__ import annotations

import signal
from contextlib import contextmanager

from scratchlm.extras import require
from scratchlm.generate.engine import Engine


def serve(app, engine: Engine, host: str, port: int, *, log_level: str = "info",
          graceful_seconds: float = 10.0) -> None:
    uvicorn = require("uvicorn", "serve", "scratchlm serve")

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            engine.request_stop()  # sets a flag only: safe in a signal handler
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=graceful_seconds)
    with _signal_ignored(signal.SIGTERM):
        Server(config).run()


@contextmanager
def _signal_ignored(signum: int):
    previous = signal.signal(signum, lambda *_: None)
    try:
        yield
    finally:
        signal.signal(signum, previous)
