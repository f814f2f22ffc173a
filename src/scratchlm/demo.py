"""`scratchlm demo`: the whole pipeline in one command, on a CPU, in a few minutes.

corpus -> BPE tokenizer -> token files -> a model trained with a recipe (``--config``, default
configs/recipes/modern.toml; ``--set`` changes any field) for a wall-clock budget -> a generated story -> the run's
report -> a Hugging Face export, all in one output folder. The corpus is TinyStories (the shared data folder's,
else `scratchlm data download tinystories`'s) or ``--data FILE``, whose last ~5% is held out for validation; only
its first ``MAX_CORPUS_BYTES`` are used. The budget is the trainer's own (``train.budget_seconds``): it plans the
steps to fill ``--minutes`` and still ends at the budget, with a final evaluation and checkpoint, if the machine
slows down.
"""

from __future__ import annotations

import argparse
import codecs
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from scratchlm.paths import DEFAULT_RECIPE

if TYPE_CHECKING:
    from scratchlm.config import RunConfig

SHARED_TRAIN = "tinystories/TinyStories-train.txt"  # the shared data folder's TinyStories sample
SHARED_VALID = "tinystories/TinyStories-valid.txt"
MAX_CORPUS_BYTES = 8_000_000
HOLDOUT_FRACTION = 0.05
EOT = "<|endoftext|>"
PROMPT = "Once upon a time"


class DemoPaths:
    """Where each artifact goes inside OUT."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.tokenizer = out / "tokenizer"
        self.data = out / "data"
        self.run = out / "run"
        self.report = self.run / "report"
        self.sample = out / "sample.txt"
        self.hf = out / "hf"


def register(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser("demo", help="the whole pipeline in a few minutes: tokenizer, data, training, story",
                                 description="Train a tokenizer and a small model on TinyStories (or --data) within "
                                             "a time budget, print a generated story and write a report.")
    demo.add_argument("--data", type=Path, help="UTF-8 text to train on (default: TinyStories from the shared data "
                                                "folder, else from `scratchlm data download tinystories`)")
    demo.add_argument("--out", type=Path, help="output folder (default: runs/demo-YYYYmmdd-HHMMSS)")
    demo.add_argument("--minutes", type=float, default=5.0, help="training time budget in minutes (default: 5)")
    demo.add_argument("--config", type=Path, default=DEFAULT_RECIPE,
                      help="recipe: a training config whose model, optim and train settings the demo uses "
                           "(default: configs/recipes/modern.toml)")
    demo.add_argument("--vocab-size", type=int, help="BPE vocabulary size (default: the recipe's model.vocab_size)")
    demo.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="overrides",
                      help="override a training config field, e.g. model.d_model=192 (repeatable)")
    demo.add_argument("--quiet", action="store_true", help="no progress bars; print only the story and the paths")
    demo.set_defaults(func=run_demo)


def resolve_corpus(data: Path | None) -> tuple[Path, Path | None]:
    """(train text, validation text or None = hold out the train text's tail)."""
    from scratchlm.errors import UserError
    from scratchlm.paths import describe_search

    if data is not None:
        if not data.is_file():
            raise FileNotFoundError(f"--data {data}: no such file")
        return data, None
    candidates = default_corpora()
    for train, valid in candidates:
        if train.is_file():
            return train, valid if valid.is_file() else None
    raise UserError(f"no default corpus: none of {', '.join(str(train) for train, _ in candidates)} exists (shared "
                    f"data looked for in: {describe_search()}); pass --data FILE, or run "
                    "`scratchlm data download tinystories` here first")


def default_corpora() -> list[tuple[Path, Path]]:
    """(train, valid) places of the default TinyStories, in order: the shared data folder's sample, then the
    full files where `scratchlm data download tinystories` puts them (relative to the working directory)."""
    from scratchlm.data.download import DEFAULT_OUT_DIR, TINYSTORIES_FILES
    from scratchlm.paths import shared_data_dir

    train, valid = TINYSTORIES_FILES
    shared = shared_data_dir()
    corpora = [] if shared is None else [(shared / SHARED_TRAIN, shared / SHARED_VALID)]
    return corpora + [(DEFAULT_OUT_DIR / train, DEFAULT_OUT_DIR / valid)]


def read_prefix(path: Path, max_bytes: int) -> str:
    """The file's text, or its first max_bytes cut back to the last line end (never inside a character)."""
    with path.open("rb") as handle:
        raw = handle.read(max_bytes + 1)
    truncated = len(raw) > max_bytes
    if truncated:
        raw = raw[: raw.rfind(b"\n", 0, max_bytes) + 1 or max_bytes]
    try:  # final=False drops a character cut in half at the end (a prefix without any line end)
        return codecs.getincrementaldecoder("utf-8")().decode(raw, final=not truncated)
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start}: {raw[error.start:error.start + 1]!r})") from None


