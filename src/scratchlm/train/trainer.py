"""The training loop: RunConfig in, a run directory (checkpoints, metrics.jsonl, curves.png, config.toml) out.

``train`` sets up the device and run directory (setup.py), resolves the run once (resolve.py: Fresh,
InitFrom(source) or Resume(checkpoint), tokenizer, data, plan), builds the model and optimizer and acts on the
start: it loads the checkpoint, copies the source's weights, or keeps the seeded init. ``_Loop`` runs the steps
(step.py) and owns the sync points: log, eval, checkpoint and stop.

- Distributed: a launcher passes its own ``wrap`` (DDP/FSDP2, distributed.py); only rank 0 logs, plots and saves.
- No host sync per step: the loss and non-finite values stay on the device until a log/eval/checkpoint step, so
  a diverged run is never checkpointed.
- Resume is exact: a checkpoint holds the model, optimizer, RNG, sampler and the loop's running values
  (``LoopState``), and metrics.jsonl is cut back to its step (bitwise equal losses on a CPU).
- SIGINT/SIGTERM finish the current step, save a checkpoint and return "interrupted".
- A time budget is re-planned at every log step (budget.LivePlan); a step that overruns it ends the run through the
  same path as the last step (final evaluation, checkpoint).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from scratchlm.config import RunConfig, TrainConfig
from scratchlm.data.batches import BatchSampler
from scratchlm.train import distributed
from scratchlm.train.allocator import keep_freed_memory
from scratchlm.train.budget import BudgetClock, LivePlan
from scratchlm.train.checkpoint import CheckpointManager
from scratchlm.train.loss import perplexity
from scratchlm.train.metrics import METRICS_FILE, MetricsLogger, device_peak_flops, truncate_records
from scratchlm.train.plots import CURVES_FILE, can_draw_curves, plot_curves
from scratchlm.train.resolve import (
    CONFIG_FILE,
    ExampleData,
    InitFrom,
    ResolvedRun,
    Resume,
    command_name,
    resolve_run,
)
from scratchlm.train.run_lock import locks_run
from scratchlm.train.setup import (
    build_model,
    build_optimizer,
    check_dtype_on_device,
    prepare_run_dir,
    select_device,
    set_matmul_precision,
    wrap_model,
)
from scratchlm.train.step import DivergenceWatch, evaluate, evaluate_masked, learning_rate, train_step
from scratchlm.train.tokenizer_identity import keep_tokenizer_copy

T = TypeVar("T")


@dataclass
class TrainResult:
    status: str  # finished | diverged | interrupted
    final_step: int
    train_loss: float | None  # mean over the last log window
    best_val_loss: float | None
    tokens_per_s: float | None  # over this session's training time
    run_dir: Path
    message: str = ""


@dataclass
class LoopState:
    """The loop's running values, saved in every checkpoint's ``extra`` so a resume continues them exactly."""

    step: int = 0
    tokens: int = 0  # trained so far, across resumes (the world size, so tokens per step, may change on resume)
    wall_time: float = 0.0  # seconds of training so far, across resumes
    train_time: float = 0.0  # the same without evaluations and checkpoints
    budget_used: float = 0.0  # seconds of train.budget_seconds used so far, across resumes
    best_val_loss: float | None = None
    last_train_loss: float | None = None
    window_loss_sum: float = 0.0  # losses of the steps since the last log record
    window_steps: int = 0
    grad_scaler: dict | None = None  # fp16's loss scale and its growth tracker (GradScaler.state_dict)
    plan: dict | None = None  # a time budget's live plan (budget.LivePlan.to_dict), as re-planned so far


class StopRequest:
    """SIGINT/SIGTERM -> a flag the loop polls between steps; a second signal interrupts at once."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.received:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def model_step_flops(config: RunConfig) -> float:
    """Forward + backward FLOPs of one optimizer step (the MFU numerator; the optimizer's own work is left out)."""
    from scratchlm.accounting.params_flops import training_step_flops

    flops = training_step_flops(config.model, config.model.context_length, config.data.batch_size)
    return float(flops.forward + flops.backward)


