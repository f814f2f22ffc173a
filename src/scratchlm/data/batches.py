"""Batches of (inputs, targets) token windows from a 1-D token array, usually an ``np.memmap`` of a token file.

- ``get_batch``: B windows of T+1 tokens at uniform random starts; inputs are the first T tokens, targets the last
  T. Only the B·(T+1) sampled tokens are read: a (B, T+1) index array fancy-indexes the memmap, advised
  ``MADV_RANDOM`` first, so that page faults do not read ahead pages that random windows never use (figures in
  docs/benchmarks.md).
- ``BatchSampler``: the trainer's seeded sampler. Its numpy ``Generator`` is seeded from (seed, rank), so each
  rank of a distributed run draws its own stream; resuming from ``state_dict()`` reproduces the batches exactly.
- ``validation_batches``: consecutive non-overlapping windows over the validation file, in order: the same
  sample every evaluation, so validation curves are comparable.
- ``MaskedBatch``: a fine-tuning batch (finetune/packing.py makes them).

On CUDA the host batch is pinned and copied with ``non_blocking=True`` so the copy overlaps GPU work.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

STATE_VERSION = 1


class MaskedBatch(NamedTuple):
    """inputs (B, T), targets (B, T) with train.loss.IGNORED where the loss counts nothing, document_ids (B, T) of
    packed rows (the document each position belongs to; None: one document a row)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    document_ids: torch.Tensor | None


MALFORMED_STATE = "BatchSampler: the checkpoint's sampler state is malformed"


def _check_sizes(num_tokens: int, batch_size: int, context_length: int, what: str) -> None:
    if batch_size < 1 or context_length < 1:
        raise ValueError(f"{what}: batch_size and context_length must be >= 1, got batch_size={batch_size}, "
                         f"context_length={context_length}")
    if num_tokens < context_length + 1:
        raise ValueError(f"{what}: dataset has {num_tokens} tokens, fewer than context_length + 1 = "
                         f"{context_length + 1} needed for one (input, target) window")


