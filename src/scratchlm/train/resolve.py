"""Resolving a run before its first step, once and in one direction: start -> tokenizer -> data -> dtype and plan.

``train`` calls ``resolve_run`` once the device and the run directory are set up; what it returns (``ResolvedRun``)
holds everything read, and nothing is read again:

1. where the run starts (``Start``), decided here and nowhere else: ``Resume(checkpoint)`` when asked to resume and
   the run has a valid checkpoint, else ``InitFrom(source)`` with train.init_from (init_from.py), else ``Fresh``;
2. the tokenizer (data.tokenizer), loaded once;
3. the data: token files opened once (model.vocab_size bound, memory checked before the probe builds a model, files
   checked against the vocabulary and the tokenizer's hash), or fine-tuning's examples (``ExampleData.prepare``);
4. train.dtype = auto (precision.py) and a budget's plan (budget.py); every rank trains rank 0's choices. A resumed
   run keeps the dtype and plan of its config.toml, and must have the checkpoint's model, optimizer and tokenizer.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from scratchlm.config import RunConfig, load_config
from scratchlm.errors import UserError
from scratchlm.init_source import InitSource, open_source
from scratchlm.train.budget import plan_budget
from scratchlm.train.checkpoint import CheckpointManager
from scratchlm.train.distributed import rank_zeros
from scratchlm.train.init_from import adopt, with_model
from scratchlm.train.precision import choose_dtype
from scratchlm.train.setup import check_data, check_memory_fits, open_token_files
from scratchlm.train.tokenizer_identity import bind_tokenizer, check_same_tokenizer, fit_vocab_size

if TYPE_CHECKING:
    from scratchlm.tokenizer.tokenizer import Tokenizer

CONFIG_FILE = "config.toml"
# What a budget's plan sets (budget.plan_steps, with optim.warmup_iters): a resumed run takes them from config.toml.
PLANNED_TRAIN_FIELDS = ("max_steps", "eval_every", "checkpoint_every", "log_every", "threads")


@dataclass(frozen=True)
class Fresh:
    """A new run: the model starts from build_model's seeded initialisation."""


@dataclass(frozen=True)
class InitFrom:
    """A new run whose weights come from train.init_from (a fresh optimizer, schedule and step counter)."""

    source: InitSource


@dataclass(frozen=True)
class Resume:
    """The run continues from ``checkpoint``: weights, optimizer, RNG, sampler and the loop's running values."""

    checkpoint: Path
    trained: RunConfig  # the checkpoint's config.json, read once


Start = Fresh | InitFrom | Resume


class ExampleData(Protocol):
    """Training data that is not token files: what data.format = conversations trains on (finetune/data.py's
    ConversationData). The trainer draws batches from its ``sampler`` and evaluates on its validation batches."""

    def prepare(self, config: RunConfig, tokenizer: Tokenizer | None,
                source: InitSource | None) -> tuple[RunConfig, Tokenizer]: ...

    def plan_tokens(self) -> np.ndarray: ...

    def sampler(self, config: RunConfig, device: torch.device, rank: int, world_size: int) -> Any: ...

    @property
    def has_validation(self) -> bool: ...

    def validation_batches(self, config: RunConfig, device: torch.device, max_batches: int | None) -> Any: ...


@dataclass(frozen=True)
class ResolvedRun:
    """What a run starts from, each part read once (module docstring)."""

    config: RunConfig  # final: model.vocab_size, data.tokenizer_hash and a budget's plan filled in
    start: Start
    tokenizer: Tokenizer | None  # data.tokenizer, loaded (None: the config names none)
    train_tokens: np.ndarray  # opened and checked
    val_tokens: np.ndarray | None  # None: no data.val_path
    data: ExampleData | None = None  # data.format = conversations: its examples (train_tokens: the probe's)


def resolve_run(config: RunConfig, *, resume: bool, device: torch.device, world_size: int,
                model_overrides: Mapping[str, Any] | None, force_memory: bool, quiet: bool,
                saved: RunConfig | None = None, started: float | None = None,
                data: ExampleData | None = None) -> ResolvedRun:
    """Resolve ``config`` for training on ``device`` (module docstring); ``quiet``: print neither the weights the
    run starts from nor the budget's plan (rank 0 prints them). ``saved``: on resume, the run's config.toml if
    the caller read it already (the CLI's `--resume` without `--config` continues from it). ``started``: when the
    command began (time.perf_counter()), so that a budget's plan counts the start-up. ``data``: a fine-tuning run's
    examples (data.format = conversations), instead of token files."""
    run_dir = Path(config.train.run_dir)
    if not resume:
        saved = None
    elif saved is None and (run_dir / CONFIG_FILE).is_file():
        saved = load_config(run_dir / CONFIG_FILE)
    config, start = _start(config, run_dir, resume, model_overrides)
    if isinstance(start, InitFrom) and not quiet:
        print(f"{command_name(config)}: starting from the weights of {start.source.where} (a fresh optimizer and "
              f"schedule)", file=sys.stderr, flush=True)
    tokenizer = _tokenizer(config, start)
    if (data is not None) != (config.data.format == "conversations"):
        raise UserError(f"data.format = {config.data.format} is trained by "
                        f"`scratchlm {'finetune' if data is None else 'train'}`")
    if data is not None:
        config, tokenizer = data.prepare(config, tokenizer, start.source if isinstance(start, InitFrom) else None)
        if not force_memory:
            check_memory_fits(config, device, world_size)
        train_tokens, val_tokens = data.plan_tokens(), None
    else:
        train_file, val_file = open_token_files(config)
        config = fit_vocab_size(config, tokenizer, train_file)
        if not force_memory:  # before the budget's probe step builds a model
            check_memory_fits(config, device, world_size)
        train_tokens, val_tokens = check_data(config, train_file, val_file, tokenizer.hash if tokenizer else None)
        config = bind_tokenizer(config, tokenizer, train_file, val_file)
    config = _planned(_precision(config, saved, device, quiet), saved, train_tokens, quiet, started)
    if isinstance(start, Resume):  # the final config: a resumed budget's plan sets optim.warmup_iters
        _check_resumable(config, start)
    return ResolvedRun(config, start, tokenizer, train_tokens, val_tokens, data)