def split_holdout(text: str, fraction: float = HOLDOUT_FRACTION) -> tuple[str, str]:
    """(train, valid): the text cut at the last document (else line) boundary shortly before 1 - fraction of it.

    Cutting *before* that point keeps at least `fraction` of the text for validation, in whole documents. Looking
    back at most another `fraction` of the text caps validation below 2 x fraction: one early <|endoftext|> must
    not turn most of a corpus into validation. With no boundary that close, the cut is at 1 - fraction itself.
    """
    start = int(len(text) * (1 - fraction))
    earliest = max(0, start - int(len(text) * fraction))
    for boundary in (f"{EOT}\n", EOT, "\n"):
        cut = text.rfind(boundary, earliest, start)
        if cut > 0:
            cut += len(boundary)
            return text[:cut], text[cut:]
    return text[:start], text[start:]


def prepare_texts(data: Path | None, paths: DemoPaths) -> tuple[Path, Path]:
    """Train/valid text files for the demo: the corpus files themselves when small enough, else trimmed copies."""
    train, valid = resolve_corpus(data)
    paths.data.mkdir(parents=True, exist_ok=True)
    if valid is None:
        train_text, valid_text = split_holdout(read_prefix(train, MAX_CORPUS_BYTES))
        return _write(paths.data / "train.txt", train_text), _write(paths.data / "valid.txt", valid_text)
    if train.stat().st_size > MAX_CORPUS_BYTES:
        train = _write(paths.data / "train.txt", read_prefix(train, MAX_CORPUS_BYTES))
    if valid.stat().st_size > MAX_CORPUS_BYTES // 4:
        valid = _write(paths.data / "valid.txt", read_prefix(valid, MAX_CORPUS_BYTES // 4))
    return train, valid


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def demo_config(paths: DemoPaths, recipe: Path, vocab_size: int, minutes: float, overrides: list[str]) -> RunConfig:
    """The recipe with the demo's tokenizer, data, run directory and time budget (the trainer plans the steps)."""
    from scratchlm.config import load_config

    return load_config(recipe, [
        f"model.vocab_size={vocab_size}", f"data.train_path={paths.data / 'train.tok'}",
        f"data.val_path={paths.data / 'valid.tok'}", f"data.tokenizer={paths.tokenizer}", "train.device=auto",
        f"train.run_dir={paths.run}", f"train.budget_seconds={minutes * 60}", *overrides])


def sample_story(model, tokenizer, *, max_new_tokens: int = 256, seed: int = 0) -> str:
    """A story continuing PROMPT: up to `max_new_tokens` new tokens, as many as the model's context leaves."""
    from scratchlm.generate.decoding import generate

    prompt = tokenizer.encode(PROMPT)
    max_new_tokens = min(max_new_tokens, model.config.context_length + 1 - len(prompt))
    new_ids = generate(model, prompt, max_new_tokens, temperature=0.8, top_p=0.95,
                       eos_id=tokenizer.special_id(EOT), seed=seed)[0]
    return PROMPT + tokenizer.decode(new_ids)


def run_demo(args: argparse.Namespace) -> int:
    from scratchlm.config import load_config
    from scratchlm.data.encode import encode_corpus
    from scratchlm.errors import UserError
    from scratchlm.experiments.report import write_report
    from scratchlm.tokenizer.tokenizer import Tokenizer
    from scratchlm.tokenizer.train_bpe import train_bpe
    from scratchlm.train.checkpoint import load_for_inference
    from scratchlm.train.trainer import train

    started = time.perf_counter()
    if not (math.isfinite(args.minutes) and args.minutes > 0):  # inf would overflow only after the tokenizer's work
        raise UserError(f"--minutes must be a positive finite number, got {args.minutes}")
    if not args.config.is_file():
        raise UserError(f"recipe {args.config} not found: pass --config FILE")
    vocab_size = args.vocab_size or load_config(args.config, args.overrides).model.vocab_size
    paths = DemoPaths(args.out or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"))
    if paths.run.is_dir() and any(paths.run.iterdir()):
        raise UserError(f"{paths.run} already holds a run: choose another --out (or delete that folder)")
    say = (lambda _: None) if args.quiet else (lambda message: print(message, file=sys.stderr, flush=True))
    progress = not args.quiet and sys.stderr.isatty()

    train_text, valid_text = prepare_texts(args.data, paths)
    say(f"[1/6] training a {vocab_size}-token BPE tokenizer on {train_text}")
    vocab, merges = train_bpe(str(train_text), vocab_size, [EOT], progress=progress)
    tokenizer = Tokenizer(vocab, merges, [EOT])
    tokenizer.save(paths.tokenizer)
    say(f"[2/6] encoding {train_text.name} and {valid_text.name}")
    for split, text in (("train", train_text), ("valid", valid_text)):
        stats = encode_corpus(tokenizer, [text], paths.data / f"{split}.tok", progress=progress)
        say(f"      {split}: {stats.summary()}")

    config = demo_config(paths, args.config, tokenizer.vocab_size, args.minutes, args.overrides)
    say(f"[3/6] training d_model={config.model.d_model} x {config.model.num_layers} layers ({args.config.name}) "
        f"for {args.minutes:g} min")
    result = train(config, quiet=args.quiet)
    if result.message:
        say(f"      {result.message}")
    say("[4/6] writing the report")
    html_path, md_path = write_report([paths.run], out_dir=paths.report, title="scratchlm demo")
    if result.status != "finished":
        print(f"scratchlm demo: training {result.status}: {result.message}; run directory: {paths.run}",
              file=sys.stderr)
        return 130 if result.status == "interrupted" else 1

    say(f"[5/6] sampling from the model (prompt {PROMPT!r})")
    model, _ = load_for_inference(paths.run)
    story = sample_story(model, tokenizer)
    paths.sample.write_text(story + "\n", encoding="utf-8")
    say(f"[6/6] exporting the model for Hugging Face transformers to {paths.hf}")
    exported = export_for_transformers(model, tokenizer, paths.hf)
    say(f"      {exported}")
    val = f"{result.best_val_loss:.3f}" if result.best_val_loss is not None else "n/a"
    print(f"\n{story}\n")
    print(f"Done in {(time.perf_counter() - started) / 60:.1f} min: {result.final_step} steps, "
          f"best validation loss {val}.\n"
          f"  tokenizer:  {paths.tokenizer}\n"
          f"  token data: {paths.data}\n"
          f"  run:        {paths.run}  (config.toml, metrics.jsonl, curves.png, checkpoints/)\n"
          f"  report:     {html_path}\n"
          f"              {md_path}\n"
          f"  story:      {paths.sample}\n"
          f"  HF export:  {exported if not paths.hf.is_dir() else paths.hf}\n"
          f"More stories: scratchlm generate --checkpoint {paths.run} --prompt \"{PROMPT}\"")
    if paths.hf.is_dir():
        print(f"In transformers: AutoModelForCausalLM.from_pretrained(\"{paths.hf}\"), "
              f"AutoTokenizer.from_pretrained(\"{paths.hf}\")")
    return 0


def export_for_transformers(model, tokenizer, out: Path) -> str:
    """Export the trained model to `out` (compat/hf_export.py) when the [hf] extra is installed; returns the
    architecture line it printed, or why nothing was written."""
    from scratchlm.compat.hf_import import HF_PACKAGES
    from scratchlm.extras import optional_import

    missing = [package for package in HF_PACKAGES if optional_import(package) is None]
    if missing:
        return f"skipped: {', '.join(missing)} not installed (pip install 'scratchlm[hf]')"
    from scratchlm.compat.hf_export import export_hf

    return "architecture " + export_hf(model, tokenizer, out)
