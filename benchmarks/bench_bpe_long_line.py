"""Benchmark: BPE on one very long line of letters (ONE GPT-2 pre-token, like a line of DNA or base64).

A 1 MB and a 50 MB line of random lowercase letters (seeded) are trained at vocab 1000 and encoded with the
tokenizer trained on the 1 MB line. Every run is a fresh subprocess that reports its wall time and its peak RSS
(``ru_maxrss`` of itself and, separately, of its largest finished child: the counting workers) and CPU seconds
(its own and its children's, the whole process: on a busy machine the wall time says little). Rivals, on the
1 MB line only: Hugging Face ``tokenizers`` trains under a time cap (it is itself pathological here and is
reported as "> cap" when it hits it), and tiktoken, built from our merges, encodes (its ids are compared with ours).

    .venv/bin/python benchmarks/bench_bpe_long_line.py                 # 1 MB and 50 MB (the 50 MB runs take minutes)
    .venv/bin/python benchmarks/bench_bpe_long_line.py --sizes-mb 1    # the 1 MB line only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import machine_line, python_command

VOCAB = 1000
LETTERS = "abcdefghijklmnopqrstuvwxyz"
TARGETS = {1: (10, 1024), 50: (300, 1024)}  # size MB -> (train seconds, peak MB)
ENCODE_PEAK_TARGET_MB = 1024

PEAK = """
import json, resource
def _peaks():
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {{"self_mb": own.ru_maxrss / 1024, "children_mb": children.ru_maxrss / 1024,
             "cpu_s": own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime}}
"""
OURS_TRAIN = PEAK + """
import time
from scratchlm.tokenizer import Tokenizer
from scratchlm.tokenizer.train_bpe import train_bpe
start = time.perf_counter()
vocab, merges = train_bpe({path!r}, {vocab}, [])
seconds = time.perf_counter() - start
if {save!r}:
    Tokenizer(vocab, merges).save({save!r})
