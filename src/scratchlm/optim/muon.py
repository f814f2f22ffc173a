"""Muon (Jordan et al., 2024): momentum, orthogonalised by Newton-Schulz, for the 2-D matrices of hidden layers.

Per parameter it keeps one ``momentum_buffer`` (the name ``torch.optim.Muon`` uses, so state dicts are
interchangeable). One step, for learning rate lr, weight decay wd, momentum mu and gradient g:

    B     <- B + (g - B) * (1 - mu)                    # lerp: an EMA of the gradients, as torch does
    D     <- g + (B - g) * mu   if nesterov else B     # Nesterov: look one momentum step ahead
    O     <- NewtonSchulz(D)                           # ~ U V^T where D = U S V^T: every direction, unit size
    theta <- theta * (1 - lr * wd)                     # decoupled weight decay, with the unadjusted lr
    theta <- theta - adjusted_lr(lr, shape) * O

``adjust_lr_fn``: None or "original" scales lr by sqrt(max(1, rows / cols)) (Keller Jordan's Muon);
"match_rms_adamw" by 0.2 * sqrt(max(rows, cols)) (Moonshot, "Muon is Scalable for LLM Training"), which gives
the update the RMS of a typical AdamW update so AdamW's lr and weight decay can be reused.

The operations, their order and their dtypes mirror ``torch.optim.Muon`` (read in torch 2.13): Newton-Schulz runs in
bfloat16, each quintic term is one fused multiply-add (``addmm``), so the per-tensor path is bit-identical to
it; the tests hold us to that. The multi-tensor path stacks the matrices of one shape into a batch and runs
Newton-Schulz once per shape with ``baddbmm``: fewer, larger matrix products (the tests compare it with torch
too). Muon only updates matrices: embeddings, the output head and 1-D gains belong to AdamW; see
``scratchlm.optim.hybrid.MuonAdamW``, one optimizer that drives both.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from scratchlm.optim.adamw import check_nonnegative, closure_loss

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
MAX_NS_STEPS = 100  # torch's bound: more steps buy nothing and cost a matrix product each
MAX_BATCH_ELEMENTS = 2**24  # the multi-tensor path's batches: 64 MB of fp32 (all of a tinystories-17m bucket)
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # what Newton-Schulz may compute in


def validate_muon(group: dict[str, Any]) -> None:
    """Checks the hyperparameters of the defaults and of every param group (also those added later)."""
    check_nonnegative("Muon", group)
    momentum, coefficients, ns_steps = group["momentum"], group["ns_coefficients"], group["ns_steps"]
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"Muon: invalid momentum {momentum!r} (must be in [0, 1))")
    if group["ns_dtype"] not in NS_DTYPES:
        raise ValueError(f"Muon: invalid ns_dtype {group['ns_dtype']!r} (one of {sorted(NS_DTYPES)})")
    if len(coefficients) != 3:
        raise ValueError(f"Muon: ns_coefficients must be three numbers (a, b, c), got {coefficients!r}")
    if not isinstance(ns_steps, int) or not 0 < ns_steps < MAX_NS_STEPS:
        raise ValueError(f"Muon: invalid ns_steps {ns_steps!r} (must be an integer in [1, {MAX_NS_STEPS - 1}])")
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(f"Muon: unknown adjust_lr_fn {group['adjust_lr_fn']!r} (one of {ADJUST_LR_FNS})")


def refuse_last_group_unless_matrices(optimizer: torch.optim.Optimizer) -> None:
    """Refuses the group just added (its params are known only once torch has added it) if it holds a parameter
    that is not a 2-D matrix, naming it (by name where params were given as ``(name, param)`` pairs, else by
    position); the refused group is removed again, leaving no trace."""
    group, group_index = optimizer.param_groups[-1], len(optimizer.param_groups) - 1
    names = group.get("param_names")
    for index, param in enumerate(group["params"]):
        if param.dim() != 2:
            optimizer.param_groups.pop()
            which = f"{names[index]!r}" if names else f"number {index}"
            raise ValueError(f"Muon: parameter {which} of param group {group_index} has shape {tuple(param.shape)}; "
                             "Muon only updates 2-D matrices: give it to AdamW")


def newton_schulz(G: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: str = "bfloat16") -> torch.Tensor:
    """Orthogonalise G (m, n), or a batch of them (k, m, n): returns ~U V^T where G = U S V^T, in ``dtype``.

    Why: a gradient (and its momentum) of a weight matrix is nearly low rank: a few directions dominate and a
    plain step moves mostly along them. Replacing its singular values by 1 gives every direction the same step
    size. The SVD would do that exactly but is slow on accelerators; an odd matrix polynomial p(X) = aX + b XX^T X
    + c (XX^T)^2 X acts on each singular value s separately (U p(S) V^T), so iterating it pushes every s in
    (0, 1] towards 1, using matrix products only.

    The coefficients (3.4445, -4.775, 2.0315) are Keller Jordan's: chosen to make p'(0) = a as large as possible
    so that small singular values grow fast (x3.4 per step), at the price of not converging exactly to 1: the
    iteration settles into a band around 1, roughly [0.7, 1.2], which trains as well as exact
    orthogonalisation. Why 5 steps: each step costs three matrix products, and five bring singular values down
    to ~1/100 of the largest into that band (measured: four reach only ~1/10); momentum matrices rarely have
    much of their mass below that.

    Dividing by the Frobenius norm first (>= the spectral norm) puts every singular value in [0, 1], where the
    iteration converges; eps keeps a zero matrix at zero. A tall matrix is transposed so the Gram matrix
    A = XX^T is the smaller of the two. Each line is one fused multiply-add with a single rounding, as in
    ``torch.optim.Muon``, which runs in bfloat16: the iteration tolerates the rounding and is cheap in it on GPUs.
    ``dtype="float32"`` runs the same products in float32: more accurate, and faster on CPUs whose bfloat16 matrix
    products are slower than their float32 ones (those without bf16 arithmetic: docs/benchmarks.md); the trainer
    picks it there.
    """
    a, b, c = coefficients
    tall = G.size(-2) > G.size(-1)
    X = G.to(NS_DTYPES[dtype])
    X = X.mT if tall else X
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # singular values now in [0, 1]
    for _ in range(steps):
        A = X @ X.mT  # (m, m) Gram matrix, m = the short side
        B = _fused_multiply_add(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = _fused_multiply_add(X, B, X, beta=a)  # a X + (b A + c A^2) X
    return X.mT if tall else X


def _fused_multiply_add(input: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, *, beta: float,
                        alpha: float = 1.0) -> torch.Tensor:
    """beta * input + alpha * (m1 @ m2), rounded once: ``addmm`` for matrices, ``baddbmm`` for batches of them."""
    fma = torch.addmm if input.dim() == 2 else torch.baddbmm
    return fma(input, m1, m2, beta=beta, alpha=alpha)


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """The learning rate for a matrix of this shape (see the module docstring)."""
    rows, cols = shape
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


class Muon(torch.optim.Optimizer):
    """Muon for 2-D parameters, torch.optim.Muon's constructor; ``foreach=None`` picks the multi-tensor path."""

    def __init__(self, params: Iterable[nn.Parameter] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315), eps: float = 1e-7,
                 ns_steps: int = 5, adjust_lr_fn: str | None = None, *, foreach: bool | None = None,
                 ns_dtype: str = "bfloat16") -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn, foreach=foreach, ns_dtype=ns_dtype)
        validate_muon(defaults)
        super().__init__(params, defaults)  # calls add_param_group for each group

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        validate_muon({**self.defaults, **param_group})
        super().add_param_group(param_group)  # turns (name, param) pairs into params + param_names
        refuse_last_group_unless_matrices(self)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - signature fixed by torch.optim.Optimizer
        loss = closure_loss(closure)
        for group in self.param_groups:
            muon_group_step(self.state, group)
        return loss


