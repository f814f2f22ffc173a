"""AdamW (Loshchilov & Hutter, 2019) as a ``torch.optim.Optimizer`` subclass, from tensor primitives.

Per parameter it keeps ``step`` (a CPU float32 0-d tensor, as ``torch.optim.AdamW`` does, so state dicts are
interchangeable and reading it never syncs a GPU), ``exp_avg`` (first moment m) and ``exp_avg_sq`` (second
moment v). One step, for learning rate lr, betas (b1, b2), weight decay wd:

    theta <- theta * (1 - lr * wd)                     # decoupled weight decay, before the Adam update
    m     <- m + (g - m) * (1 - b1)                    # lerp: same rounding as torch
    v     <- v * b2 + (1 - b2) * g * g
    theta <- theta - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

The operations, their order and their Python-float scalars mirror ``torch.optim.AdamW`` exactly, so both the
per-tensor path and the multi-tensor path (``torch._foreach_*``, one call per (device, dtype) bucket) give
bit-identical trajectories to it; the tests hold us to that. The learning rate is read from
``param_group["lr"]`` at every step, so a schedule just writes that float.

The multi-tensor path keeps the denominators ``sqrt(v) / sqrt(1 - b2^t) + eps`` in buffers reused across steps
(not part of the state dict) where ``torch._foreach_sqrt`` allocates them anew: on a CPU, fresh model-sized
allocations are page-faulted in again on every step. Peak memory is the same as torch's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def check_nonnegative(optimizer: str, group: dict[str, Any]) -> None:
    """The lr, eps and weight_decay of a param group must be >= 0 (NaN is refused too); ``optimizer`` names it."""
    for key, name in (("lr", "learning rate"), ("eps", "eps"), ("weight_decay", "weight_decay")):
        if not group[key] >= 0.0:
            raise ValueError(f"{optimizer}: invalid {name} {group[key]!r} (must be >= 0)")


def validate_adamw(group: dict[str, Any]) -> None:
    """Checks the hyperparameters of the defaults and of every param group (also those added later)."""
    check_nonnegative("AdamW", group)
    betas = group["betas"]
    if len(betas) != 2:
        raise ValueError(f"AdamW: betas must be a pair (beta1, beta2), got {betas!r}")
    for index, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"AdamW: invalid beta{index + 1} {beta!r} (must be in [0, 1))")


def closure_loss(closure) -> torch.Tensor | None:  # noqa: ANN001 - torch.optim's closure contract
    """The loss of ``optimizer.step(closure)``'s closure, evaluated with gradients on (None without one)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay and bias correction; ``foreach=None`` picks the multi-tensor path."""

    def __init__(self, params: Iterable[nn.Parameter] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01, *,
                 foreach: bool | None = None) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, foreach=foreach)
        validate_adamw(defaults)
        super().__init__(params, defaults)  # calls add_param_group for each group
        self._denominators: dict[torch.Tensor, torch.Tensor] = {}  # param -> reusable buffer (foreach path)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        validate_adamw({**self.defaults, **param_group})  # before the group is added: a refused group leaves no trace
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - signature fixed by torch.optim.Optimizer
        loss = closure_loss(closure)
        for group in self.param_groups:
            adamw_group_step(self.state, group, self._denominators)
        return loss


def adamw_group_step(state: dict[torch.Tensor, dict[str, Any]], group: dict[str, Any],
                     denominators: dict[torch.Tensor, torch.Tensor]) -> None:
    """One AdamW step of one param group; ``state`` is the optimizer's per-param state (filled lazily) and
    ``denominators`` its scratch buffers for the multi-tensor path. Shared with the Muon+AdamW hybrid."""
    tensors = _gather(state, group)
    if not tensors[0]:
        return
    hyper = dict(lr=float(group["lr"]), beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                 weight_decay=group["weight_decay"])
    if group["foreach"] is None or group["foreach"]:
        _foreach_update(*tensors, _denominator_buffers(denominators, tensors[0]), **hyper)
    else:
        _single_tensor_update(*tensors, **hyper)


