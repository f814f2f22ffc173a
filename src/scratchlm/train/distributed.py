"""Data-parallel training through PyTorch's own engine: DDP or FSDP2, applied to the model from outside.

- ``launch(config)``: under torchrun, init the process group (nccl on CUDA, gloo on CPU), pin each rank to
  ``cuda:LOCAL_RANK`` and yield train.parallel's wrap (``wrap_ddp`` or ``wrap_fsdp``); alone, a pass-through.
- ``no_gradient_sync(model)``: no gradient reduction for the micro-batches before the last (DDP's ``no_sync()``,
  FSDP2's ``set_requires_gradient_sync(False)``), so the trainer's accumulation works under both.
- Global batch: each rank draws ``data.batch_size`` sequences a step from its own stream seeded by (seed, rank) and
  gradients are averaged, so a step at world size N equals one single-process step on the N batches together.
- Checkpoints are always full and unsharded: ``full_state_dicts`` gathers them (a collective under FSDP2),
  ``load_full_state`` scatters them back, and ``restore_sampler`` replays each rank's stream from rank 0's saved
  draw count, so a checkpoint taken at world size N resumes at any M.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from scratchlm.config import RunConfig
from scratchlm.data.batches import BatchSampler

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
T = TypeVar("T")


@dataclass(frozen=True)
class Launch:
    """What the trainer needs from a (possibly) distributed start."""

    wrap: Callable[[nn.Module, RunConfig], nn.Module]
    device: torch.device | None = None  # this rank's device under torchrun; None: train.device decides
    is_main: bool = True  # rank 0: the process that logs and writes the run directory


def launched_by_torchrun() -> bool:
    """True when torchrun (or a launcher setting the same variables) started this process."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world_size() -> tuple[int, int]:
    """(this process's rank, the world size); (0, 1) without a process group."""
    return (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)


# The rendezvous store of the process group `setup` started (a TCP key-value store beside the backend's own
# connections), kept for `teardown`; None while none was started here.
_store: dist.Store | None = None


def setup(device: str = "auto") -> torch.device:
    """Init the process group from torchrun's environment and return this rank's device.

    ``device`` is train.device: auto/cuda -> ``cuda:LOCAL_RANK`` with nccl, cpu -> gloo. An explicit ``cuda:N``
    is refused: under torchrun each rank's GPU is its LOCAL_RANK.
    """
    global _store
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise ValueError(f"distributed setup: environment variables {missing} are not set; launch with "
                         f"`torchrun --nproc-per-node N -m scratchlm.train ...`")
    if device.startswith("cuda:"):
        raise ValueError(f"train.device = {device!r}: under torchrun use auto or cuda (rank r uses cuda:LOCAL_RANK)")
    if device == "mps":
        raise ValueError("train.device = 'mps': torch.distributed does not support MPS; use cpu (gloo) or cuda")
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise ValueError("train.device = 'cuda' but CUDA is not available on this host; use auto or cpu (gloo)")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local_rank} but this host has {torch.cuda.device_count()} CUDA "
                             f"device(s): --nproc-per-node must not exceed the GPU count")
        rank_device = torch.device("cuda", local_rank)
        torch.cuda.set_device(rank_device)  # before init: NCCL binds its communicator to the current device
    else:
        rank_device = torch.device("cpu")
    if not is_distributed():
        # The rendezvous init_process_group would run itself (env://: torchrun's variables, its agent's store),
        # run here so that teardown can use the store.
        _store, rank, world_size = next(dist.rendezvous("env://"))
        dist.init_process_group("nccl" if use_cuda else "gloo", store=_store, rank=rank, world_size=world_size,
                                device_id=rank_device if use_cuda else None)
    return rank_device


