"""One optimization step and evaluation: the learning-rate schedule, autocast, ``train_step``, ``evaluate`` and
``DivergenceWatch``. The loop around them is trainer.py.

- ``train_step``: k micro-batches, each loss divided by k so the accumulated gradient is that of one batch k times
  larger; global-norm clipping; the optimizer step at the scheduled rate. Loss and grad norm stay device tensors
  (no host sync), and ``DivergenceWatch`` records the first non-finite step on the device.
- bf16/fp16 autocast covers only the forward; the loss is taken in fp32 and the weights stay fp32. fp16's 5
  exponent bits underflow small gradients, so a ``torch.amp.GradScaler`` scales the loss and skips a step whose
  gradients overflowed; that step reports grad norm 0 (an overflow is the scaler's business, not divergence).
- Fine-tuning's ``MaskedBatch``es count only some targets: each micro-batch's summed loss is divided by the counted
  targets of the whole step, so every counted token weighs the same however the micro-batches split them.
- Under DDP/FSDP2 gradients are reduced on the last micro-batch only (``distributed.no_gradient_sync``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from scratchlm.config import RunConfig
from scratchlm.data.batches import MaskedBatch, validation_batches
from scratchlm.optim.clip import clip_gradients
from scratchlm.optim.schedule import Replanned, lr_cosine_schedule, lr_wsd_schedule
from scratchlm.train import distributed
from scratchlm.train.loss import IGNORED, cross_entropy


def learning_rate(step: int, config: RunConfig, replanned: Replanned | None = None) -> float:
    """The scheduled peak rate (optim.lr scale) at ``step``: warm-up, then cosine decay to min_lr at step
    ``cosine_cycle_iters`` (default: train.max_steps), or WSD's stable phase and decay over the last
    ``decay_fraction`` of train.max_steps. Every param group trains at this times its ``lr_scale``.

    Steps run from 0 to max_steps - 1 (the CS336 convention), so the last step trains just above min_lr, and step 0
    of a warm-up trains at lr 0. ``replanned``: a time budget's decay, re-planned as the run goes (train/budget.py)."""
    optim = config.optim
    if optim.schedule == "wsd":
        return lr_wsd_schedule(step, optim.lr, optim.min_lr, optim.warmup_iters, config.train.max_steps,
                               optim.decay_fraction, optim.decay_shape, replanned)
    cycle = config.train.max_steps if optim.cosine_cycle_iters is None else optim.cosine_cycle_iters
    return lr_cosine_schedule(step, optim.lr, optim.min_lr, optim.warmup_iters, cycle, replanned)


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # train.dtype -> autocast dtype (fp32: none)


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES.get(dtype, torch.bfloat16),
                          enabled=dtype in AUTOCAST_DTYPES)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               batches: list[tuple[torch.Tensor, torch.Tensor]] | list[MaskedBatch], *, lr: float, grad_clip: float,
               dtype: str = "fp32", scaler: torch.amp.GradScaler | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over micro-batches [(inputs (b, T), targets (b, T)), ...] or MaskedBatches; returns
    (loss, grad norm).

    Both are 0-d device tensors (no host sync): the loss is the mean over all micro-batches, the grad norm is
    measured before clipping. ``grad_clip`` = 0 measures the norm without clipping. A param group with an
    ``lr_scale`` (its own peak rate over optim.lr: Muon's matrices, the embeddings, the head) trains at lr times it.
    ``scaler``: fp16's loss scaling (module docstring).
    """
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    device = batches[0][0].device
    loss_sum = torch.zeros((), device=device)
    # What each micro-batch's loss is divided by: their number, or for MaskedBatches the targets the whole step
    # counts (a device tensor: no sync).
    divisor = len(batches)
    if isinstance(batches[0], MaskedBatch):
        divisor = sum((batch.targets != IGNORED).sum() for batch in batches).clamp_min(1)
    for index, batch in enumerate(batches):
        last = index == len(batches) - 1
        # DDP all-reduces gradients on every backward unless told not to: only the last micro-batch syncs.
        sync = contextlib.nullcontext() if last else distributed.no_gradient_sync(model)
        with sync:
            loss = _micro_batch_loss(model, batch, divisor, device, dtype)
            (loss if scaler is None else scaler.scale(loss)).backward()
        loss_sum += loss.detach()
    if scaler is not None:
        scaler.unscale_(optimizer)  # true gradients, so clipping and the reported norm mean what they say
    grad_norm = clip_gradients(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    grad_norm = distributed.as_full_tensor(grad_norm)  # FSDP2: a replicated DTensor -> a plain tensor
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)  # skipped when the gradients overflowed
        scaler.update()
        grad_norm = torch.where(torch.isfinite(grad_norm), grad_norm, 0.0)
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


def _micro_batch_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor] | MaskedBatch,
                      divisor: int | torch.Tensor, device: torch.device, dtype: str) -> torch.Tensor:
    """The loss of one micro-batch over ``divisor``: the mean over its targets, or a MaskedBatch's summed loss of
    the counted targets (module docstring)."""
    if isinstance(batch, MaskedBatch):
        with autocast(device, dtype):
            logits = model(batch.inputs, document_ids=batch.document_ids)  # (b, T, V)
        return cross_entropy(logits.float(), batch.targets, ignore_index=IGNORED, reduction="sum") / divisor
    inputs, targets = batch
    with autocast(device, dtype):
        logits = model(inputs)  # (b, T, V)
    return cross_entropy(logits.float(), targets) / divisor


@torch.no_grad()
def evaluate(model: nn.Module, tokens: np.ndarray, config: RunConfig, device: torch.device,
             max_batches: int | None = None) -> float:
    """Mean loss per token over the fixed validation sample (the first ``max_batches`` batches, or all)."""
    # The sum stays on the device (no sync per batch), in float64 where the device has it (MPS does not).
    total_dtype = torch.float32 if device.type == "mps" else torch.float64
    total, count = torch.zeros((), device=device, dtype=total_dtype), 0
    for inputs, targets in validation_batches(tokens, config.micro_batch_size, config.model.context_length,
                                              device, max_batches=max_batches):
        with autocast(device, config.train.dtype):
            logits = model(inputs)  # (b, T, V)
        total += cross_entropy(logits.float(), targets).to(total_dtype) * targets.numel()
        count += targets.numel()
    return (total / count).item()


@torch.no_grad()
def evaluate_masked(model: nn.Module, batches: Iterable[MaskedBatch], device: torch.device, dtype: str) -> float:
    """Mean loss per counted target over ``batches`` (fine-tuning's fixed validation rows): every counted token
    weighs the same, however the batches split them."""
    total_dtype = torch.float32 if device.type == "mps" else torch.float64
    total, count = torch.zeros((), device=device, dtype=total_dtype), torch.zeros((), device=device, dtype=torch.long)
    for batch in batches:
        total += _micro_batch_loss(model, batch, 1, device, dtype).to(total_dtype)  # the summed loss
        count += (batch.targets != IGNORED).sum()
    return (total / count).item()


class DivergenceWatch:
    """Records the first non-finite (or too large) step on the device, and the last good step before it;
    ``check`` and ``steps`` read them (a host sync)."""

    def __init__(self, device: torch.device, max_loss: float | None) -> None:
        self.max_loss = max_loss
        self.first_step = torch.full((), -1, dtype=torch.long, device=device)
        self.values = torch.zeros(2, device=device)  # (loss, grad norm) at that step
        self.last_good_step = torch.full((), -1, dtype=torch.long, device=device)
        self.last_good_values = torch.zeros(2, device=device)

    def update(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss) | ~torch.isfinite(grad_norm)
        if self.max_loss is not None:
            bad |= loss > self.max_loss
        before = self.first_step < 0
        values = torch.stack([loss, grad_norm.to(loss.dtype)])
        self.first_step = torch.where(bad & before, step, self.first_step)
        self.values = torch.where(bad & before, values, self.values)
        self.last_good_step = torch.where(~bad & before, step, self.last_good_step)
        self.last_good_values = torch.where(~bad & before, values, self.last_good_values)

    def steps(self) -> list[tuple[int, float, float]]:
        """(step, loss, grad norm) of the last good step (when this session ran one) and of the first bad one: what
        a diverged run logs, since the loop stops before logging the window it diverged in."""
        recorded = [(int(self.last_good_step.item()), *self.last_good_values.tolist()),
                    (int(self.first_step.item()), *self.values.tolist())]
        return [entry for entry in recorded if entry[0] >= 0]

    def check(self) -> str | None:
        step = int(self.first_step.item())
        if step < 0:
            return None
        loss, norm = self.values.tolist()
        too_large = self.max_loss is not None and math.isfinite(loss) and loss > self.max_loss
        limit = f" (train.max_loss = {self.max_loss})" if too_large else ""
        return f"diverged at step {step}: loss={loss:g}, grad_norm={norm:g}{limit}"
