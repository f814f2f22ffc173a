"""Encoding speed and memory: scratchlm's Tokenizer vs tiktoken (GPT-2 vocab, single thread), side by side.

1. ``encode`` throughput in one process on TinyStories and the OpenWebText sample (interleaved runs). Steady
   state: our caches are warmed on the train text, then both encode the valid text, which the caches have not
   seen verbatim (each of our rounds starts again from caches warmed on train only). Targets: >= 10 MB/s and a
   time ratio ours/tiktoken <= 2.0 (i.e. >= 0.5x tiktoken's speed). Also the cold start: a first pass over the
   train text with empty caches (cleared before each round), against tiktoken on the same text.
2. ``encode_corpus(..., workers=2)`` (what ``scratchlm data encode --workers 2`` runs, called from a minimal
   script to keep the CLI's start-up out) vs a minimal tiktoken single-thread script on the same files, as whole
   commands (start-up, loading the tokenizer and writing included), on the two train texts and then on every
   text file in shared/data (22.6 MB). The tiktoken script loads its ranks as tiktoken loads its own encodings
   (a .tiktoken file), imports nothing else and writes each file's ids as it goes; both outputs are checked
   equal. Target: ours at least as fast (ratio <= 1). A third row runs ``encode_corpus(..., engine="tiktoken")``
   (``data encode --engine tiktoken``: our pipeline with tiktoken encoding in each worker), its output checked
   equal too.
3. ``encode_iterable`` over a >= 100 MB file (TinyStories repeated into a temporary file) read line by line:
   peak RSS growth over the process's RSS before encoding. Target: < 50 MB.

Both tokenizers are built offline from ``shared/data/fixtures/gpt2_{vocab.json,merges.txt}``.
Run: ``.venv/bin/python benchmarks/bench_encode.py [--quick]``.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

import harness
from scratchlm.data.token_file import open_token_file
from scratchlm.paths import describe_search, shared_data_file
from scratchlm.tokenizer import GPT2_SPLIT_PATTERN, Tokenizer

EOT = "<|endoftext|>"
TEXTS = {"TinyStories": "tinystories/TinyStories-train.txt", "OWT sample": "openwebtext/owt_sample_train.txt"}
VALID_TEXTS = {"TinyStories": "tinystories/TinyStories-valid.txt", "OWT sample": "openwebtext/owt_sample_valid.txt"}
ALL_TEXTS = [*TEXTS.values(), *VALID_TEXTS.values(), "state_of_the_union/sotu.txt"]
OURS_COMMAND = "scratchlm encode_corpus (2 procs)"
ENGINE_COMMAND = "scratchlm encode_corpus, engine tiktoken (2 procs)"
RIVAL_COMMAND = "tiktoken (1 thread)"


def shared(relative: str) -> Path:
    path = shared_data_file(relative)
    if path is None:
        sys.exit(f"shared data file {relative!r} not found (looked in: {describe_search()})")
    return path


def gpt2_ranks() -> tuple[dict[bytes, int], dict[str, int]]:
    """GPT-2's mergeable ranks and special tokens, as tiktoken takes them, from the fixture vocab.json."""
    from scratchlm.tokenizer.formats.io import invert_vocab, read_gpt2_files

    vocab, _ = read_gpt2_files(shared("fixtures/gpt2_vocab.json"), shared("fixtures/gpt2_merges.txt"))
    ranks = invert_vocab(vocab)
    return ranks, {EOT: ranks.pop(EOT.encode("utf-8"))}


def offline_tiktoken():
    """tiktoken's GPT-2 Encoding built from the fixture files (no download)."""
    import tiktoken

    ranks, specials = gpt2_ranks()
    return tiktoken.Encoding(name="gpt2-offline", pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks,
                             special_tokens=specials)


def gpt2_tokenizer() -> Tokenizer:
    return Tokenizer.from_files(shared("fixtures/gpt2_vocab.json"), shared("fixtures/gpt2_merges.txt"), [EOT])


def bench_in_process(quick: bool) -> list[dict]:
    ours, rival = gpt2_tokenizer(), offline_tiktoken()
    summaries = []
    for name, relative in TEXTS.items():
        train = shared(relative).read_text(encoding="utf-8")
        valid = shared(VALID_TEXTS[name]).read_text(encoding="utf-8")
        for text in (train, valid):  # checked before timing: the timed rounds reset our caches anyway
            assert ours.encode(text) == rival.encode(text, allowed_special="all"), f"ids differ on {name}"
        steady = _bench_steady_state(name, ours, rival, train, valid, repeats=3 if quick else 9)
        cold = _bench_cold_start(name, ours, rival, train, repeats=2 if quick else 5)
        _print_verdict(name, steady, cold)
        summaries += [steady, cold]
    return summaries


