"""Quality for a time budget: bits per byte on TinyStories after equal TRAINING wall-clock, ours beside two rivals.

One run trains, one after another on the same machine and threads, on the shared TinyStories train file, and
scores each on the first 204,800 target tokens of the validation file (non-overlapping windows at each model's
own context; bits per byte, so different tokenizers compare; ``<|endoftext|>`` counts as one byte):

- ours: what a user runs, as subprocesses: ``scratchlm tokenizer train``, ``scratchlm data encode`` and
  ``scratchlm train --config RECIPE --budget Nm`` (the budget counts training time, evaluations excluded).
- rival 1, the standard stack as a practitioner writes it: HF ``tokenizers`` byte-level BPE (10k vocab,
  ``<|endoftext|>`` after each document), ``transformers.LlamaForCausalLM`` (sdpa; hidden 256, 4 layers, 8 heads,
  intermediate 704, context 256, untied, HF default init), ``torch.optim.AdamW`` (lr 1e-3, betas 0.9/0.95,
  eps 1e-8, weight decay 0.1 on matrices, grad clip 1.0), 16 x 256 random windows a step, 5% linear warm-up then
  cosine to lr/10 over the steps its probed step time fits into the budget (it still stops at the budget).
- rival 2, our recipe's choices on the standard stack: ``LlamaForCausalLM`` + ``torch.optim.AdamW`` with ours'
  model shape, batch, step count (the steps ours actually ran) and learning-rate schedule (our
  ``learning_rate`` with ours' resolved config), on ours' tokenizer and token files; HF defaults elsewhere. The
  gap between ours and rival 2 is what the recipe's other pieces (optimizer, norms, activation, init) buy.

Learning curves: each side is evaluated on a small fixed slice of the validation file during training (its time
is left out of the training clock) and plotted against training wall-clock; ours' come from its metrics.jsonl.

    .venv/bin/python benchmarks/bench_quality.py --minutes 5 [--out DIR] [--ours-config RECIPE] \
        [--ours-vocab 10000] [--set SECTION.KEY=VALUE ...] [--variant NAME:SECTION.KEY=VALUE,...] [--threads 2]
        [--skip-rival1] [--skip-rival2]

Writes results.json, results.md and curves.png into --out and prints the table. Tokenizers and token files
already in --out are reused (they are not part of the training budget).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from harness import machine_line  # noqa: E402
from scratchlm.config import RunConfig, load_config  # noqa: E402
from scratchlm.data.token_file import open_token_file  # noqa: E402
from scratchlm.experiments.runs import read_metrics  # noqa: E402
from scratchlm.paths import describe_search, shared_data_file  # noqa: E402
from scratchlm.tokenizer.tokenizer import Tokenizer  # noqa: E402
from scratchlm.train.bits_per_byte import bits_per_byte, token_byte_lengths  # noqa: E402
from scratchlm.train.checkpoint import load_for_inference  # noqa: E402
from scratchlm.train.step import learning_rate  # noqa: E402

# The subprocesses import the same scratchlm as this script (this checkout's src/), not whichever is installed.
PYTHONPATH = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
EOT = "<|endoftext|>"
EVAL_TARGETS = 204_800  # final score: the first 204,800 target tokens of the validation file
CURVE_TARGETS = 8_192  # the rivals' learning-curve slice (ours' is its own eval_batches slice)
CURVE_POINTS = 10  # rival evaluations during training (plus one at the end)
PROBE_STEPS = 5  # rival 1's step-time probe, after one warm-up step
DEFAULT_RECIPE = ROOT / "configs" / "recipes" / "modern.toml"
RIVAL1 = dict(vocab=10_000, hidden=256, layers=4, heads=8, intermediate=704, context=256, batch=16, lr=1e-3,
              min_lr_ratio=0.1, warmup_fraction=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=1.0)


# ---------------------------------------------------------------------------------------------- bookkeeping
@dataclass
class Side:
    """One contender's result; ``curve`` holds (training seconds, bits per byte on the curve slice)."""

    name: str
    description: str
    bits_per_byte: float = math.nan
    nats_per_token: float = math.nan
    eval_targets: int = 0
    eval_bytes: int = 0
    parameters: int = 0
    steps: int = 0
    tokens_seen: int = 0
    epochs: float = 0.0
    train_seconds: float = 0.0
    tokens_per_s: float = 0.0
    load: dict = field(default_factory=dict)
    curve: list[tuple[float, float]] = field(default_factory=list)