@locks_run  # one trainer per run directory (run_lock.py)
def train(config: RunConfig, *, resume: bool = False, quiet: bool = False,
          wrap: Callable[[nn.Module, RunConfig], nn.Module] = wrap_model,
          device: torch.device | None = None, model_overrides: Mapping[str, Any] | None = None,
          force_memory: bool = False, saved: RunConfig | None = None, data: ExampleData | None = None) -> TrainResult:
    """Train ``config`` to ``train.max_steps`` (or divergence, a stop signal or the time budget).

    ``device`` (a torchrun rank's GPU) overrides train.device, which config.toml keeps as given (a rank's ``cuda:N``
    would be refused on resume under torchrun). ``model_overrides``: with train.init_from, the model fields the
    caller set on purpose (init_from.py). ``force_memory`` skips setup.check_memory_fits. ``saved``: on resume,
    the run's config.toml if the caller read it already. ``data``: a fine-tuning run's examples (finetune/data.py).
    """
    started = time.perf_counter()  # a budget counts from here: the probe and the start-up are spent from it
    rank, world_size = distributed.rank_and_world_size()
    is_main_process = rank == 0
    run_dir = Path(config.train.run_dir)
    device = device or select_device(config.train.device)
    check_dtype_on_device(config.train.dtype, device)
    set_matmul_precision(device, config.train.tf32)
    if device.type == "cpu":
        keep_freed_memory()  # allocator.py: ~20% of a CPU step is page faults otherwise
    if is_main_process:
        prepare_run_dir(run_dir, resume)
    run = resolve_run(config, resume=resume, device=device, world_size=world_size, model_overrides=model_overrides,
                      force_memory=force_memory, quiet=quiet or not is_main_process, saved=saved, started=started,
                      data=data)
    config = run.config
    default_threads = torch.get_num_threads()
    if config.train.threads is not None:
        torch.set_num_threads(config.train.threads)
    logger = None
    try:
        raw_model = build_model(config, device)
        optimizer = build_optimizer(raw_model, config)
        if run.data is not None:
            sampler = run.data.sampler(config, device, rank, world_size)
        else:
            sampler = BatchSampler(run.train_tokens, config.micro_batch_size, config.model.context_length, device,
                                   seed=config.train.seed, rank=rank, world_size=world_size)
        checkpoints = CheckpointManager(run_dir, keep_last=config.train.keep_last)
        state = LoopState()
        match run.start:
            case Resume(checkpoint=path):
                state = _restore(checkpoints, path, raw_model, optimizer, sampler)
            case InitFrom(source=source):
                source.load_into(raw_model)  # after build_model's seeded init: the RNG is where a scratch run's is
        if is_main_process:
            truncate_records(run_dir / METRICS_FILE, state.step)
            config = keep_tokenizer_copy(config, run.tokenizer, run_dir)  # data.tokenizer names RUN/tokenizer now
            config.save_toml(run_dir / CONFIG_FILE)  # its paths relative to the run: the run can be moved
        model = wrap(raw_model, config)
        # FSDP2 replaces the parameters: move the (restored) optimizer state onto the sharded ones.
        optimizer = distributed.optimizer_for(model, optimizer, lambda: build_optimizer(raw_model, config))
        if is_main_process:
            logger = MetricsLogger(run_dir, total_steps=config.train.max_steps, start_step=state.step, quiet=quiet,
                                   wandb_project=config.train.wandb_project if config.train.wandb else None,
                                   wandb_config=config.to_dict(), tensorboard=config.train.tensorboard)
        loop = _Loop(run, config, model, raw_model, optimizer, sampler, checkpoints, logger, state, device,
                     world_size, quiet, started)
        with StopRequest() as stop:
            return loop.run(stop)
    finally:
        if logger is not None:
            logger.close()
        torch.set_num_threads(default_threads)  # callers (the demo, tests) keep their own setting


