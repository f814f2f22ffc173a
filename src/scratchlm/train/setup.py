"""Building a run's pieces, each once, in the order ``train`` calls them: the device and its matmul precision, the
run directory, the token files and the memory check (through resolve.py), the model, its wrapping and the optimizer.
The demo and the benchmarks call them directly.

The model knows nothing of infrastructure (torchtitan-style): ``build_model`` switches its speed paths on
(model/kernels/) and ``wrap_model`` applies torch.compile from outside (a distributed launcher passes its own wrap),
so the model stays a plain module to save and load. A model whose training step cannot fit in the device's free
memory is refused before anything is allocated (``check_memory_fits``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from torch import nn

from scratchlm.accounting.memory import MemoryEstimate, estimate_memory
from scratchlm.config import DEVICE_PATTERN, RunConfig
from scratchlm.data.token_file import TokenFile, check_token_file, open_token_file
from scratchlm.model import TransformerLM, kernels
from scratchlm.optim.adamw import AdamW
from scratchlm.optim.groups import recipe_param_groups
from scratchlm.train.precision import has_bf16_arithmetic


def set_matmul_precision(device: torch.device, tf32: bool) -> None:
    """TF32 for fp32 matmuls on CUDA: several times the fp32 throughput on Ampere and newer, with fp32
    accumulation, which training tolerates (bf16 autocast rounds far more). Nothing changes on other devices."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


def check_dtype_on_device(dtype: str, device: torch.device) -> None:
    """fp16 training is for CUDA GPUs without bf16: its loss scaling (torch.amp.GradScaler) and speed are CUDA's;
    a CPU has no fp16 tensor cores to gain from, and bf16 (same memory, no scaling) runs everywhere else."""
    if dtype == "fp16" and device.type != "cuda":
        raise ValueError(f"train.dtype = fp16 needs a CUDA GPU (this run is on {device.type}): use fp32, or bf16 "
                         f"for mixed precision")


