"""Resolving a run before its first step: config -> tokenizer -> data -> budget plan, once and in one direction.

``train`` calls ``resolve_run`` once the device and the run directory are set up, and builds the model from what
it returns (``ResolvedRun``); the loop takes the rest from there. Each input is read once, by the step that needs
it first, and handed on rather than read again:

1. the config: with train.init_from, the model (and tokenizer) of the weights the run starts from (init_from.py),
   or on resume the run's own model; a resumed run's config.toml is read once, for that model and its budget plan;
2. the tokenizer (data.tokenizer), loaded once: its vocabulary size, its hash, and later the run's copy of it;
3. the token files, opened once: model.vocab_size is bound (the tokenizer's, else the size the train file's header
   records: tokenizer_identity.py), a model that cannot fit in memory is refused (setup.check_memory_fits, before
   the probe builds one), the files are checked against the vocabulary and the tokenizer's hash, and
   data.tokenizer_hash is recorded;
   With ``data`` (fine-tuning's conversations, finetune/data.py) there are no token files: ``data.prepare`` gives
   the tokenizer the run trains with (ChatML added to a base model's, its rows added to the weights) and lays
   out the examples, and the budget's probe trains on their tokens;
4. train.dtype = auto, from what the device can do (precision.py), and the budget plan (budget.py), its probe
   steps trained on them too; under torch.distributed every rank trains rank 0's choice and plan, so all stop at
   the same step. A resumed run keeps the dtype and the plan it was started with.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from scratchlm.config import RunConfig, load_config
from scratchlm.errors import UserError
from scratchlm.train.budget import plan_budget
from scratchlm.train.checkpoint import CheckpointManager
from scratchlm.train.init_from import InitSource, adopt, open_source, with_model
from scratchlm.train.precision import choose_dtype
from scratchlm.train.setup import check_data, check_memory_fits, open_token_files
from scratchlm.train.tokenizer_identity import bind_tokenizer, fit_vocab_size

if TYPE_CHECKING:
    from scratchlm.tokenizer.tokenizer import Tokenizer


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

CONFIG_FILE = "config.toml"
# What a budget's plan sets (budget.plan_steps): a resumed run takes these from the run's config.toml.
PLANNED_FIELDS = (("train", "max_steps"), ("train", "eval_every"), ("train", "checkpoint_every"),
                  ("train", "log_every"), ("train", "threads"), ("optim", "warmup_iters"))


@dataclass(frozen=True)
class ResolvedRun:
    """What a run starts from, each part read once (module docstring)."""

    config: RunConfig  # final: model.vocab_size, data.tokenizer_hash and a budget's plan filled in
    tokenizer: Tokenizer | None  # data.tokenizer, loaded (None: the config names none)
    train_tokens: np.ndarray  # opened and checked
    val_tokens: np.ndarray | None  # None: no data.val_path
    source: InitSource | None  # train.init_from's weights, on a fresh start from them
    data: ExampleData | None = None  # the examples of data.format = conversations (train_tokens: for the probe)


def resolve_run(config: RunConfig, *, resume: bool, device: torch.device, world_size: int,
                model_overrides: Mapping[str, Any] | None, force_memory: bool, quiet: bool,
                saved: RunConfig | None = None, started: float | None = None,
                data: ExampleData | None = None) -> ResolvedRun:
    """Resolve ``config`` for training on ``device`` (module docstring); ``quiet``: print neither the weights the
    run starts from nor the budget's plan (rank 0 prints them). ``saved``: on resume, the run's config.toml if
    the caller read it already (the CLI's `--resume` without `--config` continues from it). ``started``: when the
    command began (time.perf_counter()), so that a budget's plan counts the start-up. ``data``: the examples of a
    fine-tuning run (data.format = conversations), instead of token files."""
    run_dir = Path(config.train.run_dir)
    saved_path = run_dir / CONFIG_FILE
    if saved is None and resume and saved_path.is_file():
        saved = load_config(saved_path)
    saved = saved if resume else None
    config, source = _starting_point(config, run_dir, resume, saved, model_overrides)
    if source is not None and not quiet:
        print(f"scratchlm train: starting from the weights of {source.where} (a fresh optimizer and schedule)",
              file=sys.stderr, flush=True)
    tokenizer = _tokenizer(config, source)
    if (data is not None) != (config.data.format == "conversations"):
        raise UserError(f"data.format = {config.data.format} is trained by "
                        f"`scratchlm {'finetune' if data is None else 'train'}`")
    if data is not None:
        config, tokenizer = data.prepare(config, tokenizer, source)
        if not force_memory:
            check_memory_fits(config, device, world_size)
        config = _planned(_precision(config, saved, device, quiet), saved, data.plan_tokens(), quiet, started)
        return ResolvedRun(config, tokenizer, data.plan_tokens(), None, source, data)
    train_file, val_file = open_token_files(config)
    config = fit_vocab_size(config, tokenizer, train_file)
    if not force_memory:  # before the budget's probe step builds a model
        check_memory_fits(config, device, world_size)
    train_tokens, val_tokens = check_data(config, train_file, val_file, tokenizer.hash if tokenizer else None)
    config = bind_tokenizer(config, tokenizer, train_file, val_file)
    config = _precision(config, saved, device, quiet)
    config = _planned(config, saved, train_tokens, quiet, started)
    return ResolvedRun(config, tokenizer, train_tokens, val_tokens, source)


def _starting_point(config: RunConfig, run_dir: Path, resume: bool, saved: RunConfig | None,
                    model_overrides: Mapping[str, Any] | None) -> tuple[RunConfig, InitSource | None]:
    """With train.init_from: the config with the model (and tokenizer) of the weights the run starts from, and the
    source to load them from; a resume of a run that has checkpoints takes its own model (``saved``, the run's
    config.toml) and reads no source."""
    if not config.train.init_from:
        return config, None
    if resume and CheckpointManager(run_dir).checkpoints():
        if saved is not None:  # else _restore compares config.model with the checkpoint's
            config = with_model(config, saved.model, f"run {run_dir}", model_overrides)
        return config, None
    source = open_source(config.train.init_from)
    return adopt(config, source, model_overrides), source


def _tokenizer(config: RunConfig, source: InitSource | None) -> Tokenizer | None:
    """data.tokenizer, loaded; the one train.init_from read when it is the source's (``adopt`` put it there)."""
    from scratchlm.tokenizer.tokenizer import Tokenizer

    if source is not None and source.tokenizer is not None and config.data.tokenizer == str(source.tokenizer):
        return source.read_tokenizer
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
        planned: dict[str, dict[str, Any]] = {}
        for section, key in PLANNED_FIELDS:
            planned.setdefault(section, {})[key] = getattr(getattr(saved, section), key)
        return config.with_values(**planned)
    config, plan = plan_budget(config, train_tokens, started=started)
    config = _rank_zeros(config.with_values(train={"threads": plan.threads}))
    if not quiet:
        print(f"scratchlm train: {plan.describe(config, len(train_tokens))}", file=sys.stderr, flush=True)
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
        print(f"scratchlm train: {why}", file=sys.stderr, flush=True)
    return _rank_zeros(config.with_values(train={"dtype": dtype}))


def _rank_zeros(config: RunConfig) -> RunConfig:
    """Under torch.distributed, rank 0's config on every rank (its measured choices: all ranks train the same
    dtype and stop at the same step); else ``config``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        shared = [config.to_dict()]
        torch.distributed.broadcast_object_list(shared, src=0)
        return RunConfig.from_dict(shared[0])
    return config