class LoadMeter:
    """Load average and CPU time (this process + its finished children) over a side, so a disturbed run shows."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.load_start = os.getloadavg()[0]
        self.cpu_start, self.wall_start = self._cpu_seconds(), time.perf_counter()

    @staticmethod
    def _cpu_seconds() -> float:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + children.ru_utime + children.ru_stime

    def stop(self) -> dict:
        wall, cpu = time.perf_counter() - self.wall_start, self._cpu_seconds() - self.cpu_start
        return {"loadavg_1m_start": self.load_start, "loadavg_1m_end": os.getloadavg()[0], "cpu_s": cpu,
                "wall_s": wall, "threads": self.threads, "cpu_per_thread": cpu / wall / self.threads}


def shared_tinystories() -> tuple[Path, Path]:
    paths = [shared_data_file(f"tinystories/TinyStories-{split}.txt") for split in ("train", "valid")]
    if None in paths:
        sys.exit(f"bench_quality: TinyStories train/valid text not found (looked in: {describe_search()}; "
                 "set SCRATCHLM_DATA_DIR to the shared data folder)")
    return paths[0], paths[1]


def display_path(path: Path) -> Path:
    path = path.resolve()
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def scratchlm_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "scratchlm", *args]


def run_command(argv: list[str], threads: int) -> float:
    """Run a command with ``threads`` intra-op threads; its wall seconds. A failure ends the benchmark."""
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                          env=os.environ | {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": PYTHONPATH})
    if proc.returncode != 0:
        sys.exit(f"bench_quality: `{' '.join(argv[1:])}` failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------- ours
def ours_train_argv(recipe: Path, minutes: float, run_dir: Path, overrides: list[str], steps: int | None) -> list[str]:
    """`scratchlm train` as a user runs it; ``steps`` (development only) replaces the budget by a step count."""
    sets = [arg for override in overrides for arg in ("--set", override)]
    # Equal training wall-clock with the rivals: the budget leaves ours' evaluations out, as theirs are.
    length = ["--set", f"train.max_steps={steps}"] if steps else ["--budget", f"{minutes:g}m",
                                                                   "--set", "train.budget_includes_eval=false"]
    return scratchlm_command("train", "--config", str(recipe), "--run-dir", str(run_dir), "--quiet", *sets, *length)


def prepare_ours(out: Path, train_txt: Path, valid_txt: Path, vocab: int, threads: int) -> tuple[Path, Path, Path]:
    """Tokenizer directory and train/valid token files made with the CLI (reused when already in ``out``)."""
    folder = out / f"ours-data-v{vocab}"
    tokenizer, train_tok, valid_tok = folder / "tokenizer", folder / "train.tok", folder / "valid.tok"
    if not (tokenizer / "tokenizer.json").exists():
        seconds = run_command(scratchlm_command("tokenizer", "train", "--input", str(train_txt), "--vocab-size",
                                                str(vocab), "--special-token", EOT, "--out", str(tokenizer),
                                                "--quiet"), threads)
        print(f"ours: tokenizer trained in {seconds:.0f} s", file=sys.stderr)
    for text, tokens in ((train_txt, train_tok), (valid_txt, valid_tok)):
        if not tokens.exists():
            run_command(scratchlm_command("data", "encode", "--tokenizer", str(tokenizer), "--input", str(text),
                                          "--out", str(tokens), "--workers", str(threads), "--quiet"), threads)
    return tokenizer, train_tok, valid_tok


def run_ours(args: argparse.Namespace, out: Path, train_txt: Path, valid_txt: Path, name: str = "ours",
             variant: tuple[str, ...] = ()) -> tuple[Side, RunConfig, Path, Path]:
    """Ours, or (``variant``: overrides on top of ours') a variant of ours trained on the same token files."""
    tokenizer_dir, train_tok, valid_tok = prepare_ours(out, train_txt, valid_txt, args.ours_vocab, args.threads)
    run_dir = out / ("ours-run" if name == "ours" else f"variant-{name}-run")
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run every time (this folder is ours alone)
    overrides = [f"data.train_path={train_tok.resolve()}", f"data.val_path={valid_tok.resolve()}",
                 f"data.tokenizer={tokenizer_dir.resolve()}", f"model.vocab_size={args.ours_vocab}",
                 "train.device=cpu", *args.overrides, *variant]
    meter = LoadMeter(args.threads)
    run_command(ours_train_argv(args.ours_config, args.minutes, run_dir, overrides, args.ours_steps), args.threads)
    load = meter.stop()
    config = load_config(run_dir / "config.toml")
    records = read_metrics(run_dir / "metrics.jsonl")
    clock = training_clock(records)
    last_train = [r for r in records if r["kind"] == "train"][-1]
    model, _ = load_for_inference(run_dir)
    tokenizer = Tokenizer.load(tokenizer_dir)
    byte_lengths = token_byte_lengths(tokenizer)
    valid = open_token_file(valid_tok).tokens
    description = f"scratchlm, `{display_path(args.ours_config)}`" + "".join(f" `{v}`" for v in variant)
    side = Side(name, description,
                parameters=sum(p.numel() for p in model.parameters()), steps=last_train["step"],
                tokens_seen=last_train["tokens"], train_seconds=clock(last_train["step"]), load=load)
    side.epochs = side.tokens_seen / len(open_token_file(train_tok).tokens)
    side.tokens_per_s = side.tokens_seen / side.train_seconds
    slice_ratio = ours_curve_nats_to_bits(valid, byte_lengths, config)
    side.curve = [(clock(r["step"]), r["val_loss"] * slice_ratio) for r in records if r["kind"] == "eval"]
    score(side, model, valid, byte_lengths, config.model.context_length)
    return side, config, tokenizer_dir, train_tok


def training_clock(records: list[dict]) -> Callable[[int], float]:
    """Step -> seconds of training alone up to it: the records' train_time (evaluations and checkpoints left out,
    as the budget with train.budget_includes_eval = false counts it)."""
    timed = sorted((r["step"], r["train_time"]) for r in records if r["kind"] in ("train", "eval"))
    steps, seconds = [0] + [s for s, _ in timed], [0.0] + [t for _, t in timed]
    return lambda step: seconds[int(np.searchsorted(steps, step, side="right")) - 1]


def ours_curve_nats_to_bits(valid: np.ndarray, byte_lengths: np.ndarray, config: RunConfig) -> float:
    """Factor from ours' eval-record val_loss (nats/token on its eval slice) to bits/byte on that same slice:
    ``evaluate`` scores the first eval_batches x micro-batch windows of context T from the file's start."""
    context = config.model.context_length
    windows = min(config.train.eval_batches * config.micro_batch_size, (len(valid) - 1) // context)
    targets = np.asarray(valid[1:windows * context + 1]).astype(np.int64)
    return len(targets) / math.log(2) / int(byte_lengths[targets].sum())


# ---------------------------------------------------------------------------------------------- rivals
def hf_tokenizer(out: Path, train_txt: Path, vocab: int):
    """Rival 1's tokenizer: HF byte-level BPE trained on the documents (cached in ``out``)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    path = out / f"hf-tokenizer-v{vocab}" / "tokenizer.json"
    if path.exists():
        return HFTokenizer.from_file(str(path))
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    start = time.perf_counter()
    tokenizer.train_from_iterator(train_txt.read_text(encoding="utf-8").split(EOT), trainer)
    print(f"rival 1: HF tokenizer trained in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    tokenizer.model.save(str(path.parent))  # GPT-2 vocab.json + merges.txt, for the byte lengths
    return tokenizer


def hf_encode(tokenizer, text_path: Path) -> np.ndarray:
    """The file as documents, each followed by <|endoftext|>. The text around the separators (the newlines) is
    kept, so both sides score the same bytes of the same file."""
    documents = text_path.read_text(encoding="utf-8").split(EOT)
    eot = tokenizer.token_to_id(EOT)
    ids: list[int] = []
    for index, encoding in enumerate(tokenizer.encode_batch(documents, add_special_tokens=False)):
        ids.extend(encoding.ids)
        if index < len(documents) - 1:
            ids.append(eot)
    return np.asarray(ids, dtype=np.uint16)


def hf_byte_lengths(tokenizer_dir: Path) -> np.ndarray:
    """Byte lengths of the HF tokenizer's ids, read back through our GPT-2-format reader (same ids)."""
    ours_view = Tokenizer.from_files(tokenizer_dir / "vocab.json", tokenizer_dir / "merges.txt", [EOT])
    return token_byte_lengths(ours_view)


def llama(vocab: int, hidden: int, layers: int, heads: int, intermediate: int, context: int, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, intermediate_size=intermediate, max_position_embeddings=context,
                         tie_word_embeddings=tied, use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def adamw(model: torch.nn.Module, betas: tuple[float, float], eps: float, weight_decay: float) -> torch.optim.AdamW:
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=0.0, betas=betas, eps=eps)


def get_batch(tokens: np.ndarray, batch: int, context: int, generator: torch.Generator):
    """nanoGPT's get_batch: ``batch`` random windows of the token stream."""
    starts = torch.randint(len(tokens) - context, (batch,), generator=generator).tolist()
    rows = np.stack([tokens[i:i + context + 1] for i in starts]).astype(np.int64)
    rows = torch.from_numpy(rows)
    return rows[:, :-1], rows[:, 1:]  # (B, T) inputs, (B, T) targets


def train_step(model, optimizer, batch, lr: float, grad_clip: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
    inputs, targets = batch
    logits = model(input_ids=inputs).logits  # (B, T, V)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def logits_of(model) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda inputs: model(input_ids=inputs).logits


@dataclass
class RivalRun:
    """What a rival trains: a fresh model each call of ``make_model``, and how long."""

    make_model: Callable[[], torch.nn.Module]
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]
    lr_at: Callable[[int, int], float]  # (step, planned steps) -> learning rate
    grad_clip: float
    batch: int
    context: int
    steps: int | None  # None: plan them from a probe of the step time
    budget_s: float | None  # stop when training time reaches it (None: run all steps)


def probe_steps(run: RivalRun, train: np.ndarray, budget_s: float) -> int:
    """Steps that fit the budget: one warm-up step, then PROBE_STEPS timed ones, on a throwaway model."""
    torch.manual_seed(1)
    model = run.make_model()
    optimizer = run.make_optimizer(model)
    generator = torch.Generator().manual_seed(1)
    train_step(model, optimizer, get_batch(train, run.batch, run.context, generator), 1e-4, run.grad_clip)
    start = time.perf_counter()
    for _ in range(PROBE_STEPS):
        train_step(model, optimizer, get_batch(train, run.batch, run.context, generator), 1e-4, run.grad_clip)
    step_s = (time.perf_counter() - start) / PROBE_STEPS
    return max(1, int(budget_s / step_s))


def train_rival(side: Side, run: RivalRun, train: np.ndarray, valid: np.ndarray, byte_lengths: np.ndarray,
                threads: int) -> torch.nn.Module:
    """Train to the planned steps or the budget, evaluating the curve slice CURVE_POINTS times (untimed)."""
    meter = LoadMeter(threads)
    steps = run.steps or probe_steps(run, train, run.budget_s)
    torch.manual_seed(0)
    model = run.make_model()
    optimizer = run.make_optimizer(model)
    generator = torch.Generator().manual_seed(0)
    eval_every = max(1, steps // CURVE_POINTS)
    trained_s, step = 0.0, 0
    while step < steps and (run.budget_s is None or trained_s < run.budget_s):
        start = time.perf_counter()
        train_step(model, optimizer, get_batch(train, run.batch, run.context, generator), run.lr_at(step, steps),
                   run.grad_clip)
        trained_s += time.perf_counter() - start
        step += 1
        if step % eval_every == 0 and step < steps:
            side.curve.append((trained_s, curve_point(model, valid, byte_lengths, run.context)))
    side.curve.append((trained_s, curve_point(model, valid, byte_lengths, run.context)))
    side.load = meter.stop()
    side.steps, side.train_seconds = step, trained_s
    side.tokens_seen = step * run.batch * run.context
    side.tokens_per_s, side.epochs = side.tokens_seen / trained_s, side.tokens_seen / len(train)
    side.parameters = sum(p.numel() for p in model.parameters())
    return model


def curve_point(model, valid: np.ndarray, byte_lengths: np.ndarray, context: int) -> float:
    model.eval()
    value = bits_per_byte(logits_of(model), valid, byte_lengths, context, CURVE_TARGETS).bits_per_byte
    model.train()
    return value


def cosine_with_warmup(peak: float, floor: float, warmup_fraction: float) -> Callable[[int, int], float]:
    """Rival 1's schedule: linear warm-up over warmup_fraction of the steps, then cosine from peak to floor."""
    def lr_at(step: int, steps: int) -> float:
        warmup = max(1, round(warmup_fraction * steps))
        if step < warmup:
            return peak * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return floor + 0.5 * (1 + math.cos(math.pi * progress)) * (peak - floor)
    return lr_at


def run_rival1(args: argparse.Namespace, out: Path, train_txt: Path, valid_txt: Path) -> Side:
    r = RIVAL1
    tokenizer = hf_tokenizer(out, train_txt, r["vocab"])
    train, valid = hf_encode(tokenizer, train_txt), hf_encode(tokenizer, valid_txt)
    byte_lengths = hf_byte_lengths(out / f"hf-tokenizer-v{r['vocab']}")
    side = Side("rival 1", "HF tokenizers BPE + LlamaForCausalLM + AdamW, cosine (standard stack)")
    run = RivalRun(make_model=lambda: llama(tokenizer.get_vocab_size(), r["hidden"], r["layers"], r["heads"],
                                            r["intermediate"], r["context"], tied=False),
                   make_optimizer=lambda model: adamw(model, r["betas"], r["eps"], r["weight_decay"]),
                   lr_at=cosine_with_warmup(r["lr"], r["lr"] * r["min_lr_ratio"], r["warmup_fraction"]),
                   grad_clip=r["grad_clip"], batch=r["batch"], context=r["context"], steps=None,
                   budget_s=args.minutes * 60)
    model = train_rival(side, run, train, valid, byte_lengths, args.threads)
    score(side, logits_of(model.eval()), valid, byte_lengths, r["context"])
    return side


def run_rival2(args: argparse.Namespace, ours: Side, config: RunConfig, tokenizer_dir: Path,
               train_tok: Path) -> Side:
    shape, optim = config.model, config.optim
    train = open_token_file(train_tok).tokens
    valid = open_token_file(config.data.val_path).tokens
    byte_lengths = token_byte_lengths(Tokenizer.load(tokenizer_dir))
    side = Side("rival 2", "LlamaForCausalLM + AdamW with ours' shape, batch, steps, schedule and tokens")
    run = RivalRun(make_model=lambda: llama(shape.vocab_size, shape.d_model, shape.num_layers, shape.num_heads,
                                            shape.d_ff, shape.context_length, tied=shape.tie_embeddings),
                   make_optimizer=lambda model: adamw(model, optim.betas, optim.eps, optim.weight_decay),
                   lr_at=lambda step, steps: learning_rate(step, config), grad_clip=optim.grad_clip,
                   batch=config.data.batch_size, context=shape.context_length, steps=ours.steps, budget_s=None)
    model = train_rival(side, run, train, valid, byte_lengths, args.threads)
    score(side, logits_of(model.eval()), valid, byte_lengths, shape.context_length)
    return side


def score(side: Side, logits_fn, valid: np.ndarray, byte_lengths: np.ndarray, context: int) -> None:
    result = bits_per_byte(logits_fn, valid, byte_lengths, context, EVAL_TARGETS)
    side.bits_per_byte, side.nats_per_token = result.bits_per_byte, result.nats_per_token
    side.eval_targets, side.eval_bytes = result.targets, result.bytes


# ---------------------------------------------------------------------------------------------- report
def markdown(sides: list[Side], minutes: float, command: str) -> str:
    lines = [f"### TinyStories, {minutes:g} min of training per side", "", f"`{command}`", "",
             "| side | bits/byte | nats/token | eval tokens (bytes) | params | steps | tokens seen | epochs | "
             "train s | tokens/s | load 1m start/end | CPU s / wall s / threads |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in sides:
        load = s.load
        lines.append(f"| {s.name}: {s.description} | {s.bits_per_byte:.4f} | {s.nats_per_token:.4f} | "
                     f"{s.eval_targets:,} ({s.eval_bytes:,}) | {s.parameters / 1e6:.2f}M | {s.steps:,} | "
                     f"{s.tokens_seen:,} | {s.epochs:.2f} | {s.train_seconds:.0f} | {s.tokens_per_s:,.0f} | "
                     f"{load['loadavg_1m_start']:.2f}/{load['loadavg_1m_end']:.2f} | {load['cpu_per_thread']:.2f} |")
    by_name = {s.name: s for s in sides}
    if "ours" in by_name:
        for rival in ("rival 1", "rival 2"):
            if rival in by_name:
                ratio = by_name["ours"].bits_per_byte / by_name[rival].bits_per_byte
                lines.append(f"\nbits/byte ratio ours/{rival} = {ratio:.3f} (< 1.0: ours compresses better)")
    return "\n".join(lines) + "\n"


def plot(sides: list[Side], minutes: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for s in sides:
        seconds, values = zip(*s.curve) if s.curve else ((), ())
        line, = axes.plot(seconds, values, marker=".", label=f"{s.name} (final {s.bits_per_byte:.3f})")
        axes.plot([s.train_seconds], [s.bits_per_byte], marker="*", markersize=12, color=line.get_color())
    axes.set_xlabel("training wall-clock (s, evaluation excluded)")
    axes.set_ylabel("validation bits per byte")
    axes.set_title(f"TinyStories, {minutes:g} min budget (curves: small slice; stars: {EVAL_TARGETS:,} tokens)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="training budget per side (default 5)")
    parser.add_argument("--quick", action="store_true", help="a 1-minute budget (run_all.py --quick)")
    parser.add_argument("--out", type=Path, help="output folder (default runs/bench_quality/<budget>-<time>)")
    parser.add_argument("--ours-config", type=Path, default=DEFAULT_RECIPE, help="ours' recipe TOML")
    parser.add_argument("--ours-vocab", type=int, help="ours' tokenizer vocabulary (default: the recipe's)")
    parser.add_argument("--ours-steps", type=int, help="development: train ours for N steps instead of --budget")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="SECTION.KEY=VALUE",
                        help="extra override for ours' `scratchlm train` (repeatable)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:SECTION.KEY=VALUE[,...]",
                        help="also train a variant of ours, side by side: ours' recipe with these overrides "
                             "(repeatable; e.g. relu2:model.ffn=relu2,model.d_ff=1024)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-rival1", action="store_true", help="development: leave rival 1 out")
    parser.add_argument("--skip-rival2", action="store_true", help="development: leave rival 2 out")
    args = parser.parse_args()
    print(machine_line(), flush=True)
    if args.quick:
        args.minutes = 1.0
    if args.ours_vocab is None and args.ours_config.is_file():
        args.ours_vocab = load_config(args.ours_config).model.vocab_size
    if args.minutes <= 0 or args.threads < 1 or (args.ours_vocab or 0) < 257:
        sys.exit("bench_quality: --minutes and --threads must be positive and --ours-vocab at least 257")
    if not args.ours_config.is_file():
        sys.exit(f"bench_quality: ours' recipe {args.ours_config} not found (give one with --ours-config)")
    train_txt, valid_txt = shared_tinystories()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    # Absolute paths: the subprocesses run from the repository root, not from the caller's folder.
    out = (args.out or ROOT / "runs" / "bench_quality" / f"{args.minutes:g}m-{stamp}").resolve()
    args.ours_config = args.ours_config.resolve()
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    command = "python benchmarks/bench_quality.py " + " ".join(sys.argv[1:])

    ours, config, tokenizer_dir, train_tok = run_ours(args, out, train_txt, valid_txt)
    sides = [ours]
    for name, _, sets in (variant.partition(":") for variant in args.variant):
        sides.append(run_ours(args, out, train_txt, valid_txt, name, tuple(sets.split(",")))[0])
    if not args.skip_rival1:
        sides.append(run_rival1(args, out, train_txt, valid_txt))
    if not args.skip_rival2:
        sides.append(run_rival2(args, ours, config, tokenizer_dir, train_tok))

    table = markdown(sides, args.minutes, command)
    machine = f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, torch {torch.__version__}"
    (out / "results.md").write_text(table, encoding="utf-8")
    (out / "results.json").write_text(json.dumps({"command": command, "minutes": args.minutes, "machine": machine,
                                                  "eval_targets": EVAL_TARGETS, "ours_config": str(args.ours_config),
                                                  "sides": [asdict(s) for s in sides]}, indent=2), encoding="utf-8")
    plot(sides, args.minutes, out / "curves.png")
    print(table)
    print(f"wrote {out}/results.md, results.json, curves.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
