"""`scratchlm demo`: the whole pipeline in one command, on a CPU, in a few minutes.

corpus -> BPE tokenizer (2,048 tokens) -> token files -> a small model trained for a fixed wall-clock budget ->
a generated story -> the run's HTML/Markdown report. Everything lands in one output folder that is printed at
the end.

Design:
- The default corpus is TinyStories from the shared data folder (scratchlm.paths), else the files that
  ``scratchlm data download tinystories`` puts in its default folder; ``--data FILE`` trains on any UTF-8 text
  instead, holding out its last ~5% (cut at a nearby document or line boundary) for validation. Only the first
  ``MAX_CORPUS_BYTES`` of a corpus are used, so a huge file cannot blow the time budget.
- The time budget is met by planning, not by cutting the run short: a few real training steps measure the
  step time, and ``train.max_steps`` is chosen so that training plus its evaluations fit in ``--minutes``.
  The warm-up and cosine decay are then laid over exactly those steps, so the schedule ends where it should.
  Only if the machine becomes much slower mid-run (other busy processes) does a hard stop at 1.5x the budget
  end training early, through the trainer's own graceful stop (checkpoint, then sample from it).
- The model and optimizer settings are the small TinyStories CPU recipe (configs/tinystories-cpu.toml) with a
  2k vocabulary; ``--set section.key=value`` changes any of them, as for ``scratchlm train``.
"""

from __future__ import annotations

import argparse
import codecs
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scratchlm.config import RunConfig

SHARED_TRAIN = "tinystories/TinyStories-train.txt"  # the shared data folder's TinyStories sample
SHARED_VALID = "tinystories/TinyStories-valid.txt"
MAX_CORPUS_BYTES = 8_000_000
HOLDOUT_FRACTION = 0.05
EOT = "<|endoftext|>"
PROMPT = "Once upon a time"
EVALUATIONS = 8  # evaluations over the run (the learning curve's points)
HARD_STOP = 1.5  # x the budget: training is stopped (with a checkpoint) if it runs this long
PLANNED_SHARE = 0.9  # of the budget; the rest absorbs step-time noise (other processes, the final checkpoint)


@dataclass
class DemoPaths:
    """Where each artifact goes inside OUT."""

    out: Path

    @property
    def tokenizer(self) -> Path:
        return self.out / "tokenizer"

    @property
    def data(self) -> Path:
        return self.out / "data"

    @property
    def run(self) -> Path:
        return self.out / "run"

    @property
    def report(self) -> Path:
        return self.run / "report"

    @property
    def sample(self) -> Path:
        return self.out / "sample.txt"


def register(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser("demo", help="the whole pipeline in a few minutes: tokenizer, data, training, story",
                                 description="Train a tokenizer and a small model on TinyStories (or --data) within "
                                             "a time budget, print a generated story and write a report.")
    demo.add_argument("--data", type=Path, help="UTF-8 text to train on (default: TinyStories from the shared data "
                                                "folder, else from `scratchlm data download tinystories`)")
    demo.add_argument("--out", type=Path, help="output folder (default: runs/demo-YYYYmmdd-HHMMSS)")
    demo.add_argument("--minutes", type=float, default=5.0, help="training time budget in minutes (default: 5)")
    demo.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary size (default: 2048)")
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


def demo_config(paths: DemoPaths, vocab_size: int, overrides: list[str]) -> RunConfig:
    """The small TinyStories CPU recipe with the demo's tokenizer, data and run directory (max_steps set later)."""
    from scratchlm.config import DataConfig, OptimConfig, RunConfig, TrainConfig
    from scratchlm.model.config import ModelConfig

    config = RunConfig(
        model=ModelConfig(vocab_size=vocab_size, context_length=128, d_model=128, num_layers=4, num_heads=4, d_ff=384),
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_iters=10),
        data=DataConfig(train_path=str(paths.data / "train.tok"), val_path=str(paths.data / "valid.tok"),
                        tokenizer=str(paths.tokenizer), batch_size=32),
        train=TrainConfig(max_steps=100, device="auto", eval_batches=8, run_dir=str(paths.run)))
    return config.with_overrides(overrides)


def measure_step_seconds(config: RunConfig, steps: int = 2) -> float:
    """Seconds per optimizer step of this config on this machine: one warm-up step, then the median of `steps`."""
    from scratchlm.data.batches import BatchSampler
    from scratchlm.train.setup import build_model, build_optimizer, open_data, select_device
    from scratchlm.train.step import train_step

    device = select_device(config.train.device)
    train_tokens, _ = open_data(config)
    model = build_model(config, device)
    optimizer = build_optimizer(model, config)
    sampler = BatchSampler(train_tokens, config.micro_batch_size, config.model.context_length, device, seed=0)
    times = []
    for _ in range(steps + 1):
        batches = [sampler.next() for _ in range(config.train.grad_accum_steps)]
        start = time.perf_counter()
        loss, _ = train_step(model, optimizer, batches, lr=config.optim.lr, grad_clip=config.optim.grad_clip)
        loss.item()  # wait for the device
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def choose_threads(config: RunConfig) -> tuple[int, float]:
    """(torch threads, seconds per step): the default thread count, or 1 when that is clearly faster.

    On a CPU shared with other busy processes, PyTorch's worker threads wait on each other and one thread can
    be several times faster than two; on an idle machine the default wins. Measuring settles it.
    """
    import torch

    default = torch.get_num_threads()
    seconds = measure_step_seconds(config)
    if default > 1:
        torch.set_num_threads(1)
        single = measure_step_seconds(config)
        if single < 0.8 * seconds:
            return 1, single
        torch.set_num_threads(default)
    return default, seconds