def teardown(*, clean: bool = True) -> None:
    """Destroy the process group; after a clean finish, first wait until every rank is out of its collectives.

    Why: a rank that tears down while a peer is still in a collective closes the connections under it, and the
    peer's gloo threads abort ("terminate called without an active exception"). A barrier alone does not
    suffice: it returns on one rank while another is still receiving its last message. So the ranks first meet
    in a barrier (the last collective), then report through the rendezvous store that they have left it, and
    destroy the group only when all have (a group that ``setup`` did not start has no store here: the barrier
    only). After an error there is no waiting: the peers may be inside another collective and would never arrive
    (torchrun stops them instead).
    """
    global _store
    if not is_distributed():
        return
    if clean:
        dist.barrier()
        if _store is not None:  # every rank says it has left the barrier, then waits for all to have
            left = [f"scratchlm/teardown/rank{rank}" for rank in range(dist.get_world_size())]
            _store.set(left[dist.get_rank()], "1")
            _store.wait(left)
    dist.destroy_process_group()
    _store = None


@contextlib.contextmanager
def launch(config: RunConfig) -> Iterator[Launch]:
    """Set up train.parallel (DDP/FSDP2) under torchrun and tear it down after, or pass through for one process."""
    from scratchlm.train.setup import wrap_model

    if not launched_by_torchrun():
        yield Launch(wrap=wrap_model)
        return
    device = setup(config.train.device)
    clean = False
    try:
        wrap = wrap_ddp if config.train.parallel == "ddp" else wrap_fsdp
        yield Launch(wrap=wrap, device=device, is_main=dist.get_rank() == 0)
        clean = True
    finally:
        teardown(clean=clean)


def wrap_ddp(model: nn.Module, config: RunConfig) -> nn.Module:
    """DistributedDataParallel, compiled as a whole when train.compile (DDPOptimizer splits at buckets)."""
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return torch.compile(ddp) if config.train.compile else ddp


