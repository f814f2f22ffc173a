"""The serving engine alone, in this process (no HTTP), on bench_serve's loads, beside the server on the same loads:
how far continuous batching itself scales on this machine, and where the engine's time goes.

    .venv/bin/python benchmarks/bench_engine.py                # tinystories-17m (random), 1 and 8 clients x 8
    .venv/bin/python benchmarks/bench_engine.py --quick        # the tiny preset, 1 and 2 clients x 2
    .venv/bin/python benchmarks/bench_engine.py --no-server    # the engine only

Issue 24's load target, 8 clients >= 4x one client's total tokens/s, is a property of the engine before it is one
of the server: no HTTP can scale better than the engine under it. This runs bench_serve's loads (its random model,
prompt and max_tokens, a seed per request, N client threads taking the next request from one shared list) on an
`Engine` in this process, its model loaded on a thread of its own as `scratchlm serve` loads it, and then on the
server (bench_serve's measurement, a real process over loopback) in the same run. For each engine load it splits
the engine thread's time:
- steps: the decoding steps' forward passes (one new token a row);
- prefills: the joining requests (their prompt's forward pass, first token, copy into the batch);
- other: sampling, emitting, the batch's bookkeeping (rows leaving, compaction);
- idle: waiting for requests;
and reports "steps only", the tokens/s the steps' forward passes alone would allow, every other cost removed: the
ceiling of the 8/1 ratio on this machine whatever the server and the engine's bookkeeping do.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve  # noqa: E402  (a sibling script)
from harness import machine_line  # noqa: E402
from scratchlm.generate.engine import Engine, Failed, Finished, Sampling, Sequence  # noqa: E402
from scratchlm.serve.commands import off_the_main_thread  # noqa: E402
from scratchlm.train.checkpoint import load_for_inference  # noqa: E402
from scratchlm.train.tokenizer_identity import tokenizer_for_run  # noqa: E402


class EngineClock:
    """Seconds the engine thread spent in each part of its work, by wrapping the engine's own methods (set on the
    instance after start(): the thread looks them up at every call)."""

    def __init__(self, engine: Engine) -> None:
        self.seconds = {"steps": 0.0, "prefills": 0.0, "busy": 0.0}
        self._prefilling = False  # a one-token prompt's forward is no decoding step
        self._stepping = False
        forward, prefill, step = engine._forward, engine._prefill, engine._step

        def timed_prefill(sequence: Sequence) -> None:
            self._prefilling = True
            try:
                self._time("prefills", prefill, sequence)
            finally:
                self._prefilling = False

        def timed_step() -> None:
            self._stepping = True
            try:
                self._time("busy", step)
            finally:
                self._stepping = False

        engine._forward = lambda ids, cache: self._time(None if self._prefilling else "steps", forward, ids, cache)
        engine._prefill = timed_prefill
        engine._step = timed_step
        self._engine = engine

    def _time(self, part: str | None, work: Callable, *args) -> object:
        started = time.perf_counter()
        try:
            return work(*args)
        finally:
            if part is not None:
                self.seconds[part] += time.perf_counter() - started

    def wait_until_idle(self) -> None:
        """Until the engine has no rows and is in no step. A load's last client is answered during a step, and
        the engine then drops its row in one more: that time is the load's, not the next one's."""
        while self._stepping or self._engine.stats()["active"] or self._engine.stats()["waiting"]:
            time.sleep(0.0005)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)


def one_request(engine: Engine, prompt: list[int], max_tokens: int, seed: int) -> tuple[float, int]:
    """(latency s, completion tokens) of one request, submitted and waited for; raises if it failed."""
    done = threading.Event()
    ended: list[Finished | Failed] = []

    def emit(event: object) -> None:
        if isinstance(event, (Finished, Failed)):
            ended.append(event)
            done.set()

    started = time.perf_counter()
    engine.submit([Sequence(prompt, Sampling(max_tokens=max_tokens, temperature=1.0, seed=seed), emit)])
    done.wait()
    if isinstance(ended[0], Failed):
        raise RuntimeError(ended[0].message)
    return time.perf_counter() - started, ended[0].completion_tokens


def engine_load(engine: Engine, prompt: list[int], clients: int, requests: int, max_tokens: int,
                clock: EngineClock) -> dict:
    """bench_serve.load's load, submitted to the engine: `clients` threads, each sending the next of the shared
    list's requests (temperature 1, seed = its index) as its previous one ends."""
    seeds = iter(range(clients * requests))
    lock = threading.Lock()
    tokens, latencies = [], []

    def client_loop() -> None:
        while True:
            with lock:
                seed = next(seeds, None)
            if seed is None:
                return
            latency, completion = one_request(engine, prompt, max_tokens, seed)
            with lock:
                latencies.append(latency)
                tokens.append(completion)

    clock.reset()
    steps_before = engine.steps
    started = time.perf_counter()
    bench_serve.run_clients(clients, client_loop)
    clock.wait_until_idle()
    seconds = time.perf_counter() - started
    parts = clock.seconds
    return {"clients": clients, "requests": clients * requests, "seconds": seconds, "tokens": sum(tokens),
            "tokens_per_s": sum(tokens) / seconds, "tokens_per_request": sum(tokens) / len(tokens),
            "tokens_per_step": sum(tokens) / max(engine.steps - steps_before, 1),
            "p50_s": bench_serve.quantile(latencies, 50), "p95_s": bench_serve.quantile(latencies, 95),
            "steps_s": parts["steps"], "prefills_s": parts["prefills"],
            "other_s": parts["busy"] - parts["steps"] - parts["prefills"],
            "idle_s": seconds - parts["busy"], "steps_only_tokens_per_s": sum(tokens) / parts["steps"]}