def _bench_steady_state(name: str, ours: Tokenizer, rival, train: str, valid: str, repeats: int) -> dict:
    """Valid text with our caches warmed on the train text of the same corpus: a long corpus's steady state.

    Each of our rounds re-warms from empty caches on train (untimed), so no round sees valid's own words cached
    by an earlier round; tiktoken has no cache to warm.
    """
    def warm_on_train() -> None:
        ours.clear_cache()
        ours.encode(train)

    results = harness.interleave({"scratchlm encode": lambda: ours.encode(valid),
                                  "tiktoken encode": lambda: rival.encode(valid, allowed_special="all")},
                                 repeats, setup={"scratchlm encode": warm_on_train})
    return _summary(f"encode, one process: {name} valid, caches warmed on train", results, valid)


def _bench_cold_start(name: str, ours: Tokenizer, rival, train: str, repeats: int) -> dict:
    """First pass over the train text with our caches emptied before each round: every pre-token runs BPE."""
    results = harness.interleave({"scratchlm encode": lambda: ours.encode(train),
                                  "tiktoken encode": lambda: rival.encode(train, allowed_special="all")},
                                 repeats, setup={"scratchlm encode": ours.clear_cache})
    return _summary(f"cold start, one process: {name} train, empty caches", results, train)


def _summary(title: str, results: dict[str, harness.Result], text: str) -> dict:
    megabytes = len(text.encode("utf-8")) / 1e6
    summary = harness.report(f"{title} ({megabytes:.2f} MB)", results, "scratchlm encode", "tiktoken encode",
                             unit_work=megabytes, unit="MB")
    return {**summary, "mb_per_s": megabytes / results["scratchlm encode"].median,
            "speed_vs_tiktoken": 1 / summary["time_ratio"]}


def _print_verdict(name: str, steady: dict, cold: dict) -> None:
    rate, speed = steady["mb_per_s"], steady["speed_vs_tiktoken"]
    print(f"\n{name} steady state: {rate:.1f} MB/s (target >= 10: {'PASS' if rate >= 10 else 'MISS'}), "
          f"{speed:.2f}x tiktoken (target >= 0.5x: {'PASS' if speed >= 0.5 else 'MISS'})")
    print(f"{name} cold start (empty caches, train text): {cold['mb_per_s']:.1f} MB/s, "
          f"{cold['speed_vs_tiktoken']:.2f}x tiktoken")


# The rival loads its ranks the way tiktoken loads its own encodings (`load_tiktoken_bpe` of a .tiktoken file:
# base64 token and rank per line) and imports nothing of this benchmark's.
TIKTOKEN_SCRIPT = """
import os
os.environ["TIKTOKEN_CACHE_DIR"] = ""  # read the local file as it is
import numpy as np
import tiktoken
from tiktoken.load import load_tiktoken_bpe
encoding = tiktoken.Encoding(name="gpt2-offline", pat_str={pattern!r}, mergeable_ranks=load_tiktoken_bpe({ranks!r}),
                             special_tokens={specials!r})
with open({out!r}, "wb") as out:
    for path in {inputs!r}:
        with open(path, encoding="utf-8") as handle:
            encoding.encode_to_numpy(handle.read(), allowed_special="all").astype(np.uint16).tofile(out)
"""


def write_tiktoken_ranks(ranks: dict[bytes, int], path: Path) -> Path:
    """ranks as a .tiktoken file (base64 token, space, rank per line: what `load_tiktoken_bpe` reads)."""
    path.write_bytes(b"".join(base64.b64encode(token) + b" %d\n" % rank for token, rank in ranks.items()))
    return path


def bench_data_encode(quick: bool, workdir: Path) -> list[dict]:
    """The two training texts; then (full runs) every text file in shared/data, 22.6 MB."""
    tokenizer_dir = gpt2_tokenizer().save(workdir / "gpt2")
    ranks, specials = gpt2_ranks()
    rival = {"pattern": GPT2_SPLIT_PATTERN, "specials": specials, "out": str(workdir / "tiktoken.bin"),
             "ranks": str(write_tiktoken_ranks(ranks, workdir / "gpt2.tiktoken"))}  # TIKTOKEN_SCRIPT's fields
    train_texts = [str(shared(relative)) for relative in TEXTS.values()]
    corpora = [train_texts[:1]] if quick else [train_texts, [str(shared(relative)) for relative in ALL_TEXTS]]
    return [_bench_whole_command(inputs, tokenizer_dir, rival, quick, workdir) for inputs in corpora]