def wrap_fsdp(model: nn.Module, config: RunConfig) -> nn.Module:
    """FSDP2: shard each block, then the root; parameters become DTensors in place (names unchanged).

    Build the optimizer AFTER this call: fully_shard replaces the parameter objects.
    """
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        if config.train.compile:
            block.compile()  # in place: a torch.compile wrapper would add "_orig_mod." to every name
        fully_shard(block)
    fully_shard(model)
    return model


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Within the block, backward accumulates gradients on each rank without reducing them across ranks: the
    trainer's micro-batches but the last. DDP (also compiled): its ``no_sync()``; FSDP2: gradient reduce-scatter
    off; a single-process module: nothing to turn off."""
    if is_fsdp(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    else:
        yield


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def mean_across_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of a 0-d tensor over all ranks (itself in a single process); every rank must call it."""
    if not is_distributed():
        return value
    total = value.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def rank_zeros(value: T) -> T:
    """Rank 0's ``value`` on every rank (a collective: every rank must call it); ``value`` itself in a single
    process. What rank 0 measured or planned (a dtype, a budget's plan), so that all ranks train alike."""
    if not is_distributed():
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when ``flag`` is True on any one (so all ranks stop together); a host sync."""
    if not is_distributed():
        return flag
    value = torch.tensor(int(flag), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def as_full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a DTensor result (FSDP2's grad norm is a replicated DTensor); others pass through."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


# ---- samplers ------------------------------------------------------------------------------------------------

def restore_sampler(sampler: BatchSampler, saved: dict[str, Any]) -> None:
    """Continue ``sampler`` (this rank's) from rank 0's saved state, at the same or another world size."""
    state = dict(saved, world_size=sampler.world_size)  # a rank's stream does not depend on the world size
    if saved.get("rank") != sampler.rank and "bit_generator" in saved:  # (fine-tuning's RowSampler has none: its
        # state, an epoch and a position, is every rank's at the same step)
        state.update(rank=sampler.rank, bit_generator=_replayed_generator_state(sampler, saved))
    sampler.load_state_dict(state)


def _replayed_generator_state(sampler: BatchSampler, saved: dict[str, Any]) -> dict[str, Any]:
    """The generator state rank ``sampler.rank`` reaches after ``batches_drawn`` batches (draws only).

    Mirrors how get_batch draws window starts: ``integers(0, n - T, size=B, dtype=int64)`` once per batch.
    """
    for key in ("batch_size", "context_length", "num_tokens", "batches_drawn", "seed"):
        if key not in saved:
            raise ValueError(f"cannot restore the batch sampler of rank {sampler.rank}: the saved sampler state "
                             f"has no {key!r}")
    generator = np.random.default_rng([saved["seed"], sampler.rank])
    high = int(saved["num_tokens"]) - int(saved["context_length"])
    for _ in range(int(saved["batches_drawn"])):
        generator.integers(0, high, size=int(saved["batch_size"]), dtype=np.int64)
    return generator.bit_generator.state


# ---- full (unsharded) state for checkpoints --------------------------------------------------------------------

def _full_options(cpu_offload: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)


def full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model state dict, optimizer state dict) as a single process would have them: full and unsharded.

    The optimizer dict uses parameter indices, as ``Optimizer.state_dict()`` does. Under FSDP2 this is a
    collective (call it on every rank); only rank 0's dicts hold tensors (on the CPU), the others are empty.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from scratchlm.train.checkpoint_state import unwrap, with_tuples

    model = unwrap(model)
    if not is_fsdp(model):
        return model.state_dict(), optimizer.state_dict()
    options = _full_options()
    model_state = get_model_state_dict(model, options=options)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    if not optimizer_state:  # ranks other than 0
        return model_state, optimizer_state
    index_of = {name: index for index, name in enumerate(_names_in_optimizer_order(model, optimizer))}
    return model_state, {
        "state": {index_of[name]: values for name, values in optimizer_state["state"].items()},
        "param_groups": [dict(with_tuples(group), params=[index_of[name] for name in group["params"]])
                         for group in optimizer_state["param_groups"]],
    }


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_state: dict | None,
                    optimizer_state: dict | None) -> None:
    """Inverse of ``full_state_dicts``: every rank passes the same full dicts (None: leave that part)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from scratchlm.train.checkpoint_state import unwrap

    model = unwrap(model)
    if not is_fsdp(model):
        if model_state is not None:
            model.load_state_dict(model_state)
        if optimizer is not None and optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state)
        return
    options = _full_options(cpu_offload=False)
    if model_state is not None:
        set_model_state_dict(model, model_state, options=options)
    if optimizer is None or optimizer_state is None:
        return
    names = _names_in_optimizer_order(model, optimizer)
    by_name = {
        "state": {names[int(index)]: values for index, values in optimizer_state["state"].items()},
        "param_groups": [dict(group, params=[names[int(index)] for index in group["params"]])
                         for group in optimizer_state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=options)


class FullState:
    """A gathered state dict behind the ``state_dict()`` call that CheckpointManager.save makes."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state


def checkpoint_sources(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
    """What to hand CheckpointManager.save: the module and optimizer themselves, or under FSDP2 their gathered
    full state (a collective: every rank calls this; only rank 0's result holds tensors)."""
    if not is_fsdp(model):
        return model, optimizer
    model_state, optimizer_state = full_state_dicts(model, optimizer)
    return FullState(model_state), FullState(optimizer_state)


def optimizer_for(model: nn.Module, optimizer: torch.optim.Optimizer,
                  build: Callable[[], torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """The optimizer to train ``model`` (as wrapped) with: ``optimizer`` itself, except under FSDP2, whose
    fully_shard replaced the parameters: then a new one from ``build()`` carrying over any (resumed) state."""
    if not is_fsdp(model):
        return optimizer
    sharded = build()
    state = optimizer.state_dict()
    if state["state"]:
        load_full_state(model, sharded, None, state)
    return sharded


def _names_in_optimizer_order(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the order ``Optimizer.state_dict()`` numbers them (groups in order, then params)."""
    name_of = {id(param): name for name, param in model.named_parameters()}
    return [name_of[id(param)] for group in optimizer.param_groups for param in group["params"]]
