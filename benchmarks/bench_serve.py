"""Load on `scratchlm serve`: N concurrent clients x M requests each, on loopback, against a real server process.

    .venv/bin/python benchmarks/bench_serve.py                 # tinystories-17m (random), 1 and 8 clients x 8
    .venv/bin/python benchmarks/bench_serve.py --quick         # the tiny preset, 1 and 2 clients x 2 (a smoke run)
    .venv/bin/python benchmarks/bench_serve.py --clients 1 4 16 --requests 4 --max-tokens 128 --json out.json

The server is `python -m scratchlm serve RUN` on a fresh run holding a random model (the preset's shape) and a
byte-level tokenizer, started once for all loads. Each client sends its requests one after another (streamed,
temperature 1, a different seed each), and every load stops by itself after N x M requests. Reported per load:
p50/p95 request latency and time to first token, total completion tokens/s, the error count (the target is 0)
and the server's RSS: its peak, and its growth from after the warm-up to the end (bounded: the batch's caches
are freed as requests leave). Target (issue 24): 8 clients >= 4x the total tokens/s of 1 client, which is what
continuous batching buys: one forward pass decodes every active request.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import torch

from scratchlm.compat.commands import write_run
from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.tokenizer import Tokenizer

SRC = Path(__file__).resolve().parents[1] / "src"
PROMPT = "Once upon a time, in a small village by the sea, there lived"


def write_random_run(preset: str, folder: Path) -> Path:
    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    torch.manual_seed(0)
    shape = ModelConfig.preset(preset)
    # At least 256 positions: the tiny preset's 32 would not hold the prompt and a completion.
    model = TransformerLM(ModelConfig.preset(preset, vocab_size=max(shape.vocab_size, tokenizer.vocab_size),
                                             context_length=max(shape.context_length, 256))).eval()
    write_run(model, tokenizer, folder / "run")
    return folder / "run"


def start_server(run: Path, port: int, extra: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen([sys.executable, "-m", "scratchlm", "serve", str(run), "--port", str(port),
                                "--log-level", "warning", *extra], env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit("the server did not come up within 300 s")


class RSSSampler:
    """Samples a process's RSS every 20 ms in a thread; `peak` since the last `reset`."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> int:
        return self.process.memory_info().rss

    def reset(self) -> None:
        self.peak = self.now()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.now())

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def one_request(client: httpx.Client, url: str, max_tokens: int, seed: int) -> tuple[float, float, int]:
    """(latency s, time to first token s, completion tokens) of one streamed request; raises on any error."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = None
    tokens = None
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()[:200]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if first is None and event["choices"]:
                first = time.perf_counter() - started
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if tokens is None:
        raise RuntimeError("the stream ended without its usage chunk")
    return time.perf_counter() - started, first or 0.0, tokens


def load(url: str, clients: int, requests: int, max_tokens: int, rss: RSSSampler) -> dict:
    latencies, firsts, tokens, errors = [], [], [], []
    lock = threading.Lock()

    def client_loop(client_index: int) -> None:
        with httpx.Client(timeout=600) as client:
            for request in range(requests):
                try:
                    result = one_request(client, url, max_tokens, seed=client_index * 1000 + request)
                except Exception as error:  # counted and reported: the load goes on
                    with lock:
                        errors.append(f"{type(error).__name__}: {error}")
                    continue
                with lock:
                    latencies.append(result[0])
                    firsts.append(result[1])
                    tokens.append(result[2])

    rss.reset()
    start_rss = rss.now()
    started = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started

    def quantile(xs: list[float], q: int) -> float:
        if len(xs) < 2:
            return xs[0] if xs else float("nan")
        return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]

    return {"clients": clients, "requests": clients * requests, "seconds": seconds,
            "tokens": sum(tokens), "tokens_per_s": sum(tokens) / seconds,
            "p50_s": quantile(latencies, 50), "p95_s": quantile(latencies, 95),
            "ttft_p50_s": quantile(firsts, 50), "ttft_p95_s": quantile(firsts, 95),
            "errors": len(errors), "error_examples": errors[:3],
            "peak_rss_mb": rss.peak / 2**20, "rss_growth_mb": (rss.now() - start_rss) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny preset, 1 and 2 clients x 2 requests")
    parser.add_argument("--preset", default=None, help="model shape (default: tinystories-17m; --quick: tiny)")
    parser.add_argument("--clients", type=int, nargs="+", default=None, help="loads to run (default: 1 8)")
    parser.add_argument("--requests", type=int, default=None, help="requests per client (default: 8)")
    parser.add_argument("--max-tokens", type=int, default=None, help="per request (default: 128; --quick: 16)")
    parser.add_argument("--server-arg", action="append", default=[], help="extra `scratchlm serve` argument")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    preset = args.preset or ("tiny" if args.quick else "tinystories-17m")
    clients = args.clients or ([1, 2] if args.quick else [1, 8])
    requests = args.requests or (2 if args.quick else 8)
    max_tokens = args.max_tokens or (16 if args.quick else 128)

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as folder, socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        run = write_random_run(preset, Path(folder))
        server = start_server(run, port, args.server_arg)
        url = f"http://127.0.0.1:{port}"
        rss = RSSSampler(server.pid)
        try:
            load(url, 1, 2, max_tokens, rss)  # warm-up: first allocations, kernels, the event loop
            results = [load(url, n, requests, max_tokens, rss) for n in clients]
        finally:
            rss.close()
            server.send_signal(signal.SIGTERM)
            code = server.wait(60)
    print(f"bench_serve: {preset}, {max_tokens} tokens per request, prompt {len(PROMPT.encode())} tokens, "
          f"server exit code {code}")
    print(f"{'clients':>7} {'requests':>8} {'tokens/s':>9} {'p50 s':>7} {'p95 s':>7} {'ttft p50':>8} "
          f"{'ttft p95':>8} {'errors':>6} {'peak RSS MB':>11} {'RSS growth MB':>13}")
    for r in results:
        print(f"{r['clients']:>7} {r['requests']:>8} {r['tokens_per_s']:>9.1f} {r['p50_s']:>7.3f} {r['p95_s']:>7.3f} "
              f"{r['ttft_p50_s']:>8.3f} {r['ttft_p95_s']:>8.3f} {r['errors']:>6} {r['peak_rss_mb']:>11.1f} "
              f"{r['rss_growth_mb']:>13.1f}")
        for example in r["error_examples"]:
            print(f"        error: {example}")
    single = next((r for r in results if r["clients"] == 1), None)
    for r in results:
        if single and single["tokens_per_s"] and r["clients"] > 1:
            ratio = r["tokens_per_s"] / single["tokens_per_s"]
            print(f"{r['clients']} clients / 1 client, total tokens/s: {ratio:.2f}x"
                  + (" (target >= 4x)" if r["clients"] == 8 else ""))
    if args.json:
        args.json.write_text(json.dumps({"preset": preset, "max_tokens": max_tokens, "results": results}, indent=2))
    if any(r["errors"] for r in results) or code != 0:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