def _bench_whole_command(inputs: list[str], tokenizer_dir: Path, rival_fields: dict, quick: bool,
                         workdir: Path) -> dict:
    megabytes = sum(Path(p).stat().st_size for p in inputs) / 1e6
    # encode_corpus is what `scratchlm data encode` runs; calling it from a minimal script, as the rival is one,
    # keeps the CLI's start-up (which imports every stage) out of the measurement. Like the rival, it adds no EOT.
    def ours(out: str, engine: str) -> list[str]:
        return harness.python_command("from scratchlm.data.encode import encode_corpus\n"
                                      f"encode_corpus({str(tokenizer_dir)!r}, {inputs!r}, {str(workdir / out)!r}, "
                                      f"workers=2, end_of_text=False, engine={engine!r})")
    rival = harness.python_command(TIKTOKEN_SCRIPT.format(inputs=inputs, **rival_fields))
    results = harness.interleave_commands({OURS_COMMAND: ours("ours.tok", "scratchlm"), RIVAL_COMMAND: rival,
                                           ENGINE_COMMAND: ours("engine.tok", "tiktoken")},
                                          repeats=1 if quick else 5)
    rival_ids = np.fromfile(workdir / "tiktoken.bin", dtype=np.uint16)
    for out in ("ours.tok", "engine.tok"):
        assert np.array_equal(open_token_file(workdir / out).tokens, rival_ids), f"{out} differs from the rival's"
    title = f"whole command: encode {len(inputs)} file(s), {megabytes:.1f} MB"
    summary = harness.report(title, results, OURS_COMMAND, RIVAL_COMMAND, unit_work=megabytes, unit="MB")
    harness.report(f"{title}, engine tiktoken", results, ENGINE_COMMAND, RIVAL_COMMAND, unit_work=megabytes, unit="MB")
    return summary


# Peak RSS is reset after loading the tokenizer (Linux: clear_refs 5 resets VmHWM), so loading's own peak is
# not charged to streaming.
RSS_SCRIPT = """
import gc
from pathlib import Path
from scratchlm.tokenizer import Tokenizer
def status(key):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key))
    return int(line.split()[1]) * 1024
tokenizer = Tokenizer.load({tokenizer_dir!r})
gc.collect()
Path("/proc/self/clear_refs").write_text("5")
before = status("VmRSS:")
count = 0
with open({path!r}, encoding="utf-8") as handle:
    for _ in tokenizer.encode_iterable(handle):
        count += 1
print(count, before, status("VmHWM:"))
"""


def bench_streaming_memory(quick: bool, workdir: Path) -> dict:
    story = shared(TEXTS["TinyStories"]).read_bytes()
    target = (20 if quick else 100) * 10**6
    path = workdir / "repeated.txt"
    with open(path, "wb") as handle:
        for _ in range(target // len(story) + 1):
            handle.write(story)
    megabytes = path.stat().st_size / 1e6
    code = RSS_SCRIPT.format(tokenizer_dir=str(workdir / "gpt2"), path=str(path))
    seconds, _, stdout = harness.run_measured(harness.python_command(code))
    count, before, peak = (int(x) for x in stdout.split())
    growth = (peak - before) / 2**20
    print(f"\n## encode_iterable over a {megabytes:.0f} MB file, line by line")
    print(f"{count:,} tokens in {seconds:.1f} s ({megabytes / seconds:.1f} MB/s incl. start-up); "
          f"RSS before {before / 2**20:.0f} MB, peak {peak / 2**20:.0f} MB: growth {growth:.1f} MB (target < 50)")
    summary = {"title": "encode_iterable RSS growth", "file_mb": megabytes, "rss_growth_mb": growth,
               "seconds": seconds}
    print("JSON " + json.dumps(summary))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, one data file, a 20 MB streaming file")
    args = parser.parse_args()
    bench_in_process(args.quick)
    with tempfile.TemporaryDirectory(prefix="bench_encode.") as workdir:
        bench_data_encode(args.quick, Path(workdir))
        bench_streaming_memory(args.quick, Path(workdir))


if __name__ == "__main__":
    main()
