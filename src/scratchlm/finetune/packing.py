"""Rendered examples -> the rows of training batches, and a seeded, resumable sampler over them.

A row holds ``row_length`` = context_length + 1 tokens: its first T are the inputs, its last T the targets.
**packed** (the default) puts several examples in a row, best-fit decreasing, so few slots are padding; each token
carries the index of its example (``documents``), and the model keeps attention and positions inside each example
(``TransformerLM(document_ids=...)``), so every example is computed exactly as alone. **padded** puts one example
in a row, and a batch is cut to its longest row (right padding, which causal attention never reads).

A target counts when the loss counts its token (rendering.py) and it belongs to the same example as the input
before it; every other target is ``IGNORED``. ``RowSampler``'s epochs are permutations seeded by (seed, rank,
epoch), so its state is three integers and a resume continues exactly.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from scratchlm.config import PACKINGS
from scratchlm.data.batches import MaskedBatch
from scratchlm.finetune.rendering import Rendered
from scratchlm.train.loss import IGNORED

STATE_VERSION = 1
PAD_DOCUMENT = -1  # the document of padding slots


@dataclass(frozen=True)
class Rows:
    """``tokens``, ``counted`` and ``documents``, each (N, row_length); ``lengths`` (N,): the filled slots of each
    row (a row's padding is at its end); ``packed``: several documents a row (their attention is kept apart)."""

    tokens: np.ndarray  # int64
    counted: np.ndarray  # bool
    documents: np.ndarray  # int64, PAD_DOCUMENT in padding
    lengths: np.ndarray  # int64
    packed: bool

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def counted_targets(self) -> int:
        """How many targets the loss counts over all rows."""
        return int(_counted_targets(self.counted, self.documents).sum())

    def batch(self, index: np.ndarray, device: torch.device | str) -> MaskedBatch:
        """Rows ``index`` as a batch on ``device``: inputs, targets (IGNORED where not counted), and the documents
        (packed rows only). A padded batch is cut to its longest row."""
        width = int(self.lengths[index].max()) if not self.packed else self.tokens.shape[1]
        tokens, counted = self.tokens[index, :width], self.counted[index, :width]
        documents = self.documents[index, :width]
        targets = np.where(_counted_targets(counted, documents), tokens[:, 1:], IGNORED)
        document_ids = _on_device(documents[:, :-1], device) if self.packed else None
        return MaskedBatch(_on_device(tokens[:, :-1], device), _on_device(targets, device), document_ids)


def _counted_targets(counted: np.ndarray, documents: np.ndarray) -> np.ndarray:
    """(N, W-1) bool: the target at column j (token j + 1) counts, and continues the document of token j."""
    return counted[:, 1:] & (documents[:, 1:] == documents[:, :-1]) & (documents[:, 1:] != PAD_DOCUMENT)


def _on_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """An int array as a LongTensor on ``device``; pinned + non-blocking when the device is CUDA."""
    tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def build_rows(examples: Sequence[Rendered], row_length: int, packing: str, pad_id: int = 0) -> Rows:
    """The rows of ``examples`` (each at most ``row_length`` tokens), packed or padded (module docstring)."""
    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
    too_long = [e.where for e in examples if len(e) > row_length]
    if too_long:
        raise ValueError(f"build_rows: {too_long[0]} is longer than a row ({row_length} tokens): cut it first")
    members = _best_fit(examples, row_length) if packing == "packed" else [[i] for i in range(len(examples))]
    tokens = np.full((len(members), row_length), pad_id, dtype=np.int64)
    counted = np.zeros((len(members), row_length), dtype=bool)
    documents = np.full((len(members), row_length), PAD_DOCUMENT, dtype=np.int64)
    lengths = np.zeros(len(members), dtype=np.int64)
    for row, indices in enumerate(members):
        at = 0
        for index in indices:
            example = examples[index]
            tokens[row, at:at + len(example)] = example.ids
            counted[row, at:at + len(example)] = example.counted
            documents[row, at:at + len(example)] = index
            at += len(example)
        lengths[row] = at
    return Rows(tokens, counted, documents, lengths, packing == "packed")


def _best_fit(examples: Sequence[Rendered], row_length: int) -> list[list[int]]:
    """Best-fit decreasing: the examples' indices by row, longest placed first, each into the row with the least
    room that holds it (a new row when none does). Ties keep the examples' order, so the result is deterministic."""
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i]), i))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free slots, row), sorted
    for index in order:
        size = len(examples[index])
        at = bisect.bisect_left(room, (size, -1))
        if at == len(room):
            rows.append([index])
            free, row = row_length - size, len(rows) - 1
        else:
            free, row = room.pop(at)
            rows[row].append(index)
            free -= size
        bisect.insort(room, (free, row))
    return rows


class RowSampler:
    """Seeded, resumable batches of ``batch_size`` rows: epoch e visits the rows in the order of a permutation
    seeded by (seed, rank, e), so each rank of a distributed run draws its own stream. The interface of
    data/batches.py's BatchSampler, which the trainer drives: ``next``, ``state_dict``, ``load_state_dict``."""

    def __init__(self, rows: Rows, batch_size: int, device: torch.device | str, seed: int, rank: int = 0,
                 world_size: int = 1) -> None:
        if len(rows) < 1 or batch_size < 1:
            raise ValueError(f"RowSampler: needs at least one row and batch_size >= 1, got {len(rows)} rows and "
                             f"batch_size {batch_size}")
        self.rows, self.batch_size, self.device = rows, batch_size, device
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.epoch, self.position, self.batches_drawn = 0, 0, 0
        self._order = self._permutation(0)
        self.last_rows = np.zeros(0, dtype=np.int64)  # the rows of the last batch (what a benchmark counts)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, self.rank, epoch]).permutation(len(self.rows))

    def next(self) -> MaskedBatch:
        """The next batch (rows wrap into the next epoch)."""
        index = []
        while len(index) < self.batch_size:
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            index.append(self._order[self.position])
            self.position += 1
        self.batches_drawn += 1
        self.last_rows = np.asarray(index)
        return self.rows.batch(self.last_rows, self.device)

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "kind": "rows", "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "batch_size": self.batch_size, "num_rows": len(self.rows),
                "epoch": self.epoch, "position": self.position, "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` left off; a state of other rows or another batch size is a ValueError."""
        if not isinstance(state, dict) or state.get("kind") != "rows" or state.get("version") != STATE_VERSION:
            raise ValueError("RowSampler: the checkpoint's sampler state is not a fine-tuning row sampler's")
        for key, mine in (("batch_size", self.batch_size), ("num_rows", len(self.rows))):
            if state.get(key) != mine:
                raise ValueError(f"RowSampler: cannot resume, saved {key}={state.get(key)!r} but this run has "
                                 f"{key}={mine!r} (the same data and settings are needed)")
        self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), int(state["position"])
        self.batches_drawn = int(state["batches_drawn"])
        self._order = self._permutation(self.epoch)


def row_batches(rows: Rows, batch_size: int, device: torch.device | str,
                max_batches: int | None = None) -> Iterator[MaskedBatch]:
    """The rows in order, ``batch_size`` at a time (the last batch may be smaller): a fixed validation sample."""
    count = -(-len(rows) // batch_size)
    for start in range(0, min(count, max_batches or count) * batch_size, batch_size):
        yield rows.batch(np.arange(start, min(start + batch_size, len(rows))), device)
