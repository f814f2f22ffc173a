"""Benchmark: BPE training, ours vs Hugging Face ``tokenizers`` (BpeTrainer + ByteLevel), same cores.

Each contender trains in a fresh subprocess (wall time and peak RSS of its whole process tree), alternating
ours/rival, on the shared TinyStories and OpenWebText samples at vocab 10k and on fixtures/corpus.en at 500.
Then ours is timed phase by phase on TinyStories to extrapolate to the full 2.1 GB TinyStories train file:
counting scales with bytes; merging scales with the distinct pre-tokens, whose growth is fitted with Heaps'
law (distinct = K * bytes^beta) from the first half of the file and the whole file.

    .venv/bin/python benchmarks/bench_bpe_train.py            # 3 rounds each
    .venv/bin/python benchmarks/bench_bpe_train.py --quick    # 1 round, TinyStories and corpus.en only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from harness import interleave_commands, python_command, report, run_measured
from scratchlm.paths import shared_data_file
from scratchlm.tokenizer.counting import DEFAULT_CHUNK_BYTES

EOT = "<|endoftext|>"
FULL_TINYSTORIES_BYTES = 2_227_753_162  # TinyStoriesV2-GPT4-train.txt
CASES = [("tinystories/TinyStories-train.txt", 10_000), ("openwebtext/owt_sample_train.txt", 10_000),
         ("fixtures/corpus.en", 500)]

OURS = """
from scratchlm.tokenizer.train_bpe import train_bpe
train_bpe({path!r}, {vocab}, [{eot!r}], num_workers={workers})
"""
HF = """
import os
os.environ["RAYON_NUM_THREADS"] = "{workers}"
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
tokenizer = Tokenizer(models.BPE())
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
trainer = trainers.BpeTrainer(vocab_size={vocab}, special_tokens=[{eot!r}], show_progress=False,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tokenizer.train([{path!r}], trainer)
"""
PHASES = """
import json, time
from scratchlm.tokenizer.counting import count_pretokens
from scratchlm.tokenizer.train_bpe import train_bpe_from_counts
start = time.perf_counter()
counts = count_pretokens([{path!r}], [{eot!r}], num_workers={workers})
counted = time.perf_counter()
train_bpe_from_counts(counts, {vocab}, [{eot!r}])
print(json.dumps({{"count_s": counted - start, "merge_s": time.perf_counter() - counted, "distinct": len(counts)}}))
"""


def compare(relative: str, vocab: int, workers: int, repeats: int) -> dict | None:
    path = shared_data_file(relative)
    if path is None:
        print(f"skipping {relative}: shared data not found")
        return None
    fill = {"path": str(path), "vocab": vocab, "eot": EOT, "workers": workers}
    commands = {"scratchlm": python_command(OURS.format(**fill)), "hf-tokenizers": python_command(HF.format(**fill))}
    size_mb = path.stat().st_size / 1e6
    # A run under 0.1 s moves by +-15% with the machine: five times the rounds (still under 2 s) steady the medians.
    results = interleave_commands(commands, repeats * 5 if size_mb < 1 else repeats)
    return report(f"train BPE vocab {vocab} on {relative} ({size_mb:.1f} MB, {workers} workers)", results,
                  "scratchlm", "hf-tokenizers", unit_work=size_mb, unit="MB")


def _phase_run(path: str, vocab: int, workers: int) -> tuple[dict, float]:
    code = PHASES.format(path=path, vocab=vocab, eot=EOT, workers=workers)
    _, peak_mb, stdout = run_measured(python_command(code))
    return json.loads(stdout.strip().splitlines()[-1]), peak_mb


def extrapolate_full_tinystories(workers: int, tmp_dir: str) -> dict | None:
    path = shared_data_file("tinystories/TinyStories-train.txt")
    if path is None:
        return None
    data = path.read_bytes()
    half_path = os.path.join(tmp_dir, "tinystories_half.txt")
    with open(half_path, "wb") as handle:
        handle.write(data[: data.index(EOT.encode(), len(data) // 2)])
    half, _ = _phase_run(half_path, 10_000, workers)
    whole, peak_mb = _phase_run(str(path), 10_000, workers)
    beta = math.log(whole["distinct"] / half["distinct"]) / math.log(len(data) / os.path.getsize(half_path))
    scale = FULL_TINYSTORIES_BYTES / len(data)
    distinct_full = whole["distinct"] * scale**beta
    count_s = whole["count_s"] * scale
    merge_s = whole["merge_s"] * distinct_full / whole["distinct"]
    # Memory: on the full file every worker holds an 8 MiB chunk. One process counting this whole file as a
    # single chunk measures that (scaled up to 8 MiB); add one per worker to the measured tree peak, plus the
    # pre-token table growing with the distinct words (~200 B per word: Counter entry, tuple, pairs, index).
    _, one_chunk_mb = _phase_run(str(path), 10_000, 1)
    worker_mb = one_chunk_mb * DEFAULT_CHUNK_BYTES / len(data)
    memory_mb = peak_mb + workers * worker_mb + (distinct_full - whole["distinct"]) * 200 / 1e6
    summary = {"count_s": count_s, "merge_s": merge_s, "total_min": (count_s + merge_s) / 60, "beta": beta,
               "distinct_full": distinct_full, "peak_mb_estimate": memory_mb}
    print("\n## extrapolation to the full TinyStories train file (2.2 GB)")
    print(f"measured on {len(data) / 1e6:.1f} MB: count {whole['count_s']:.2f} s, merge {whole['merge_s']:.2f} s, "
          f"{whole['distinct']} distinct pre-tokens, peak RSS {peak_mb:.0f} MB")
    print(f"Heaps' law beta = {beta:.2f} -> ~{distinct_full:,.0f} distinct pre-tokens")
    print(f"estimate: count {count_s:.0f} s + merge {merge_s:.0f} s = {summary['total_min']:.1f} min "
          f"(target <= 10 min), peak RSS ~{memory_mb:.0f} MB (target <= 8192 MB)")
    print("JSON " + json.dumps(summary))
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round; skip the OpenWebText sample")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    cases = [case for case in CASES if not (args.quick and "openwebtext" in case[0])]
    start = time.perf_counter()
    print(f"load average before the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for relative, vocab in cases:
        compare(relative, vocab, args.workers, repeats)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp_dir:
        extrapolate_full_tinystories(args.workers, tmp_dir)
    print(f"\n(benchmark took {time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