def measure_engine(run: Path, clients: list[int], requests: int, max_tokens: int) -> list[dict]:
    """Load the run as `scratchlm serve` does (off the main thread: see off_the_main_thread), warm up, run the
    loads, close."""
    model, config = off_the_main_thread(lambda: load_for_inference(run, device="cpu"))
    tokenizer = tokenizer_for_run(run, config, None)
    engine = Engine(model, tokenizer, eos_id=tokenizer.special_id("<|endoftext|>")).start()
    try:
        clock = EngineClock(engine)
        prompt = tokenizer.encode(bench_serve.PROMPT)
        engine_load(engine, prompt, 1, 2, max_tokens, clock)  # warm-up, as bench_serve's
        return [engine_load(engine, prompt, n, requests, max_tokens, clock) for n in clients]
    finally:
        engine.close()


def print_engine(results: list[dict]) -> None:
    print(f"{'clients':>7} {'requests':>8} {'tokens/s':>9} {'tok/req':>7} {'tok/step':>8} {'p50 s':>7} "
          f"{'p95 s':>7} {'steps':>6} {'prefills':>8} {'other':>6} {'idle':>5} {'steps only tok/s':>16}")
    for r in results:
        share = {part: r[f"{part}_s"] / r["seconds"] for part in ("steps", "prefills", "other", "idle")}
        print(f"{r['clients']:>7} {r['requests']:>8} {r['tokens_per_s']:>9.1f} {r['tokens_per_request']:>7.1f} "
              f"{r['tokens_per_step']:>8.2f} {r['p50_s']:>7.3f} {r['p95_s']:>7.3f} {share['steps']:>6.0%} "
              f"{share['prefills']:>8.0%} {share['other']:>6.0%} {share['idle']:>5.0%} "
              f"{r['steps_only_tokens_per_s']:>16.1f}")


def ratios(results: list[dict], key: str) -> str:
    single = next((r for r in results if r["clients"] == 1), None)
    if single is None:
        return "-"
    return ", ".join(f"{r['clients']}/1 {r[key] / single[key]:.2f}x" for r in results if r["clients"] > 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_serve.add_load_arguments(parser)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help=f"torch CPU threads of the engine and the server (default: {torch.get_num_threads()})")
    parser.add_argument("--no-server", action="store_true", help="only the engine, not the server beside it")
    args = parser.parse_args()
    print(machine_line(), flush=True)
    preset, clients, requests, max_tokens = bench_serve.load_settings(args)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="bench-engine-") as folder:
        # Written off the main thread too: the main thread must run no parallel torch op (off_the_main_thread).
        run = off_the_main_thread(lambda: bench_serve.write_random_run(preset, Path(folder)))
        engine = measure_engine(run, clients, requests, max_tokens)
        server, code = ([], 0) if args.no_server else bench_serve.measure_ours(
            run, bench_serve.server_env(args.threads), clients, requests, max_tokens, [])
    print(f"bench_engine: {preset}, {max_tokens} tokens per request, {args.threads} torch threads")
    print("\nThe engine in process (no HTTP); steps / prefills / other / idle: shares of the load's time")
    print_engine(engine)
    print(f"engine: {ratios(engine, 'tokens_per_s')}; its steps only (the ceiling): "
          f"{ratios(engine, 'steps_only_tokens_per_s')}")
    if server:
        print(f"\nThe server on the same loads (bench_serve; exit code {code})")
        bench_serve.print_table([("scratchlm", r) for r in server])
        print(f"server: {ratios(server, 'tokens_per_s')}; server / engine tokens/s: " + ", ".join(
            f"{s['clients']} clients {s['tokens_per_s'] / e['tokens_per_s']:.2f}x" for s, e in zip(server, engine)))
    if code != 0 or any(r["errors"] for r in server):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
