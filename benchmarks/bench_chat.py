"""Chat requests/s on `scratchlm serve`: N concurrent clients each sending POST /v1/chat/completions, on loopback,
against a real server process.

    .venv/bin/python benchmarks/bench_chat.py            # tinystories-17m (random, ChatML), 1 and 8 clients x 8
    .venv/bin/python benchmarks/bench_chat.py --quick    # the tiny preset, 1 and 8 clients x 1 (a smoke run)
    .venv/bin/python benchmarks/bench_chat.py --clients 1 4 16 --requests 4 --max-tokens 64 --json out.json

The server is `python -m scratchlm serve RUN` on a fresh run holding a random model of the preset's shape and a
byte-level tokenizer with ChatML (`Tokenizer.with_chatml`), started once for all loads (bench_serve.py's
machinery: the same start-up, threads and client loop discipline). Each request is a two-message conversation (a
system message and a user turn) streamed with temperature 1 and its own seed; N clients take the load's N x M
requests from one shared list, each sending its next as its previous one ends. A random model seldom ends its turn,
so most replies run to max_tokens: requests/s here is the rate for replies of that length. Reported per load:
requests/s, completion tokens/s, p50/p95 latency and time to the first content delta, and the error count (the
target is 0). The chat route renders the conversation (Jinja2) and then runs the completions code: the difference
from bench_serve.py's tokens/s at the same load is the template's cost.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from bench_serve import (
    free_port,
    quantile,
    run_clients,
    server_env,
    start_server,
    stream_events,
    write_random_run,
)
from harness import machine_line

MESSAGES = [{"role": "system", "content": "You tell short stories for children."},
            {"role": "user", "content": "Tell me a story about a cat who finds a red ball."}]


def one_chat(client: httpx.Client, url: str, max_tokens: int, seed: int) -> tuple[float, float, int]:
    """(latency s, time to the first content delta s, completion tokens) of one streamed chat request."""
    body = {"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first, usage = None, None
    for event in stream_events(client, url, "/v1/chat/completions", body):
        if first is None and any(c["delta"].get("content") for c in event.get("choices") or []):
            first = time.perf_counter() - started
        usage = event.get("usage") or usage
    if usage is None:
        raise RuntimeError("the stream ended without its usage chunk")
    return time.perf_counter() - started, first or 0.0, usage["completion_tokens"]


def chat_load(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    """`clients` threads send clients x requests chat requests from one shared list (bench_serve.load's rule)."""
    latencies, firsts, tokens, errors = [], [], [], []
    lock = threading.Lock()
    pending = iter(range(clients * requests))

    def client_loop() -> None:
        with httpx.Client(timeout=600) as client:
            while True:
                with lock:
                    seed = next(pending, None)
                if seed is None:
                    return
                try:
                    latency, first, count = one_chat(client, url, max_tokens, seed)
                except Exception as error:  # counted and reported: the load goes on
                    with lock:
                        errors.append(f"{type(error).__name__}: {error}")
                    continue
                with lock:
                    latencies.append(latency)
                    firsts.append(first)
                    tokens.append(count)

    started = time.perf_counter()
    run_clients(clients, client_loop)
    seconds = time.perf_counter() - started
    return {"clients": clients, "requests": clients * requests, "seconds": seconds,
            "requests_per_s": len(latencies) / seconds, "tokens_per_s": sum(tokens) / seconds,
            "tokens_per_request": sum(tokens) / len(tokens) if tokens else float("nan"),
            "p50_s": quantile(latencies, 50), "p95_s": quantile(latencies, 95),
            "ttft_p50_s": quantile(firsts, 50), "errors": len(errors), "error_examples": errors[:3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny preset, 1 and 8 clients x 1 request, 8 tokens")
    parser.add_argument("--preset", default=None, help="model shape (default: tinystories-17m; --quick: tiny)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8], help="loads to run (default: 1 8)")
    parser.add_argument("--requests", type=int, default=None, help="requests per client (default: 8; --quick: 1)")
    parser.add_argument("--max-tokens", type=int, default=None, help="per reply (default: 128; --quick: 8)")
    parser.add_argument("--threads", type=int, default=None, help="the server's torch CPU threads")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    print(machine_line(), flush=True)
    preset = args.preset or ("tiny" if args.quick else "tinystories-17m")
    requests = args.requests or (1 if args.quick else 8)
    max_tokens = args.max_tokens or (8 if args.quick else 128)
    threads = args.threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="bench-chat-") as folder:
        run = write_random_run(preset, Path(folder), chatml=True)
        port = free_port()
        server = start_server([sys.executable, "-m", "scratchlm", "serve", str(run), "--port", str(port),
                               "--log-level", "warning"], server_env(threads), port, Path(folder) / "serve.log")
        url = f"http://127.0.0.1:{port}"
        try:
            chat_load(url, 1, 1, max_tokens)  # warm-up: first allocations, the template's compilation
            results = [chat_load(url, clients, requests, max_tokens) for clients in args.clients]
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                code = server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                code = server.wait()
    print(f"bench_chat: {preset}, up to {max_tokens} tokens per reply, {threads} torch threads, "
          f"scratchlm serve exit code {code}")
    print(f"{'clients':>7} {'requests':>8} {'req/s':>7} {'tokens/s':>9} {'tok/req':>7} {'p50 s':>7} {'p95 s':>7} "
          f"{'ttft p50':>8} {'errors':>6}")
    for r in results:
        print(f"{r['clients']:>7} {r['requests']:>8} {r['requests_per_s']:>7.2f} {r['tokens_per_s']:>9.1f} "
              f"{r['tokens_per_request']:>7.1f} {r['p50_s']:>7.3f} {r['p95_s']:>7.3f} {r['ttft_p50_s']:>8.3f} "
              f"{r['errors']:>6}")
        for example in r["error_examples"]:
            print(f"        error: {example}")
    if args.json:
        args.json.write_text(json.dumps({"preset": preset, "max_tokens": max_tokens, "threads": threads,
                                         "results": results}, indent=2))
    if any(r["errors"] for r in results) or code not in (0, -signal.SIGTERM):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