def muon_group_step(state: dict[torch.Tensor, dict[str, Any]], group: dict[str, Any]) -> None:
    """One Muon step of one param group; ``state`` is the optimizer's per-param state (filled lazily).
    Shared with the Muon+AdamW hybrid."""
    params, grads, buffers = _gather(state, group)
    if not params:
        return
    hyper = dict(lr=float(group["lr"]), weight_decay=group["weight_decay"], momentum=group["momentum"],
                 nesterov=group["nesterov"], ns_coefficients=tuple(group["ns_coefficients"]),
                 ns_steps=group["ns_steps"], eps=group["eps"], adjust_lr_fn=group["adjust_lr_fn"],
                 ns_dtype=group.get("ns_dtype", "bfloat16"))  # a torch.optim.Muon state dict has no ns_dtype
    if group.get("foreach") in (None, True):  # a torch.optim.Muon state dict has no "foreach": the default
        _foreach_update(params, grads, buffers, **hyper)
    else:
        _single_tensor_update(params, grads, buffers, **hyper)


def _gather(state: dict[torch.Tensor, dict[str, Any]], group: dict[str, Any]) -> tuple[list[torch.Tensor], ...]:
    """Params that have gradients, with their grads and momentum buffers (created lazily on first use)."""
    params, grads, buffers = [], [], []
    for param in group["params"]:
        if param.grad is None:
            continue
        if param.grad.is_sparse:
            raise ValueError("Muon does not support sparse gradients")
        param_state = state[param]
        if "momentum_buffer" not in param_state:
            param_state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
        params.append(param)
        grads.append(param.grad)
        buffers.append(param_state["momentum_buffer"])
    return params, grads, buffers