def _start(config: RunConfig, run_dir: Path, resume: bool,
           model_overrides: Mapping[str, Any] | None) -> tuple[RunConfig, Start]:
    """Where the run starts, and the config with the model that start implies.

    A resume of a run with a checkpoint continues the checkpoint's model: with train.init_from the source is not
    read again (it may have moved since), so the model comes from the checkpoint (the fields the caller set on
    purpose must agree). A resume of a run with no checkpoint yet starts as a new run would."""
    checkpoints = CheckpointManager(run_dir)
    checkpoint = checkpoints.latest_valid() if resume else None
    if resume and checkpoint is None and (found := checkpoints.checkpoints()):
        # starting over would overwrite them and cut metrics.jsonl back to step 0
        raise ValueError(f"cannot resume: none of the {len(found)} checkpoint(s) in {checkpoints.directory} is "
                         f"valid (see the warnings above); move them away to start this run over")
    if checkpoint is not None:
        trained = RunConfig.from_dict(checkpoints.config_of(checkpoint))
        if config.train.init_from:
            config = with_model(config, trained.model, f"checkpoint {checkpoint}", model_overrides)
        return config, Resume(checkpoint, trained)
    if config.train.init_from:
        source = open_source(config.train.init_from)
        return adopt(config, source, model_overrides), InitFrom(source)
    return config, Fresh()


def _check_resumable(config: RunConfig, start: Resume) -> None:
    """Refuse to continue the checkpoint as another run: its model, optimizer settings and tokenizer must be the
    config's (another recipe or tokenizer would silently continue a different run)."""
    checkpoint, trained = start.checkpoint, start.trained
    if trained.model != config.model:
        raise ValueError(f"cannot resume from {checkpoint}: it was trained with model {trained.model}, but this "
                         f"config asks for {config.model}")
    if trained.optim != config.optim:
        changed = {k: (v, getattr(config.optim, k)) for k, v in dataclasses.asdict(trained.optim).items()
                   if getattr(config.optim, k) != v}
        raise ValueError(f"cannot resume from {checkpoint}: the optimizer settings changed (saved -> asked: " +
                         ", ".join(f"optim.{k} {old!r} -> {new!r}" for k, (old, new) in changed.items()) + ")")
    check_same_tokenizer(trained.data.tokenizer_hash, config.data.tokenizer_hash, f"checkpoint {checkpoint}")


def _tokenizer(config: RunConfig, start: Start) -> Tokenizer | None:
    """data.tokenizer, loaded; the one train.init_from read when it is the source's (``adopt`` put it there)."""
    from scratchlm.tokenizer.tokenizer import Tokenizer

    if isinstance(start, InitFrom) and start.source.tokenizer is not None and \
            config.data.tokenizer == str(start.source.tokenizer):
        return start.source.read_tokenizer
    return Tokenizer.load(config.data.tokenizer) if config.data.tokenizer else None


def _planned(config: RunConfig, saved: RunConfig | None, train_tokens: np.ndarray, quiet: bool,
             started: float | None) -> RunConfig:
    """The config with its budget plan: measured now on ``train_tokens``, or on resume (``saved``, the run's
    config.toml) the plan the run was started with."""
    if config.train.budget_seconds is None:
        return config
    if saved is not None:
        if saved.train.budget_seconds != config.train.budget_seconds:
            was = "without a budget" if saved.train.budget_seconds is None else \
                f"for a budget of {saved.train.budget_seconds} s"
            raise ValueError(f"cannot resume {Path(config.train.run_dir)}: it was planned {was}, this asks for "
                             f"{config.train.budget_seconds} s (a budget cannot change mid-run)")
        return config.with_values(train={key: getattr(saved.train, key) for key in PLANNED_TRAIN_FIELDS},
                                  optim={"warmup_iters": saved.optim.warmup_iters})
    config, plan = plan_budget(config, train_tokens, started=started)
    config = rank_zeros(config.with_values(train={"threads": plan.threads}))
    if not quiet:
        print(f"{command_name(config)}: {plan.describe(config, len(train_tokens))}", file=sys.stderr, flush=True)
    return config


def _precision(config: RunConfig, saved: RunConfig | None, device: torch.device, quiet: bool) -> RunConfig:
    """The config with train.dtype = auto resolved: from what ``device`` can do (precision.py), or on resume
    (``saved``) the dtype the run took."""
    if config.train.dtype != "auto":
        return config
    if saved is not None and saved.train.dtype != "auto":
        return config.with_values(train={"dtype": saved.train.dtype})
    dtype, why = choose_dtype(device)
    if not quiet:
        print(f"{command_name(config)}: {why}", file=sys.stderr, flush=True)
    return rank_zeros(config.with_values(train={"dtype": dtype}))


def command_name(config: RunConfig) -> str:
    """The command a run's messages name: fine-tuning runs (data.format = conversations) are `scratchlm finetune`'s."""
    return "scratchlm finetune" if config.data.format == "conversations" else "scratchlm train"
