"""Shared machinery for side-by-side benchmarks: ours and the rival in the same run, interleaved.

Every benchmark times each contender in alternation, the order reversed every other round (ours, rival |
rival, ours | ours, rival | ..., ABBA), so that drift in the machine's load hits both alike and neither always
runs first (after a cold start) or second (after the other warmed caches, or left garbage to collect), then
reports medians and the ratio. Memory is the peak RSS of the whole process tree (a contender that forks
workers is charged for all of them), sampled by a thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil


@dataclass
class Result:
    name: str
    seconds: list[float] = field(default_factory=list)
    peak_rss_mb: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def peak_mb(self) -> float | None:
        return max(self.peak_rss_mb) if self.peak_rss_mb else None


def round_order(names: list[str], round_index: int) -> list[str]:
    """The contenders in the order of round ``round_index``: as given in even rounds, reversed in odd (ABBA)."""
    return names if round_index % 2 == 0 else names[::-1]


def interleave(contenders: dict[str, Callable[[], object]], repeats: int, warmup: int = 1, *,
               setup: dict[str, Callable[[], object]] | None = None) -> dict[str, Result]:
    """Time in-process callables in alternation (ABBA order); returns per-contender wall times (seconds).

    ``setup[name]``, where given, runs untimed before each call of that contender (say, to reset a cache).
    """
    results = {name: Result(name) for name in contenders}
    setup = setup or {}
    for round_index in range(warmup + repeats):
        for name in round_order(list(contenders), round_index):
            fn = contenders[name]
            if name in setup:
                setup[name]()
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if round_index >= warmup:
                results[name].seconds.append(elapsed)
    return results


def _tree_rss(process: psutil.Process) -> int:
    total = 0
    try:
        procs = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += proc.memory_info().rss
    return total


def run_timed(argv: list[str]) -> float:
    """Run a command with nothing else running beside it; return its wall seconds."""
    start = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def run_measured(argv: list[str], interval: float = 0.01) -> tuple[float, float, str]:
    """Run a command; return (wall seconds, peak RSS of its process tree in MB, stdout)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    handle = psutil.Process(proc.pid)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _tree_rss(handle))
            time.sleep(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, _ = proc.communicate()
    elapsed = time.perf_counter() - start
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark command failed ({proc.returncode}): {' '.join(argv)}")
    return elapsed, peak / 2**20, stdout


def interleave_commands(commands: dict[str, list[str]], repeats: int) -> dict[str, Result]:
    """Run whole commands in alternation (ABBA order): timed runs, then one run each for the peak RSS of its tree.

    Memory is sampled in runs of its own because the sampler walks the process table every few milliseconds:
    on 2 cores that steals time from a contender with 2 busy processes, not from a single-threaded one.
    """
    results = {name: Result(name) for name in commands}
    for round_index in range(repeats):
        for name in round_order(list(commands), round_index):
            results[name].seconds.append(run_timed(commands[name]))
    for name, argv in commands.items():
        results[name].peak_rss_mb.append(run_measured(argv)[1])
    return results


def hf_llama(config, hf_state_dict: dict, attention: str, *, strict: bool = True):
    """The rival model: transformers' LlamaForCausalLM of our ModelConfig (compat/hf.py), loaded with weights in
    its names, with the given attention ("eager" or "sdpa"). Its config's use_cache is off: a forward pass would
    otherwise build a DynamicCache (a torch.cat of K and V in every layer) that a training step or a logits check
    never reads; ``generate(use_cache=True)`` still turns it on."""
    from transformers import LlamaForCausalLM

    from scratchlm.compat.hf import to_hf_config

    hf_config = to_hf_config(config, "llama")
    hf_config._attn_implementation = attention
    hf_config.use_cache = False
    model = LlamaForCausalLM(hf_config)
    model.load_state_dict(hf_state_dict, strict=strict)
    return model


def python_command(code: str) -> list[str]:
    """argv that runs a snippet of Python in a fresh interpreter (same venv)."""
    return [sys.executable, "-c", code]


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """This machine's memory bandwidth in bytes/s, as torch copies a `mib` MiB float32 tensor (bytes read +
    written, median of `repeats`): the ceiling of a step that streams its weights from memory."""
    import torch

    source = torch.ones(mib * 2**18)
    target = torch.empty_like(source)
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        target.copy_(source)
        seconds.append(time.perf_counter() - start)
    return 2 * source.nbytes / statistics.median(seconds[1:])


def peak_matmul_flops(dtype: str = "float32", size: int = 2048, repeats: int = 5) -> float:
    """This machine's matrix-product FLOP/s in `dtype` ("float32" or "bfloat16"), at the threads torch has now: a
    (size x size) @ (size x size) `torch.mm` costs 2·size³ FLOPs; the median of `repeats` timed products after one
    warm-up. Large and square, so the product runs at the kernel's best: the ceiling a training step's matmuls can
    approach (the step's are smaller and thinner, and the step has other work besides)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(getattr(torch, dtype))
    b = torch.randn(size, size, generator=generator).to(getattr(torch, dtype))
    out = torch.empty(size, size, dtype=a.dtype)
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        seconds.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(seconds[1:])


# A child process ends by printing its peak RSS in KB: the kernel's high-water mark of its own memory (VmHWM).
# Not getrusage's ru_maxrss: Linux carries the parent's high-water mark into it across the fork (or vfork) and
# exec that start the child, so a child of a benchmark that holds models reports the parent's peak, not its own.
PRINT_PEAK_RSS = """
with open("/proc/self/status", encoding="ascii") as status:
    print("PEAK_RSS_KB", next(line.split()[1] for line in status if line.startswith("VmHWM:")))
"""


def child_peak_rss_mb(code: str) -> float:
    """Run a snippet of Python in a fresh interpreter; its peak RSS in MB, as the child reads it from the kernel at
    its end (VmHWM in /proc/self/status, Linux). Exact, where sampling the RSS every few ms misses transient peaks;
    one contender per child, so no contender pays for another's memory."""
    stdout = subprocess.run(python_command(code + PRINT_PEAK_RSS), capture_output=True, text=True,
                            check=True).stdout
    return int(stdout.rsplit("PEAK_RSS_KB", 1)[1]) / 1024


def machine_line() -> str:
    """The CPU beside every figure: its model, its widest vector ISA (and bf16 arithmetic), what ATEN_CPU_CAPABILITY
    holds torch to, the cores and the load average when measured. Reads /proc/cpuinfo, not torch, so that a
    benchmark whose parent process must stay small can print it."""
    name, flags = "unknown CPU", set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as info:
        for line in info:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    bf16 = ", AVX512-BF16" if "avx512_bf16" in flags else ""
    held = os.environ.get("ATEN_CPU_CAPABILITY")
    held = f", torch held to {held.upper()}" if held else ""
    return (f"machine: {name}, {isa}{bf16}{held}; {os.cpu_count()} cores; load average "
            f"{os.getloadavg()[0]:.2f} (1 min)")


def table(title: str, results: list[Result], unit_work: float | None = None, unit: str = "", *,
          peak: bool = True) -> None:
    """Print a Markdown table of medians (and peak RSS, and work per second) under a heading."""
    print(f"\n## {title}")
    print(machine_line())
    print(f"| contender | median s |{' peak RSS MB |' if peak else ''} {unit + '/s' if unit else ''} |")
    print(f"|---|---:|{'---:|' if peak else ''}---:|")
    for r in results:
        rate = f"{unit_work / r.median:,.1f}" if unit_work else ""
        peak_mb = (f" {r.peak_mb:,.0f} |" if r.peak_mb is not None else " - |") if peak else ""
        print(f"| {r.name} | {r.median:.3f} |{peak_mb} {rate} |")


def paired_ratio(a: Result, b: Result) -> float | None:
    """The median over rounds of a's time / b's time in that round, where both were timed in the same rounds
    (`interleave`); None otherwise."""
    if len(a.seconds) != len(b.seconds) or not a.seconds:
        return None
    return statistics.median(x / y for x, y in zip(a.seconds, b.seconds))


def report(title: str, results: dict[str, Result], ours: str, rival: str, unit_work: float | None = None,
           unit: str = "") -> dict:
    """Print a small table with medians and the ours/rival time ratio (<1 means we are faster)."""
    a, b = results[ours], results[rival]
    ratio = a.median / b.median
    table(title, [a, b], unit_work, unit)
    print(f"time ratio {ours}/{rival} = {ratio:.2f} (<= 1.0 means ours is at least as fast)")
    paired = paired_ratio(a, b)
    if paired is not None:
        print(f"paired: the median of each round's ratio = {paired:.2f} (the two timed side by side in a round see "
              f"the same machine: steadier where its speed drifts between rounds)")
    summary = {"title": title, "ours": ours, "rival": rival, "time_ratio": ratio, "paired_time_ratio": paired,
               "medians_s": {r.name: r.median for r in (a, b)},
               "peak_rss_mb": {r.name: r.peak_mb for r in (a, b)}}
    print("JSON " + json.dumps(summary))
    return summary