def _as_token_array(dataset: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(dataset, np.ndarray):
        dataset = np.asarray(dataset)
    if dataset.ndim != 1:
        raise ValueError(f"{what}: dataset must be a 1-D token array, got shape {dataset.shape}")
    if dataset.dtype.kind not in "iu":
        raise ValueError(f"{what}: dataset must hold integer token ids, got dtype {dataset.dtype}")
    return dataset


def _advise_random_access(dataset: np.ndarray) -> None:
    """Turn off read-ahead on a memmap's mapping (a cheap syscall; a no-op for in-memory arrays)."""
    mapping = getattr(dataset, "_mmap", None)  # np.memmap and its slices keep the mmap.mmap object here
    if isinstance(mapping, mmap.mmap) and hasattr(mapping, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapping.madvise(mmap.MADV_RANDOM)


def _to_device(inputs: np.ndarray, targets: np.ndarray, device: str | torch.device) -> tuple[torch.Tensor, ...]:
    """(B, T) int arrays -> LongTensors on ``device``; pinned + non-blocking when the device is CUDA."""
    device = torch.device(device)
    x = torch.from_numpy(np.ascontiguousarray(inputs, dtype=np.int64))
    y = torch.from_numpy(np.ascontiguousarray(targets, dtype=np.int64))
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def get_batch(dataset: np.ndarray, batch_size: int, context_length: int, device: str | torch.device, *,
              generator: np.random.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``batch_size`` random windows; returns (inputs, targets), LongTensors of shape (B, T) on device.

    Without ``generator`` the global ``np.random`` state is used (seed it with ``np.random.seed``).
    """
    dataset = _as_token_array(dataset, "get_batch")
    _check_sizes(len(dataset), batch_size, context_length, "get_batch")
    _advise_random_access(dataset)
    high = len(dataset) - context_length  # exclusive bound: starts in [0, n - T - 1]
    if generator is None:
        starts = np.random.randint(0, high, size=batch_size, dtype=np.int64)
    else:
        starts = generator.integers(0, high, size=batch_size, dtype=np.int64)
    index = starts[:, None] + np.arange(context_length + 1, dtype=np.int64)  # (B, T+1)
    windows = dataset[index]  # reads only these B*(T+1) tokens
    return _to_device(windows[:, :-1], windows[:, 1:], device)


class BatchSampler:
    """Seeded, resumable random batches for one rank of a (possibly distributed) run."""

    def __init__(self, tokens: np.ndarray, batch_size: int, context_length: int, device: str | torch.device,
                 seed: int, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"BatchSampler: rank {rank} is not in [0, world_size={world_size})")
        self.tokens = _as_token_array(tokens, "BatchSampler")
        _check_sizes(len(self.tokens), batch_size, context_length, "BatchSampler")
        self.batch_size, self.context_length, self.device = batch_size, context_length, device
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.batches_drawn = 0
        self._rng = np.random.default_rng([seed, rank])  # distinct, reproducible stream per rank

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (inputs, targets) batch, each (B, T) on the sampler's device."""
        self.batches_drawn += 1
        return get_batch(self.tokens, self.batch_size, self.context_length, self.device, generator=self._rng)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: the generator's bit state plus what is needed to check a resume is compatible."""
        return {"version": STATE_VERSION, "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                "batch_size": self.batch_size, "context_length": self.context_length,
                "num_tokens": len(self.tokens), "batches_drawn": self.batches_drawn,
                "bit_generator": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` left off; a state from a different setup, or a damaged one, is a
        ValueError."""
        self._check_state(state)
        try:
            self._rng.bit_generator.state = state["bit_generator"]
        except (KeyError, TypeError, ValueError) as error:  # numpy's own message does not say where it came from
            kind = type(self._rng.bit_generator).__name__
            raise ValueError(f"{MALFORMED_STATE}: its bit_generator {state['bit_generator']!r:.80} is not a {kind} "
                             f"state ({error})") from None
        self.seed = state["seed"]  # the stream continues from the saved state, whatever seed this run was given
        self.batches_drawn = int(state["batches_drawn"])

    def _check_state(self, state: dict[str, Any]) -> None:
        """A ValueError naming what is wrong unless ``state`` is a whole state_dict() of a compatible sampler."""
        if not isinstance(state, dict):
            raise ValueError(f"{MALFORMED_STATE}: expected a dict, got {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"BatchSampler: unsupported sampler state version {state.get('version')!r} "
                             f"(expected {STATE_VERSION})")
        missing = sorted(self.state_dict().keys() - state.keys())  # every key state_dict() writes
        if missing:
            raise ValueError(f"{MALFORMED_STATE}: it has no {missing}")
        for key in ("rank", "world_size", "batch_size", "context_length", "num_tokens"):
            mine = len(self.tokens) if key == "num_tokens" else getattr(self, key)
            if state[key] != mine:
                raise ValueError(f"BatchSampler: cannot resume, saved {key}={state[key]!r} but this run has "
                                 f"{key}={mine!r}")


def validation_batches(tokens: np.ndarray, batch_size: int, context_length: int, device: str | torch.device,
                       max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive non-overlapping windows over the whole file, ``batch_size`` at a time (the last may be smaller).

    Window i covers inputs tokens[i*T : (i+1)*T] and targets one token later; there are (n - 1) // T windows.
    """
    tokens = _as_token_array(tokens, "validation_batches")
    _check_sizes(len(tokens), batch_size, context_length, "validation_batches")
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"validation_batches: max_batches must be >= 1 or None, got {max_batches}")
    num_windows = (len(tokens) - 1) // context_length
    num_batches = -(-num_windows // batch_size)
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    return _validation_iterator(tokens, batch_size, context_length, device, num_windows, num_batches)


def _validation_iterator(tokens: np.ndarray, batch_size: int, context_length: int, device: str | torch.device,
                         num_windows: int, num_batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for batch_index in range(num_batches):
        first = batch_index * batch_size
        rows = min(batch_size, num_windows - first)
        start = first * context_length
        chunk = np.asarray(tokens[start:start + rows * context_length + 1])  # one contiguous read
        yield _to_device(chunk[:-1].reshape(rows, context_length), chunk[1:].reshape(rows, context_length), device)