def select_device(name: str) -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; an explicit device must exist on this machine.

    The messages say "device", not a setting name: train.device, ``generate --device`` and ``eval --device`` all
    land here.
    """
    if not DEVICE_PATTERN.fullmatch(name):
        raise ValueError(f"device {name!r} is not one of auto, cpu, mps, cuda or cuda:N")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: CUDA is not available on this machine (use auto or cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {name!r}: MPS is not available on this machine (use auto or cpu)")
    return device


def training_memory(config: RunConfig, device: torch.device, world_size: int = 1) -> MemoryEstimate:
    """accounting/memory.py's estimate of one training step of this run on ``device``: a micro-batch of
    data.batch_size / train.grad_accum_steps sequences of model.context_length tokens at train.dtype, with

    - the optimizer state of the chosen optimizer: AdamW keeps two fp32 moments (8 B a parameter), Muon one
      momentum (4 B) for the matrices it takes (the recipe's groups on a bodiless "meta" copy of the model);
    - no h·T² attention probabilities where torch's fused SDPA runs (it recomputes them in backward);
    - with activation checkpointing, each block's input plus one block's internals (the one being recomputed);
    - under FSDP, this rank's shard of the weights, gradients and optimizer state.
    """
    model = config.model
    # fp16 takes the bytes bf16 does; auto (resolved after this check, by timing) is counted at fp32's
    dtype = "bf16" if config.train.dtype in ("bf16", "fp16") else "fp32"
    estimate = estimate_memory(model, model.context_length, config.micro_batch_size, dtype)
    muon = 0
    if config.optim.optimizer == "muon":
        meta = TransformerLM(model, device=torch.device("meta"))
        muon = sum(p.numel() for group in recipe_param_groups(meta, config.optim) if group["algorithm"] == "muon"
                   for p in group["params"])
    activations = dict(estimate.activations)
    fused = config.train.fused_attention if config.train.fused_attention is not None else device.type == "cuda"
    if fused:
        activations["attention_scores"] = 0
    if config.train.activation_checkpointing:
        width = 4 if dtype == "fp32" else 2
        for name in ("norms", "attention", "attention_scores", "ffn"):
            activations[name] //= model.num_layers
        activations["block_inputs"] = model.num_layers * config.micro_batch_size * model.context_length \
            * model.d_model * width
    shard = world_size if config.train.parallel == "fsdp" else 1
    return dataclasses.replace(estimate, parameters=estimate.parameters // shard,
                               gradients=estimate.gradients // shard,
                               optimizer_state=(estimate.optimizer_state - 4 * muon) // shard,
                               activations=activations)


def available_memory(device: torch.device) -> int | None:
    """Bytes free for a run on ``device`` now: CUDA's free device memory, or the RAM the kernel could give a
    process without swapping (Linux's MemAvailable); None where it is not known (MPS, a CPU elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if device.type != "cpu" or not meminfo.is_file():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # in kB
    return None


def check_memory_fits(config: RunConfig, device: torch.device, world_size: int = 1) -> None:
    """Refuse a run whose training step (``training_memory``) needs more than ``available_memory``, in one line.
    The estimate can be pessimistic (the allocator's reuse, kernels that keep less), so the CLI's
    --force-memory skips this check."""
    available = available_memory(device)
    estimate = training_memory(config, device, world_size)
    if available is None or estimate.total <= available:
        return
    activations = estimate.activation_total + sum(estimate.step_constant.values())
    parts = (f"params {_gigabytes(estimate.parameters + estimate.autocast_weights)}, "
             f"grads {_gigabytes(estimate.gradients)}, optimizer {_gigabytes(estimate.optimizer_state)}, "
             f"activations {_gigabytes(activations)} at micro-batch {estimate.batch} x {estimate.context} "
             f"{config.train.dtype}")
    raise ValueError(f"the model needs ~{_gigabytes(estimate.total)} to train ({parts}) but "
                     f"{_gigabytes(available)} is available on {device.type}: lower data.batch_size (or raise "
                     f"train.grad_accum_steps) or the model size, or pass --force-memory (the estimate can be "
                     f"pessimistic; at your own risk)")


def _gigabytes(size: int) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def open_token_files(config: RunConfig) -> tuple[TokenFile | None, TokenFile | None]:
    """data.train_path and data.val_path opened (header read, ids memory-mapped; None where unset), each once:
    their vocabulary and tokenizer hash are known only then, so ``check_data`` checks them afterwards."""
    return _open_tokens(config.data.train_path, "data.train_path"), _open_tokens(config.data.val_path,
                                                                                  "data.val_path")


def _open_tokens(path: str, key: str) -> TokenFile | None:
    if not path:
        return None
    try:
        return open_token_file(path)
    except FileNotFoundError as error:  # a run moved without its data: say how to give the data's new place
        raise FileNotFoundError(f"{key}: {error} (to train on, a moved or copied run needs --set {key}=FILE)") \
            from None


def check_data(config: RunConfig, train: TokenFile | None, val: TokenFile | None,
               tokenizer_hash: str | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The train (and validation) token arrays, checked against the model's vocab and the tokenizer's hash
    (data.tokenizer's; None checks no hash), each holding at least one training window."""
    if train is None:
        raise ValueError("data.train_path is not set: give a token file written by `scratchlm data encode`")
    train_tokens = _checked(train, "data.train_path", config, tokenizer_hash)
    return train_tokens, _checked(val, "data.val_path", config, tokenizer_hash) if val is not None else None


def _checked(opened: TokenFile, key: str, config: RunConfig, tokenizer_hash: str | None) -> np.ndarray:
    check_token_file(opened, vocab_size=config.model.vocab_size, tokenizer_hash=tokenizer_hash)
    needed = config.model.context_length + 1
    if opened.num_tokens < needed:
        raise ValueError(f"{opened.path} ({key}) holds {opened.num_tokens} tokens, fewer than model.context_length "
                         f"+ 1 = {needed} needed for one training window")
    return opened.tokens


def build_model(config: RunConfig, device: torch.device) -> TransformerLM:
    torch.manual_seed(config.train.seed)
    model = TransformerLM(config.model, device=device)
    model.check_inputs = False  # the token files were checked against the vocabulary when opened
    model.checkpoint_blocks = config.train.activation_checkpointing
    return kernels.apply(model, device, fused_attention=config.train.fused_attention)


def wrap_model(model: nn.Module, config: RunConfig) -> nn.Module:
    """Apply torch.compile from outside the model (a distributed launcher passes its own wrap instead)."""
    return torch.compile(model) if config.train.compile else model


def build_optimizer(model: nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    """AdamW, or Muon for the hidden matrices and AdamW for the rest as one optimizer (optim/groups.py)."""
    optim = config.optim
    groups = recipe_param_groups(model, optim)
    if optim.optimizer == "muon":
        from scratchlm.optim.hybrid import MuonAdamW

        ns_dtype = optim.muon_ns_dtype
        if ns_dtype == "auto":  # emulated bf16 is ~15x slower than float32 on a CPU (benchmarks.md)
            native, _ = has_bf16_arithmetic(next(model.parameters()).device)
            ns_dtype = "bfloat16" if native else "float32"
        hyper = {"muon": dict(lr=optim.muon_lr, momentum=optim.muon_momentum, adjust_lr_fn=optim.muon_adjust_lr,
                              ns_dtype=ns_dtype),
                 "adamw": dict(lr=optim.lr, betas=optim.betas, eps=optim.eps)}
        return MuonAdamW([{**hyper[group["algorithm"]], **group} for group in groups])
    return AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay)


def prepare_run_dir(run_dir: Path, resume: bool) -> None:
    """Refuse to overwrite a run that has checkpoints, and remove what crashed saves left. The caller holds the run
    directory's lock (run_lock.py), so the directory exists and is writable, and no other writer is alive."""
    checkpoints = run_dir / "checkpoints"
    if not resume and checkpoints.is_dir() and any(checkpoints.iterdir()):
        raise ValueError(f"run directory {run_dir} already holds checkpoints: pass --resume to continue that run, "
                         f"or choose another --run-dir")
    from scratchlm.train.checkpoint import CheckpointManager

    CheckpointManager(run_dir).remove_stale_temporaries()