def _single_tensor_update(params: list[torch.Tensor], grads: list[torch.Tensor], buffers: list[torch.Tensor], *,
                          lr: float, weight_decay: float, momentum: float, nesterov: bool,
                          ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float,
                          adjust_lr_fn: str | None, ns_dtype: str) -> None:
    """The update one matrix at a time: the readable reference path."""
    for param, grad, buffer in zip(params, grads, buffers):
        buffer.lerp_(grad, 1 - momentum)
        update = grad.lerp(buffer, momentum) if nesterov else buffer
        orthogonal = newton_schulz(update, ns_coefficients, ns_steps, eps, ns_dtype)
        param.mul_(1 - lr * weight_decay)
        param.add_(orthogonal, alpha=-adjusted_lr(lr, adjust_lr_fn, param.shape))


def _foreach_update(params: list[torch.Tensor], grads: list[torch.Tensor], buffers: list[torch.Tensor], *,
                    lr: float, weight_decay: float, momentum: float, nesterov: bool,
                    ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float,
                    adjust_lr_fn: str | None, ns_dtype: str) -> None:
    """The same update with the momentum in ``torch._foreach_*`` calls and one batched Newton-Schulz per
    (shape, device, dtype) bucket: the matrices of a bucket share their shape, hence their adjusted lr.

    A bucket is cut into batches of at most ``MAX_BATCH_ELEMENTS`` elements: the Nesterov updates and their
    stacked copy are temporaries the size of the batch, and a whole bucket of a large model (gpt2-xl: 192
    matrices of 1600x1600) would hold gigabytes of them at once.
    """
    buckets: dict[tuple[torch.Size, torch.device, torch.dtype], list[int]] = defaultdict(list)
    for index, param in enumerate(params):
        buckets[(param.shape, param.device, param.dtype)].append(index)
    for indices in buckets.values():
        per_batch = max(1, MAX_BATCH_ELEMENTS // params[indices[0]].numel())
        for start in range(0, len(indices), per_batch):
            batch = indices[start:start + per_batch]
            b_params = [params[i] for i in batch]
            b_grads = [grads[i] for i in batch]
            b_buffers = [buffers[i] for i in batch]
            torch._foreach_lerp_(b_buffers, b_grads, 1 - momentum)
            updates = torch._foreach_lerp(b_grads, b_buffers, momentum) if nesterov else b_buffers
            orthogonal = newton_schulz(torch.stack(updates), ns_coefficients, ns_steps, eps, ns_dtype)  # (k, m, n)
            torch._foreach_mul_(b_params, 1 - lr * weight_decay)
            torch._foreach_add_(b_params, orthogonal.unbind(0),
                                alpha=-adjusted_lr(lr, adjust_lr_fn, b_params[0].shape))