print(json.dumps({{"seconds": seconds, "merges": len(merges), **_peaks()}}))
"""
HF_TRAIN = PEAK + """
import time
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
start = time.perf_counter()
tokenizer = Tokenizer(models.BPE())
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
trainer = trainers.BpeTrainer(vocab_size={vocab}, show_progress=False,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tokenizer.train([{path!r}], trainer)
print(json.dumps({{"seconds": time.perf_counter() - start, **_peaks()}}))
"""
OURS_ENCODE = PEAK + """
import time
from scratchlm.tokenizer import Tokenizer
tokenizer = Tokenizer.load({tokenizer!r})
with open({path!r}, encoding="utf-8") as handle:
    text = handle.read()
start = time.perf_counter()
ids = tokenizer.encode(text)
seconds = time.perf_counter() - start
if {ids_out!r}:
    import array
    array.array("i", ids).tofile(open({ids_out!r}, "wb"))
print(json.dumps({{"seconds": seconds, "tokens": len(ids), **_peaks()}}))
"""
TIKTOKEN_ENCODE = PEAK + """
import array, time, tiktoken
from tiktoken_ext.openai_public import r50k_pat_str
from scratchlm.tokenizer import Tokenizer
tokenizer = Tokenizer.load({tokenizer!r})
encoding = tiktoken.Encoding("long-line", pat_str=r50k_pat_str,
                             mergeable_ranks={{token: i for i, token in tokenizer.vocab.items()}}, special_tokens={{}})
with open({path!r}, encoding="utf-8") as handle:
    text = handle.read()
start = time.perf_counter()
ids = encoding.encode_ordinary(text)
seconds = time.perf_counter() - start
ours = array.array("i")
with open({ids_out!r}, "rb") as handle:
    ours.frombytes(handle.read())
print(json.dumps({{"seconds": seconds, "tokens": len(ids), "identical": list(ours) == ids, **_peaks()}}))
"""


def write_line(path: Path, size_mb: int) -> None:
    """size_mb million random lowercase letters (seed 0), no newline: one GPT-2 pre-token."""
    rng = random.Random(0)
    with open(path, "w", encoding="ascii") as handle:
        for _ in range(size_mb):
            handle.write("".join(rng.choices(LETTERS, k=1_000_000)))


def run(code: str, timeout: float | None = None) -> dict | None:
    """Run a snippet in a fresh interpreter; its last stdout line is JSON. None when it ran past timeout."""
    try:
        done = subprocess.run(python_command(code), capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0:
        raise RuntimeError(f"benchmark snippet failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def peak_mb(result: dict) -> float:
    return max(result["self_mb"], result["children_mb"])


def median_run(code: str, repeats: int) -> dict:
    """The run with the median time of `repeats` runs (peak RSS: the largest seen)."""
    results = sorted((run(code) for _ in range(repeats)), key=lambda result: result["seconds"])
    median = dict(results[len(results) // 2])
    median["seconds_all"] = [round(result["seconds"], 2) for result in results]
    median["peak_mb"] = max(map(peak_mb, results))
    return median


def row(name: str, result: dict | None, cap: float | None = None) -> str:
    if result is None:
        return f"| {name} | > {cap:.0f} (cap) | - | - |"
    runs = result.get("seconds_all", [round(result["seconds"], 2)])
    return (f"| {name} | {statistics.median(runs):.2f} ({', '.join(map(str, runs))}) | {result['cpu_s']:.1f} | "
            f"{result['peak_mb']:.0f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 50])
    parser.add_argument("--repeats", type=int, default=3, help="runs of ours on lines under 10 MB (median)")
    parser.add_argument("--hf-cap", type=float, default=120.0, help="seconds before HF tokenizers is stopped")
    args = parser.parse_args()
    print(machine_line(), flush=True)
    start = time.perf_counter()
    print(f"load average before the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    summary: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = os.path.join(tmp, "tok-1mb")
        for size_mb in sorted(args.sizes_mb):
            path = Path(tmp) / f"line-{size_mb}mb.txt"
            write_line(path, size_mb)
            repeats = args.repeats if size_mb < 10 else 1
            first = not os.path.exists(tokenizer_dir)
            fill = {"path": str(path), "vocab": VOCAB}
            train = median_run(OURS_TRAIN.format(**fill, save=tokenizer_dir if first else ""), repeats)
            ids_out = os.path.join(tmp, f"ids-{size_mb}.bin") if size_mb < 10 else ""
            encode = median_run(OURS_ENCODE.format(path=str(path), tokenizer=tokenizer_dir, ids_out=ids_out), repeats)
            print(f"\n## one line of {size_mb} MB of random letters: train at vocab {VOCAB}, encode "
                  f"(tokenizer trained on the 1 MB line)")
            print("| run | seconds: median (all) | CPU s (median run, whole process) | peak RSS MB (largest process) |")
            print("|---|---:|---:|---:|")
            print(row(f"scratchlm train ({train['merges']} merges)", train))
            case = {"train": train, "encode": encode}
            if size_mb < 10:
                hf = run(HF_TRAIN.format(**fill), timeout=args.hf_cap)
                if hf is not None:
                    hf["peak_mb"] = peak_mb(hf)
                print(row("hf-tokenizers train", hf, args.hf_cap))
                case["hf_train"] = hf
            print(row(f"scratchlm encode ({encode['tokens']:,} tokens)", encode))
            if ids_out:
                tik = run(TIKTOKEN_ENCODE.format(path=str(path), tokenizer=tokenizer_dir, ids_out=ids_out))
                tik["peak_mb"] = peak_mb(tik)
                print(row(f"tiktoken encode (ids identical to ours: {tik['identical']})", tik))
                case["tiktoken_encode"] = tik
            train_target_s, train_target_mb = TARGETS.get(size_mb, (None, None))
            if train_target_s is not None:
                train_met = train["seconds"] < train_target_s and train["peak_mb"] < train_target_mb
                encode_met = encode["peak_mb"] < ENCODE_PEAK_TARGET_MB
                print(f"targets: train < {train_target_s} s and < {train_target_mb} MB: "
                      f"{'met' if train_met else 'NOT met'}; encode < {ENCODE_PEAK_TARGET_MB} MB: "
                      f"{'met' if encode_met else 'NOT met'}")
            summary[f"{size_mb}mb"] = case
    print("JSON " + json.dumps(summary))
    print(f"\n(benchmark took {time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