def _restore(checkpoints: CheckpointManager, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
             sampler: BatchSampler) -> LoopState:
    """Load the checkpoint ``resolve`` chose (and checked) into the model, optimizer, RNG and sampler; the loop's
    running values it saved."""
    loaded = checkpoints.load(path, model, optimizer)
    distributed.restore_sampler(sampler, loaded["sampler_state"])  # rank 0's state, any world size
    fields = {f.name for f in dataclasses.fields(LoopState)}
    return LoopState(**{k: v for k, v in (loaded["extra"] or {}).items() if k in fields}, step=loaded["step"])


class _Loop:
    """The step loop and its sync points (log, eval, checkpoint, stop); only rank 0 logs and checkpoints."""

    def __init__(self, run: ResolvedRun, config: RunConfig, model: nn.Module, raw_model: nn.Module,
                 optimizer: torch.optim.Optimizer, sampler: BatchSampler, checkpoints: CheckpointManager,
                 logger: MetricsLogger | None, state: LoopState, device: torch.device, world_size: int, quiet: bool,
                 started: float) -> None:
        self.run_data, self.val_tokens = run.data, run.val_tokens  # fine-tuning's examples, or the val token file
        self.has_validation = run.val_tokens is not None or (run.data is not None and run.data.has_validation)
        self.config, self.model, self.raw_model, self.optimizer = config, model, raw_model, optimizer
        self.sampler, self.checkpoints, self.logger = sampler, checkpoints, logger
        self.state, self.device, self.world_size = state, device, world_size
        self.tokens_per_step = config.tokens_per_step * world_size
        self.watch = DivergenceWatch(device, config.train.max_loss)
        self.window_loss = torch.tensor(state.window_loss_sum, device=device)
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        self.peak_flops = device_peak_flops(device_name, config.train.dtype)
        self.step_flops = model_step_flops(config) if self.peak_flops else None
        self.budget = BudgetClock(config, used=state.budget_used, started=started)
        self.quiet = quiet or logger is None
        self.live = LivePlan.start(config, state.plan) if config.train.budget_seconds is not None else None
        if self.live is not None:
            self.config = self.live.applied(config)
        self.scaler = torch.amp.GradScaler(device.type) if config.train.dtype == "fp16" else None  # step.py
        if self.scaler is not None and state.grad_scaler:
            self.scaler.load_state_dict(state.grad_scaler)
        self.draws_curves = logger is not None and can_draw_curves()

    def run(self, stop: StopRequest) -> TrainResult:
        cfg = self.config.train
        self.start_step, self.start_wall, self.start_train_time = self.state.step, self.state.wall_time, \
            self.state.train_time
        # The throughput window starts here even when the restored loss window holds steps from before the resume.
        self.window_start_step, self.window_start = self.state.step, self.budget.training_seconds()
        status, message = "finished", ""
        if self.live is not None:
            self.live.begin_session(self.state.step, self.budget)
        while self.state.step < cfg.max_steps:
            lr = learning_rate(self.state.step, self.config, self.live and self.live.replanned())
            batches = [self.sampler.next() for _ in range(cfg.grad_accum_steps)]
            loss, grad_norm = train_step(self.model, self.optimizer, batches, lr=lr,
                                         grad_clip=self.config.optim.grad_clip, dtype=cfg.dtype, scaler=self.scaler)
            self.state.step += 1
            self.state.tokens += self.tokens_per_step
            step, final = self.state.step, self.state.step == cfg.max_steps
            self.watch.update(step, loss, grad_norm)
            self.window_loss += loss
            self.state.window_steps += 1
            if self.logger:
                self.logger.advance()
            out_of_time = not final and self._agreed(self.budget.exceeded(), step % cfg.log_every == 0)
            final = final or out_of_time  # the budget ends the run like its last step: evaluate, then save
            log, evaluate_now = step % cfg.log_every == 0 or final, step % cfg.eval_every == 0 or final
            stopping = self._agreed(stop.received is not None, log)
            save = step % cfg.checkpoint_every == 0 or final or stopping
            if not (log or evaluate_now or save):
                continue
            message = self.watch.check() or ""
            if distributed.any_rank(bool(message), self.device):  # every rank stops at the same step
                status, message = "diverged", message or f"diverged on another rank at step {step}"
                self._log_divergence()
                break
            if log:
                self._log_train(lr, grad_norm)
                if self.live is not None and not final:
                    cfg = self._replan(step)
            # A checkpoint records the val_loss of its own step only: best.json must not credit it with an older one.
            val_loss = self._paused(self._evaluate) if evaluate_now and self.has_validation else None
            if save:
                self._paused(functools.partial(self._checkpoint, val_loss))
            if stopping:
                status, message = "interrupted", f"stopped by {stop.received}; checkpoint saved at step {step}"
                break
            if out_of_time:
                message = (f"the time budget ({cfg.budget_seconds:g} s) ran out at step {step} of the planned "
                           f"{cfg.max_steps}: the machine was slower than its probe")
                break
        return self._finish(status, message)

    def _replan(self, step: int) -> TrainConfig:
        """Re-plan the rest of a budgeted run (budget.LivePlan) on rank 0, which every rank then follows; the
        train section of the config it leaves in force."""
        line = self.live.replan(step, self.budget, self.config) if self.logger is not None else None
        self.live = distributed.rank_zeros(self.live)
        self.config = self.live.applied(self.config)
        if line and not self.quiet:
            print(f"{command_name(self.config)}: {line}", file=sys.stderr, flush=True)
        return self.config.train

    def _agreed(self, wanted: bool, log: bool) -> bool:
        """Stop now (a signal came, or the budget ran out)? Alone: as soon as it is wanted. Distributed: at a log
        step once any rank wants it, so all ranks save and leave together (agreeing every step would cost a host
        sync per step)."""
        if self.world_size == 1:
            return wanted
        return log and distributed.any_rank(wanted, self.device)

    def _paused(self, work: Callable[[], T]) -> T:
        """``work()`` (an evaluation, a checkpoint), its time left out of the training time (self.budget)."""
        self.budget.begin_pause()
        result = work()
        self.budget.end_pause()
        return result

    def _wall_time(self) -> float:
        return self.start_wall + self.budget.clock() - self.budget.session_start

    def _train_time(self) -> float:
        """Training seconds so far, across resumes, without evaluations and checkpoints (read during one, the time
        at its start)."""
        return self.start_train_time + self.budget.training_seconds()

    def _log_train(self, lr: float, grad_norm: torch.Tensor) -> None:
        loss = (distributed.mean_across_ranks(self.window_loss) / self.state.window_steps).item()
        now = self.budget.training_seconds()
        seconds = max(now - self.window_start, 1e-9)
        steps = self.state.step - self.window_start_step
        self.state.last_train_loss = loss
        self.window_loss, self.state.window_steps = torch.zeros((), device=self.device), 0
        self.window_start, self.window_start_step = now, self.state.step
        if self.logger is None:
            return
        mfu = steps * self.step_flops / seconds / self.peak_flops if self.peak_flops else None
        self.logger.log({"kind": "train", "step": self.state.step, "tokens": self.state.tokens,
                         "wall_time": self._wall_time(), "train_time": self._train_time(), "loss": loss, "lr": lr,
                         "grad_norm": grad_norm.item(),
                         "tokens_per_s": steps * self.tokens_per_step / seconds, "mfu": mfu})

    def _log_divergence(self) -> None:
        """Train records of the last good step and the first bad one (loss and grad norm as measured), so a run
        that diverged between two log steps, even before the first, still draws its curve up to the divergence.
        Their tokens and lr are the steps' own; their times are this session's, interpolated (no step was timed
        alone), and their throughput is left out."""
        if self.logger is None:
            return
        done = self.state.step - self.start_step
        for step, loss, grad_norm in self.watch.steps():
            if step > self.window_start_step:  # the last good step may be a logged one already
                share = (step - self.start_step) / done
                self.logger.log({"kind": "train", "step": step,
                                 "tokens": self.state.tokens - (self.state.step - step) * self.tokens_per_step,
                                 "wall_time": self.start_wall + share * (self._wall_time() - self.start_wall),
                                 "train_time": self.start_train_time + share * (self._train_time()
                                                                                - self.start_train_time),
                                 "loss": loss, "lr": learning_rate(step - 1, self.config), "grad_norm": grad_norm})

    def _evaluate(self) -> float | None:
        """The validation loss on rank 0 (None on the other ranks), logged there."""
        # Under FSDP2 every rank takes part in the forward (all-gathers); otherwise only rank 0 evaluates.
        if self.logger is None and not distributed.is_fsdp(self.raw_model):
            return None
        # The unwrapped model: a DDP wrapper would try to sync buffers with ranks that are not evaluating.
        if self.run_data is not None:
            batches = self.run_data.validation_batches(self.config, self.device, self.config.train.eval_batches)
            val_loss = evaluate_masked(self.raw_model, batches, self.device, self.config.train.dtype)
        else:
            val_loss = evaluate(self.raw_model, self.val_tokens, self.config, self.device,
                                self.config.train.eval_batches)
        if self.logger is None:
            return None
        best = self.state.best_val_loss
        if math.isfinite(val_loss) and (best is None or val_loss < best):
            self.state.best_val_loss = val_loss
        self.logger.log({"kind": "eval", "step": self.state.step, "tokens": self.state.tokens,
                         "wall_time": self._wall_time(), "train_time": self._train_time(), "val_loss": val_loss,
                         "val_ppl": perplexity(val_loss)})
        self._plot()
        return val_loss

    def _checkpoint(self, val_loss: float | None) -> None:
        # Full, unsharded state: a collective under FSDP2, so every rank takes part before rank 0 saves.
        model, optimizer = distributed.checkpoint_sources(self.raw_model, self.optimizer)
        if self.logger is None:
            return
        self.state.wall_time, self.state.train_time = self._wall_time(), self._train_time()
        self.state.budget_used = self.budget.used()
        self.state.window_loss_sum = self.window_loss.item()
        self.state.grad_scaler = self.scaler.state_dict() if self.scaler is not None else None
        self.state.plan = self.live.to_dict() if self.live is not None else None
        extra = {k: v for k, v in dataclasses.asdict(self.state).items() if k != "step"}
        self.checkpoints.save(self.state.step, model, optimizer, config=self.config.to_dict(),
                              sampler_state=self.sampler.state_dict(), extra=extra, val_loss=val_loss)

    def _plot(self) -> None:
        if not self.draws_curves:
            return
        run_dir = Path(self.config.train.run_dir)
        plot_curves(self.logger.records, run_dir / CURVES_FILE, title=run_dir.name)

    def _finish(self, status: str, message: str) -> TrainResult:
        trained = (self.state.step - self.start_step) * self.tokens_per_step
        seconds = self.budget.training_seconds()
        if self.logger is not None:
            self.logger.log({"kind": "end", "step": self.state.step, "status": status, "message": message})
            self._plot()
        if self.live is not None and not self.quiet:
            print(f"{command_name(self.config)}: {self.live.summary(self.state.step, self.budget)}", file=sys.stderr,
                  flush=True)
        return TrainResult(status=status, final_step=self.state.step, train_loss=self.state.last_train_loss,
                           best_val_loss=self.state.best_val_loss,
                           tokens_per_s=trained / seconds if trained and seconds > 0 else None,
                           run_dir=Path(self.config.train.run_dir), message=message)