def _gather(state: dict[torch.Tensor, dict[str, Any]], group: dict[str, Any]) -> tuple[list[torch.Tensor], ...]:
    """Params that have gradients, with their grads and state (state created lazily on first use)."""
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for param in group["params"]:
        if param.grad is None:
            continue
        if param.grad.is_sparse:
            raise ValueError("AdamW does not support sparse gradients")
        param_state = state[param]
        if not param_state:
            param_state["step"] = torch.tensor(0.0, dtype=torch.float32)
            param_state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            param_state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        params.append(param)
        grads.append(param.grad)
        exp_avgs.append(param_state["exp_avg"])
        exp_avg_sqs.append(param_state["exp_avg_sq"])
        steps.append(param_state["step"])
    return params, grads, exp_avgs, exp_avg_sqs, steps


def _denominator_buffers(denominators: dict[torch.Tensor, torch.Tensor],
                         params: list[torch.Tensor]) -> list[torch.Tensor]:
    """One scratch tensor per param, reallocated only if the param changed shape, dtype or device."""
    buffers = []
    for param in params:
        buffer = denominators.get(param)
        if buffer is None or buffer.shape != param.shape or buffer.dtype != param.dtype \
                or buffer.device != param.device:
            buffer = denominators[param] = torch.empty_like(param, memory_format=torch.contiguous_format)
        buffers.append(buffer)
    return buffers


def _single_tensor_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                          exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *, lr: float, beta1: float,
                          beta2: float, eps: float, weight_decay: float) -> None:
    """The update one tensor at a time: the readable reference path."""
    for param, grad, exp_avg, exp_avg_sq, step_t in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        step_t += 1
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = step_t.item()  # a CPU tensor: no device sync
        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


def _foreach_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                    exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], denominators: list[torch.Tensor], *,
                    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """The same update with one ``torch._foreach_*`` call per op for each (device, dtype) bucket.

    ``denominators`` are scratch tensors shaped like ``params``, overwritten here.
    """
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for index, param in enumerate(params):
        buckets[(param.device, param.dtype)].append(index)
    torch._foreach_add_(steps, 1.0)
    for indices in buckets.values():
        b_params = [params[i] for i in indices]
        b_grads = [grads[i] for i in indices]
        b_exp_avgs = [exp_avgs[i] for i in indices]
        b_exp_avg_sqs = [exp_avg_sqs[i] for i in indices]
        step_values = [steps[i].item() for i in indices]
        if weight_decay != 0:
            torch._foreach_mul_(b_params, 1 - lr * weight_decay)
        torch._foreach_lerp_(b_exp_avgs, b_grads, 1 - beta1)
        torch._foreach_mul_(b_exp_avg_sqs, beta2)
        torch._foreach_addcmul_(b_exp_avg_sqs, b_grads, b_grads, 1 - beta2)
        neg_step_sizes = [(lr / (1 - beta1**step)) * -1 for step in step_values]
        bias_correction2_sqrts = [(1 - beta2**step) ** 0.5 for step in step_values]
        denoms = [denominators[i] for i in indices]
        for exp_avg_sq, denom in zip(b_exp_avg_sqs, denoms):
            torch.sqrt(exp_avg_sq, out=denom)  # no out= form of _foreach_sqrt exists
        torch._foreach_div_(denoms, bias_correction2_sqrts)
        torch._foreach_add_(denoms, eps)
        torch._foreach_addcdiv_(b_params, b_exp_avgs, denoms, neg_step_sizes)


def param_groups_for(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: matrices decay, 1-D tensors (norm gains, biases) do not.

    Embedding and output matrices are 2-D and therefore decay, as in the CS336 reference and nanoGPT: decay
    keeps their rows from growing without bound for rare tokens. Tied weights appear once (``parameters()``
    de-duplicates shared tensors). Empty groups are dropped.
    """
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]
