"""Load on `scratchlm serve`: N concurrent clients x M requests each, on loopback, against a real server process;
with `--rival transformers`, the same loads on Hugging Face's `transformers serve` of the same model, side by side.

    .venv/bin/python benchmarks/bench_serve.py                 # tinystories-17m (random), 1 and 8 clients x 8
    .venv/bin/python benchmarks/bench_serve.py --quick         # the tiny preset, 1 and 2 clients x 2 (a smoke run)
    .venv/bin/python benchmarks/bench_serve.py --clients 1 4 16 --requests 4 --max-tokens 128 --json out.json
    .venv/bin/python benchmarks/bench_serve.py --rival transformers [--threads 1]   # ours vs transformers serve

The server is `python -m scratchlm serve RUN` on a fresh run holding a random model (the preset's shape) and a
byte-level tokenizer, started once for all loads. N clients take the load's N x M requests from one shared list,
each sending its next as its previous one ends (streamed, temperature 1, a different seed each), and every load
stops by itself when the list is done. Reported per load: p50/p95 request latency and time to the first chunk with
text, total completion tokens/s, the mean completion tokens of a request, the share of the load's time with all N
clients busy ("full"), the error count (the target is 0) and the server's RSS: its peak, and its growth from after
the warm-up to the end (bounded: the batch's caches are freed as requests leave). Target (issue 24): 8 clients
>= 4x the total tokens/s of 1 client, which is what continuous batching buys: one forward pass
decodes every active request.

The rival (`--rival transformers`, issue 24's target: ours >= 1.5x its total tokens/s at a p95 latency no worse):
`scratchlm export hf` writes the same run as a transformers folder (LlamaForCausalLM), and `transformers serve
FOLDER` (offline, on the CPU) serves it after ours has run, on the same loads, with the same request bodies to the
same /v1/completions. By default it runs as it does by itself: one `generate()` at a time, which on a CPU was
several times faster than its continuous batching in smoke runs; `--rival-arg=--continuous-batching` turns that
on, with a paged KV cache sized to the load (`--cb-num-blocks`, unless given: twice what the largest load's
requests hold at once; left to itself on a CPU it zero-fills 60% of the machine's RAM, 14 GB here). The protocol:
- both servers get the same torch thread count (OMP_NUM_THREADS = --threads, default torch's choice here, which
  is what each would pick by itself) and their output goes to log files, not the terminal;
- the same prompt text, the same max_tokens, temperature 1, top_p 1, no top-k, the same seed per request (ours
  seeds the request's own generator, transformers seeds torch's global one). Neither server can be told to ignore
  the end of text (no ignore_eos / min_tokens in either), so a request may end early, at the same rate on both:
  tokens/s counts the completion tokens each server reports (usage.completion_tokens), and the table shows their
  mean per request;
- ours samples only the tokenizer's ids (a padded model vocabulary has ids without text); transformers samples
  every id of the model's vocabulary unless told, so the benchmark's copy of the export gets a
  generation_config.json with suppress_tokens = the ids past the tokenizer's, do_sample = true (without it
  transformers decodes greedily whatever the request's temperature) and top_k = 0 (its default is 50): the same
  distribution on both.
transformers serve needs `transformers[serving]` (accelerate, which transformers itself does not pull, is the one
piece the [hf,serve,test] extras lack: the [bench] extra has it); --rival-python runs it from another environment.
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
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import torch

from harness import machine_line
from scratchlm.compat.commands import write_run
from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.tokenizer import Tokenizer

SRC = Path(__file__).resolve().parents[1] / "src"
PROMPT = "Once upon a time, in a small village by the sea, there lived"
CB_PAGE_TOKENS = 256  # transformers' ContinuousBatchingConfig.page_size default
TOKENIZER_VOCAB = 257  # 256 bytes + <|endoftext|>


def write_random_run(preset: str, folder: Path, *, chatml: bool = False) -> Path:
    """A run with a random model of `preset`'s shape and a byte-level tokenizer (with ChatML: a chat model)."""
    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    tokenizer = tokenizer.with_chatml() if chatml else tokenizer
    torch.manual_seed(0)
    shape = ModelConfig.preset(preset)
    # At least 256 positions: the tiny preset's 32 would not hold the prompt and a completion.
    model = TransformerLM(ModelConfig.preset(preset, vocab_size=max(shape.vocab_size, tokenizer.vocab_size),
                                             context_length=max(shape.context_length, 256))).eval()
    write_run(model, tokenizer, folder / "run")
    return folder / "run"


