"""``scratchlm tokenizer train``: train a byte-level BPE tokenizer on documents and save it.

It reads the inputs `data encode` reads (text, JSON lines, JSON, parquet, compressed, folders, globs, `hf:`
datasets), with the same flags (`data/input_arguments.py`).

Prints what a user wants to know about the run: wall time, peak memory (this process and the largest
counting worker), the number of merges and the longest tokens learned.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from scratchlm.data.input_arguments import add_input_arguments

if TYPE_CHECKING:
    from scratchlm.data.sources import Source


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("tokenizer", help="train byte-level BPE tokenizers",
                                   description="Train byte-level BPE tokenizers.")
    actions = parser.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)
    train = actions.add_parser(
        "train",
        help="train a BPE tokenizer on text, JSON lines, parquet or a Hugging Face dataset",
        description="Train a byte-level BPE tokenizer (GPT-2 pre-tokenization unless --pattern says otherwise; "
        "ties go to the greater byte pair) and save it as DIR/scratchlm-tokenizer.json, plus Hugging Face's "
        "DIR/tokenizer.json + tokenizer_config.json and GPT-2 style DIR/vocab.json + DIR/merges.txt (GPT-2's "
        "pattern only). Inputs: .txt, .jsonl/.json, "
        ".parquet (optionally .gz/.zst), folders and globs of those, and hf:NAME[:CONFIG][:SPLIT] datasets, as "
        "`data encode` takes them; no pre-token spans two documents.",
    )
    add_input_arguments(train)
    train.add_argument("--vocab-size", type=int, required=True, metavar="N",
                       help="total vocabulary: 256 bytes + special tokens + merges")
    train.add_argument("--special-token", action="append", default=[], metavar="TOKEN",
                       help="a special token, e.g. '<|endoftext|>' (repeatable; never merged)")
    train.add_argument("--pattern", default="gpt2", metavar="NAME_OR_REGEX",
                       help="the pre-tokenization split pattern: gpt2 (default), gpt4 (tiktoken's cl100k: digits in "
                       "groups of 1-3, better for code), llama3, qwen2, or a regex")
    train.add_argument("--out", required=True, metavar="DIR", help="directory to save the tokenizer in")
    train.add_argument("--workers", type=int, default=None, metavar="N",
                       help="processes for pre-token counting (default: usable CPUs, at most 8)")
    train.add_argument("--quiet", action="store_true", help="no progress bars or summary")
    train.add_argument("--force", action="store_true",
                       help="write into an existing folder that holds files (replacing a tokenizer there)")
    train.set_defaults(func=run_train)


def peak_memory_mb() -> tuple[float, float]:
    """Peak RSS in MB of this process and of its largest finished child (the counting workers).

    This process's own from /proc/self/status (VmHWM) where there is one: Linux's ru_maxrss carries the peak of
    the process that started this one over exec, so a 1 GB notebook that runs the command read as 1 GB here."""
    import resource

    # ru_maxrss is in kilobytes on Linux and in bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20
    try:
        with open("/proc/self/status") as status:
            own = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024  # kB
    except (OSError, StopIteration):  # no procfs (macOS) or no such line: ru_maxrss it is
        pass
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale / 2**20
    return own, child


def describe_longest(vocab: dict[int, bytes], first_learned_id: int, count: int = 5) -> str:
    """The `count` longest learned tokens (special tokens and single bytes left out), as id:'text'."""
    learned = [(token_id, token) for token_id, token in vocab.items() if token_id >= first_learned_id]
    longest = sorted(learned, key=lambda item: (-len(item[1]), item[0]))[:count]
    return ", ".join(f"{token_id}:{token.decode('utf-8', errors='replace')!r}" for token_id, token in longest)


def input_paths(specs: list[str], sources: list[Source]) -> list[Path]:
    """The input files and the folders given: the output may be none of them, and lie in none of the folders (its
    files would be read as inputs next time)."""
    files = [Path(source.path) for source in sources if source.format != "hf"]
    return files + [Path(spec) for spec in specs if Path(spec).is_dir()]


def describe_size(sources: list[Source]) -> str:
    """The size of the input files on disk, and the number of datasets besides: "12.3 MB", "1 dataset"."""
    files = [source for source in sources if source.format != "hf"]
    parts = [f"{sum(os.path.getsize(source.path) for source in files) / 2**20:.1f} MB"] if files else []
    if len(files) < len(sources):
        datasets = len(sources) - len(files)
        parts.append(f"{datasets} dataset{'s' if datasets > 1 else ''}")
    return " and ".join(parts)


def run_train(args: argparse.Namespace) -> int:
    from scratchlm.data.sources import expand_inputs
    from scratchlm.output_paths import refuse_foreign_folder, refuse_inputs, removed_on_failure
    from scratchlm.tokenizer.pipeline import Pipeline
    from scratchlm.tokenizer.pretokenize import pattern_from_name
    from scratchlm.tokenizer.tokenizer import Tokenizer
    from scratchlm.tokenizer.train_bpe import train_bpe

    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}")
    try:
        pipeline = Pipeline(pattern_from_name(args.pattern))
    except ValueError as error:
        raise ValueError(f"--pattern: {error}") from None
    sources = expand_inputs(args.input)  # a missing file, an empty folder, a glob that matches nothing
    # Before training, not after it. An existing tokenizer may be the one runs and token files were made with.
    out = Path(args.out)
    refuse_foreign_folder(out, force=args.force)
    refuse_inputs(out, input_paths(args.input, sources))
    show_progress = not args.quiet and sys.stderr.isatty()
    start = time.perf_counter()
    vocab, merges = train_bpe(args.input, args.vocab_size, args.special_token, num_workers=args.workers,
                              progress=show_progress, errors=args.errors, text_field=args.text_field,
                              pattern=pipeline.pattern)
    seconds = time.perf_counter() - start
    with removed_on_failure(out):
        out = Tokenizer(vocab, merges, args.special_token, pipeline=pipeline).save(out)
    if not args.quiet:
        own_mb, worker_mb = peak_memory_mb()
        print(f"trained on {describe_size(sources)} in {seconds:.2f} s: {len(merges)} merges, vocab {len(vocab)}")
        where = f"(main process), {worker_mb:.0f} MB (largest worker)" if worker_mb else "(one process, no workers)"
        print(f"peak RSS: {own_mb:.0f} MB {where}")
        print(f"longest tokens: {describe_longest(vocab, 256 + len(args.special_token))}")
        print(f"saved to {out}")
    return 0