def fit_to_budget(config: RunConfig, step_seconds: float, budget_seconds: float) -> RunConfig:
    """max_steps (and the schedule, logging, evaluation cadence) so training and its evaluations fill the budget.

    An evaluation of eval_batches forward passes costs about eval_batches/3 training steps (no backward).
    """
    eval_cost_steps = EVALUATIONS * config.train.eval_batches / 3
    steps = max(10, int(PLANNED_SHARE * budget_seconds / step_seconds - eval_cost_steps))
    every = max(1, math.ceil(steps / EVALUATIONS))
    return config.with_overrides([
        f"train.max_steps={steps}", f"train.eval_every={every}", f"train.checkpoint_every={steps}",
        f"train.log_every={max(1, steps // 50)}", f"optim.warmup_iters={min(config.optim.warmup_iters, steps // 10)}",
    ])


class Deadline:
    """A hard stop for training: after `seconds`, send ourselves SIGINT, which the trainer turns into "save a
    checkpoint and return". Only matters when the machine gets much slower than the probe measured."""

    def __init__(self, seconds: float) -> None:
        self.fired = False
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        self.fired = True
        signal.raise_signal(signal.SIGINT)

    def __enter__(self) -> Deadline:
        self._timer.start()
        return self

    def __exit__(self, kind: type | None, *exc: object) -> None:
        self._timer.cancel()
        if kind is KeyboardInterrupt and self.fired:  # it fired before the trainer's stop handler was installed
            raise TimeoutError("the demo's time limit passed before training started; try a larger --minutes")


def sample_story(paths: DemoPaths, *, max_new_tokens: int = 256, seed: int = 0) -> str:
    from scratchlm.generate.sampling import generate
    from scratchlm.tokenizer.tokenizer import Tokenizer
    from scratchlm.train.checkpoint import load_for_inference

    tokenizer = Tokenizer.load(paths.tokenizer)
    model, _ = load_for_inference(paths.run)
    new_ids = generate(model, tokenizer.encode(PROMPT), max_new_tokens, temperature=0.8, top_p=0.95,
                       eos_id=tokenizer.special_id(EOT), seed=seed)[0]
    return PROMPT + tokenizer.decode(new_ids)


def run_demo(args: argparse.Namespace) -> int:
    import torch

    from scratchlm.data.encode import encode_corpus
    from scratchlm.errors import UserError
    from scratchlm.tokenizer.tokenizer import Tokenizer
    from scratchlm.tokenizer.train_bpe import train_bpe

    started = time.perf_counter()
    if not (math.isfinite(args.minutes) and args.minutes > 0):  # inf would overflow only after the tokenizer's work
        raise UserError(f"--minutes must be a positive finite number, got {args.minutes}")
    paths = DemoPaths(args.out or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S"))
    if paths.run.is_dir() and any(paths.run.iterdir()):
        raise UserError(f"{paths.run} already holds a run: choose another --out (or delete that folder)")
    say = (lambda _: None) if args.quiet else (lambda message: print(message, file=sys.stderr, flush=True))
    progress = not args.quiet and sys.stderr.isatty()

    train_text, valid_text = prepare_texts(args.data, paths)
    say(f"[1/5] training a {args.vocab_size}-token BPE tokenizer on {train_text}")
    vocab, merges = train_bpe(str(train_text), args.vocab_size, [EOT], progress=progress)
    tokenizer = Tokenizer(vocab, merges, [EOT])
    tokenizer.save(paths.tokenizer)
    say(f"[2/5] encoding {train_text.name} and {valid_text.name}")
    for split, text in (("train", train_text), ("valid", valid_text)):
        stats = encode_corpus(tokenizer, [text], paths.data / f"{split}.tok", progress=progress)
        say(f"      {split}: {stats.summary()}")

    config = demo_config(paths, tokenizer.vocab_size, args.overrides)
    default_threads = torch.get_num_threads()
    try:
        return _train_sample_report(args, paths, config, say, started)
    finally:
        torch.set_num_threads(default_threads)  # choose_threads may have changed it; callers keep theirs


def _train_sample_report(args: argparse.Namespace, paths: DemoPaths, config: RunConfig, say: Callable[[str], None],
                         started: float) -> int:
    from scratchlm.experiments.report import write_report
    from scratchlm.train.trainer import train

    threads, step_seconds = choose_threads(config)
    config = fit_to_budget(config, step_seconds, args.minutes * 60)
    say(f"[3/5] training d_model={config.model.d_model} x {config.model.num_layers} layers for "
        f"{config.train.max_steps} steps of {config.tokens_per_step:,} tokens ({step_seconds:.2f} s/step measured "
        f"with {threads} thread{'s' * (threads > 1)}, budget {args.minutes:g} min)")
    with Deadline(HARD_STOP * args.minutes * 60) as deadline:
        result = train(config, quiet=args.quiet)
    if result.status == "interrupted" and deadline.fired:
        say(f"      stopped at the time limit at step {result.final_step} of {config.train.max_steps} "
            "(the machine got slower than measured)")
    say("[4/5] writing the report")
    html_path, md_path = write_report([paths.run], out_dir=paths.report, title="scratchlm demo")
    if result.status != "finished" and not deadline.fired:
        print(f"scratchlm demo: training {result.status}: {result.message}; run directory: {paths.run}",
              file=sys.stderr)
        return 130 if result.status == "interrupted" else 1

    say(f"[5/5] sampling from the model (prompt {PROMPT!r})")
    story = sample_story(paths)
    paths.sample.write_text(story + "\n", encoding="utf-8")
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
          f"More stories: scratchlm generate --checkpoint {paths.run} --prompt \"{PROMPT}\"")
    return 0