def export_for_transformers(run: Path, out: Path, env: dict[str, str]) -> Path:
    """`scratchlm export hf` of the run, plus the generation_config.json that makes transformers sample as ours does
    (see the protocol above): do_sample, no top-k, and only the tokenizer's ids."""
    subprocess.run([sys.executable, "-m", "scratchlm", "export", "hf", "--checkpoint", str(run), "--out", str(out)],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    config = json.loads((out / "config.json").read_text())
    path = out / "generation_config.json"
    settings = json.loads(path.read_text()) if path.exists() else {
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    settings.update(do_sample=True, top_k=0, suppress_tokens=list(range(TOKENIZER_VOCAB, config["vocab_size"])))
    path.write_text(json.dumps(settings))
    return out


def check_rival_python(python: str) -> str:
    """The transformers and torch versions `python` serves with; exits with one line when it cannot serve."""
    probe = subprocess.run([python, "-c", "import accelerate, fastapi, uvicorn, openai, torch, transformers; "
                                          "print(transformers.__version__, torch.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"--rival transformers: {python} cannot run `transformers serve` ({last}): install "
                         f"'transformers[serving]' there (the [bench] extra), or pass --rival-python with "
                         f"an interpreter that has it")
    transformers_version, torch_version = probe.stdout.split()
    return f"transformers {transformers_version}, torch {torch_version}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(command: list[str], env: dict[str, str], port: int, log: Path) -> subprocess.Popen:
    with log.open("wb") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    # One client for all the polls: httpx.get makes a client each call, ~33 ms of CPU (its TLS context) every
    # 0.2 s, which slowed the server's start-up beside it, and with it the timing of its matmul strategies.
    with httpx.Client(timeout=1) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"{command[:4]} exited with {process.returncode}; its log:\n{tail(log)}")
            try:
                if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    return process
            except httpx.TransportError:
                time.sleep(0.2)
    process.kill()
    raise SystemExit(f"{command[:4]} did not come up within 300 s; its log:\n{tail(log)}")


def tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


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


def stream_events(client: httpx.Client, url: str, route: str, body: dict) -> Iterator[dict]:
    """The JSON events of one streamed request (its `data:` lines up to [DONE]); raises on an HTTP or in-stream
    error."""
    with client.stream("POST", f"{url}{route}", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()[:200]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                raise RuntimeError(error["message"] if isinstance(error, dict) else error)
            yield event


def one_request(client: httpx.Client, url: str, max_tokens: int, seed: int) -> tuple[float, float, int, int]:
    """(latency s, time to first token s, completion tokens, prompt tokens) of one streamed request; raises on any
    error. The body is valid for both servers (transformers serve ignores stream_options and always sends usage)."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = None
    usage = None
    for event in stream_events(client, url, "/v1/completions", body):
        if first is None and any(choice.get("text") for choice in event.get("choices") or []):
            first = time.perf_counter() - started
        if event.get("usage"):
            usage = event["usage"]
    if usage is None:
        raise RuntimeError("the stream ended without its usage chunk")
    return time.perf_counter() - started, first or 0.0, usage["completion_tokens"], usage["prompt_tokens"]


def load(url: str, clients: int, requests: int, max_tokens: int, rss: RSSSampler) -> dict:
    """`clients` threads send the load's clients x requests requests, each taking the next one from a shared list
    as its previous one ends (how vLLM's benchmark_serving holds a --max-concurrency): all `clients` stay busy
    until the list runs out. A fixed list of `requests` per client, as this benchmark had until 2026-12-05, let
    the clients whose requests happened to end early (at <|endoftext|>) go idle while the others finished
    theirs, and the load ended with fewer clients than it is named for. `full_share` is the share of the
    load's time with every client busy."""
    latencies, firsts, tokens, prompt_tokens, errors = [], [], [], set(), []
    lock = threading.Lock()
    pending = iter(range(clients * requests))  # each request's seed is its index
    ran_out: list[float] = []  # when each client found the list empty

    def client_loop() -> None:
        with httpx.Client(timeout=600) as client:
            while True:
                with lock:
                    seed = next(pending, None)
                    if seed is None:
                        ran_out.append(time.perf_counter())
                        return
                try:
                    result = one_request(client, url, max_tokens, seed=seed)
                except Exception as error:  # counted and reported: the load goes on
                    with lock:
                        errors.append(f"{type(error).__name__}: {error}")
                    continue
                with lock:
                    latencies.append(result[0])
                    firsts.append(result[1])
                    tokens.append(result[2])
                    prompt_tokens.add(result[3])

    rss.reset()
    start_rss = rss.now()
    cpu = {"server": rss.process, "client": psutil.Process()}  # the clients are this process's threads
    cpu_before = {name: _cpu_seconds(process) for name, process in cpu.items()}
    started = time.perf_counter()
    run_clients(clients, client_loop)
    seconds = time.perf_counter() - started
    cpu_share = {name: (_cpu_seconds(process) - cpu_before[name]) / seconds for name, process in cpu.items()}
    return {"clients": clients, "requests": clients * requests, "seconds": seconds,
            "tokens": sum(tokens), "tokens_per_s": sum(tokens) / seconds,
            "tokens_per_request": sum(tokens) / len(tokens) if tokens else float("nan"),
            "prompt_tokens": sorted(prompt_tokens),
            "p50_s": quantile(latencies, 50), "p95_s": quantile(latencies, 95),
            "ttft_p50_s": quantile(firsts, 50), "ttft_p95_s": quantile(firsts, 95),
            "full_share": (min(ran_out) - started) / seconds,
            "server_cpu": cpu_share["server"], "client_cpu": cpu_share["client"],
            "errors": len(errors), "error_examples": errors[:3],
            "peak_rss_mb": rss.peak / 2**20, "rss_growth_mb": (rss.now() - start_rss) / 2**20}


def run_clients(clients: int, client_loop: Callable[[], None]) -> None:
    """`client_loop` on `clients` threads at once, until every one has returned."""
    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def quantile(xs: list[float], q: int) -> float:
    """The q-th percentile of xs (NaN for none)."""
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def measure(command: list[str], env: dict[str, str], port: int, log: Path, clients: list[int], requests: int,
            max_tokens: int) -> tuple[list[dict], int]:
    """Start one server, warm it up, run every load on it, stop it: (one result per load, its exit code)."""
    server = start_server(command, env, port, log)
    url = f"http://127.0.0.1:{port}"
    rss = RSSSampler(server.pid)
    try:
        load(url, 1, 2, max_tokens, rss)  # warm-up: first allocations, kernels, the event loop
        results = [load(url, n, requests, max_tokens, rss) for n in clients]
    finally:
        rss.close()
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            code = server.wait()
    return results, code


def server_env(threads: int) -> dict[str, str]:
    """The environment every server runs in: this checkout's source, `threads` torch threads, no hub."""
    return {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def measure_ours(run: Path, env: dict[str, str], clients: list[int], requests: int, max_tokens: int,
                 server_args: list[str]) -> tuple[list[dict], int]:
    """`measure` on `scratchlm serve RUN`, its log beside the run."""
    port = free_port()
    return measure([sys.executable, "-m", "scratchlm", "serve", str(run), "--port", str(port), "--log-level",
                    "warning", *server_args], env, port, run.parent / "scratchlm.log", clients, requests, max_tokens)


def print_table(rows: list[tuple[str, dict]]) -> None:
    print(f"{'server':>12} {'clients':>7} {'requests':>8} {'tokens/s':>9} {'tok/req':>7} {'p50 s':>7} {'p95 s':>7} "
          f"{'ttft p50':>8} {'ttft p95':>8} {'full':>5} {'srv CPU':>7} {'cli CPU':>7} {'errors':>6}"
          f" {'peak RSS MB':>11} {'RSS growth MB':>13}")
    for name, r in rows:
        print(f"{name:>12} {r['clients']:>7} {r['requests']:>8} {r['tokens_per_s']:>9.1f} "
              f"{r['tokens_per_request']:>7.1f} {r['p50_s']:>7.3f} {r['p95_s']:>7.3f} {r['ttft_p50_s']:>8.3f} "
              f"{r['ttft_p95_s']:>8.3f} {r['full_share']:>5.0%} {r['server_cpu']:>7.0%} {r['client_cpu']:>7.0%} "
              f"{r['errors']:>6} {r['peak_rss_mb']:>11.1f} "
              f"{r['rss_growth_mb']:>13.1f}")
        for example in r["error_examples"]:
            print(f"        error: {example}")


def print_scaling(name: str, results: list[dict]) -> None:
    single = next((r for r in results if r["clients"] == 1), None)
    for r in results:
        if single and single["tokens_per_s"] and r["clients"] > 1:
            ratio = r["tokens_per_s"] / single["tokens_per_s"]
            print(f"{name}: {r['clients']} clients / 1 client, total tokens/s: {ratio:.2f}x"
                  + (" (target >= 4x)" if r["clients"] == 8 and name == "scratchlm" else ""))


def print_comparison(ours: list[dict], theirs: list[dict]) -> None:
    for a, b in zip(ours, theirs, strict=True):
        ratio = a["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else float("nan")
        verdict = "no worse" if a["p95_s"] <= b["p95_s"] else "worse"
        print(f"{a['clients']} clients: ours / transformers serve tokens/s {ratio:.2f}x (target >= 1.5x); p95 "
              f"{a['p95_s']:.3f} s vs {b['p95_s']:.3f} s ({verdict}; target: no worse)")


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and the loads: shared with bench_engine.py, which runs the same loads on the engine alone."""
    parser.add_argument("--quick", action="store_true", help="tiny preset, 1 and 2 clients x 2 requests")
    parser.add_argument("--preset", default=None, help="model shape (default: tinystories-17m; --quick: tiny)")
    parser.add_argument("--clients", type=int, nargs="+", default=None, help="loads to run (default: 1 8)")
    parser.add_argument("--requests", type=int, default=None, help="requests per client (default: 8)")
    parser.add_argument("--max-tokens", type=int, default=None, help="per request (default: 128; --quick: 16)")


def load_settings(args: argparse.Namespace) -> tuple[str, list[int], int, int]:
    """(preset, clients of each load, requests per client, max_tokens per request) from add_load_arguments'."""
    preset = args.preset or ("tiny" if args.quick else "tinystories-17m")
    clients = args.clients or ([1, 2] if args.quick else [1, 8])
    requests = args.requests or (2 if args.quick else 8)
    max_tokens = args.max_tokens or (16 if args.quick else 128)
    return preset, clients, requests, max_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_load_arguments(parser)
    parser.add_argument("--threads", type=int, default=None,
                        help=f"torch CPU threads of every server, as OMP_NUM_THREADS (default: torch's choice "
                             f"here, {torch.get_num_threads()})")
    parser.add_argument("--server-arg", action="append", default=[], help="extra `scratchlm serve` argument")
    parser.add_argument("--rival", choices=["transformers"], default=None,
                        help="also run `transformers serve` on the same model and loads, and compare")
    parser.add_argument("--rival-python", default=sys.executable,
                        help="interpreter that runs `transformers serve` (default: this one; it needs "
                             "transformers[serving])")
    parser.add_argument("--rival-arg", action="append", default=[],
                        help="extra `transformers serve` argument, e.g. --rival-arg=--continuous-batching (then "
                             "with --cb-num-blocks sized to the loads unless given)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    print(machine_line(), flush=True)
    preset, clients, requests, max_tokens = load_settings(args)
    threads = args.threads or torch.get_num_threads()
    # Each request holds prompt + max_tokens positions; twice the largest load's worth leaves the scheduler room.
    cache_blocks = 2 * max(clients) * -(-(len(PROMPT.encode()) + max_tokens) // CB_PAGE_TOKENS)
    rival_args = args.rival_arg or []
    if "--continuous-batching" in rival_args and not any(a.startswith("--cb-num-blocks") for a in rival_args):
        rival_args = [*rival_args, "--cb-num-blocks", str(cache_blocks)]
    rival_versions = check_rival_python(args.rival_python) if args.rival else None
    env = server_env(threads)

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as folder:
        run = write_random_run(preset, Path(folder))
        ours, code = measure_ours(run, env, clients, requests, max_tokens, args.server_arg)
        theirs, rival_code = [], 0
        if args.rival:
            model = export_for_transformers(run, Path(folder) / "hf", env)
            port = free_port()
            theirs, rival_code = measure([args.rival_python, "-m", "transformers.cli.transformers", "serve",
                                          str(model), "--port", str(port), "--host", "127.0.0.1", "--device",
                                          "cpu", "--log-level", "error", *rival_args],
                                         env, port, Path(folder) / "transformers.log", clients, requests,
                                         max_tokens)
    prompt_tokens = sorted({n for r in ours + theirs for n in r["prompt_tokens"]})
    print(f"bench_serve: {preset}, {max_tokens} tokens per request, prompt {prompt_tokens} tokens, "
          f"{threads} torch threads, scratchlm serve exit code {code}"
          + (f"; transformers serve {' '.join(rival_args) or '(its defaults)'} ({rival_versions}) exit code "
             f"{rival_code}"
             if args.rival else ""))
    print_table([("scratchlm", r) for r in ours] + [("transformers", r) for r in theirs])
    print_scaling("scratchlm", ours)
    if args.rival:
        print_scaling("transformers", theirs)
        print_comparison(ours, theirs)
    if args.json:
        args.json.write_text(json.dumps({"preset": preset, "max_tokens": max_tokens, "threads": threads,
                                         "results": ours, "rival": args.rival, "rival_args": rival_args,
                                         "rival_versions": rival_versions, "rival_results": theirs}, indent=2))
    # uvicorn re-raises the SIGTERM it shut down on (transformers serve leaves it be): that is a clean stop too.
    if any(r["errors"] for r in ours + theirs) or code != 0 or rival_code not in (0, -signal.SIGTERM):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
