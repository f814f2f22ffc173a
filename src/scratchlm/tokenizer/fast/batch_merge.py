"""Rank-based BPE of many pre-tokens at once, with numpy: the encoder's cold-cache path.

Encoding text that the caches have not seen (the first megabytes of a corpus, every worker of ``data encode``)
would spend its time running BPE on new pre-tokens one by one in Python, a few microseconds each. Here the distinct
pre-tokens of a block's new words are merged together, one merge per pre-token per round:

- Their bytes lie end to end in one token array, each pre-token a doubly linked list over its positions
  (``next``/``prev``; a merged-away token leaves its list). ``key[i]`` is ``rank << 32 | i`` for the pair
  (token i, the token after it), with ``NO_RANK`` at a pre-token's end and where no merge applies.
- Each round takes, per pre-token, the smallest key: the lowest rank and, among equal ranks, the leftmost
  position (one ``minimum.reduceat``). Pre-tokens whose smallest rank is ``NO_RANK`` are finished; the others
  merge that pair, and only the two pairs next to each merge are looked up again.
- Pre-tokens are laid out longest first. One of L bytes merges at most L - 1 times, so the pre-tokens that may
  still merge in round r are a prefix of the array, and each round scans only that prefix.

That is exactly the rule of ``merge.merge_by_scan`` (GPT-2's and tiktoken's), so the ids are identical.
"""

from __future__ import annotations

import numpy as np

NO_RANK = (1 << 31) - 1  # above every real rank; a key is rank << 32 | position, a pair value rank << 32 | id
_LOW_MASK = (1 << 32) - 1
_FINISHED = NO_RANK << 32  # keys at or above it cannot merge
_MERGED_AWAY = _FINISHED | _LOW_MASK  # a position merged into the one before it; live positions are below it


class BatchMerger:
    """Merges byte strings with a merge table ``(left id, right id) -> (rank, merged id)``."""

    def __init__(self, merge_table: dict[tuple[int, int], tuple[int, int]], byte_ids: list[int]) -> None:
        size = len(merge_table)
        # Every id (bytes and merge results) is below stride - 1, so pair keys are unique, and stride - 1 is an
        # id in no pair: the sentinel token before and after every pre-token.
        self._stride = 2 + max([merged_id for _, merged_id in merge_table.values()] + byte_ids)
        keys = np.fromiter((left * self._stride + right for left, right in merge_table), np.int64, size)
        ranks = np.fromiter((rank for rank, _ in merge_table.values()), np.int64, size)
        merged = np.fromiter((merged_id for _, merged_id in merge_table.values()), np.int64, size)
        if size and ranks.max() >= NO_RANK:
            raise ValueError(f"too many merges for batch merging ({size})")
        self._pairs = _PairTable(keys, ranks << 32 | merged)
        self._byte_ids = np.asarray(byte_ids, dtype=np.int64)
        # The first round's pairs are all byte pairs: a dense 256 x 256 table answers them in one gather.
        first_bytes, second_bytes = np.divmod(np.arange(256 * 256), 256)
        self.byte_pair_value = self.pair_values(self._byte_ids[first_bytes],
                                                 self._byte_ids[second_bytes]).reshape(256, 256)
        self.sentinel = self._stride - 1  # a token in no pair: nothing merges with it

    def merge(self, data: bytes, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """BPE of pieces laid end to end in data, ``lengths[i]`` bytes each (at least one).

        Returns (the ids of all pieces end to end, in order; the number of ids of each piece).
        """
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.size == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        if lengths.min() <= 0:
            raise ValueError("cannot merge an empty piece")
        if lengths.sum() >= _LOW_MASK:  # positions must stay below _MERGED_AWAY's low bits
            raise ValueError(f"too many bytes for one batch ({lengths.sum()})")
        order = np.argsort(-lengths, kind="stable")  # longest first
        tokens, key, merged, next_, prev, starts = self._longest_first(np.frombuffer(data, np.uint8), lengths, order)
        size = tokens.size - 1  # the last slot is the sentinel
        descending = -lengths[order]
        for round_ in range(int(lengths.max()) - 1):
            mergeable = int(np.searchsorted(descending, -(round_ + 2), side="right"))  # pieces of >= round + 2 bytes
            end = starts[mergeable] if mergeable < starts.size else size
            best = np.minimum.reduceat(key[:end], starts[:mergeable])
            position = best[best < _FINISHED] & _LOW_MASK
            if position.size == 0:
                break
            self._merge_at(position, tokens, key, merged, next_, prev)
        alive = key[:size] != _MERGED_AWAY
        counts = np.empty(lengths.size, np.int64)
        counts[order] = np.add.reduceat(alive, starts)
        id_starts = np.empty(lengths.size, np.int64)
        id_starts[order] = run_starts(counts[order])  # where each piece's ids are in the longest-first layout
        return take_runs(tokens[:size][alive], id_starts, counts), counts

    def _longest_first(self, data: np.ndarray, lengths: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, ...]:
        """The byte tokens in ``order``, their first keys and merged ids, linked lists, and each piece's start."""
        sorted_lengths = lengths[order]
        size = int(sorted_lengths.sum())
        starts = run_starts(sorted_lengths)
        ends = starts + sorted_lengths - 1
        data = take_runs(data, run_starts(lengths)[order], sorted_lengths)
        tokens = np.append(self._byte_ids[data], self.sentinel)
        next_ = np.arange(1, size + 2)
        next_[ends] = size
        next_[size] = size
        prev = np.arange(-1, size)
        prev[starts] = size
        value = np.append(self.byte_pair_value[data[:-1], data[1:]], _FINISHED)
        value[ends] = _FINISHED
        key = np.append(value & ~_LOW_MASK | np.arange(size), _FINISHED)
        return tokens, key, np.append(value & _LOW_MASK, 0), next_, prev, starts

    def _merge_at(self, position: np.ndarray, tokens: np.ndarray, key: np.ndarray, merged: np.ndarray,
                  next_: np.ndarray, prev: np.ndarray) -> None:
        """Merge each pair (token at position, the one after it) and look up the pairs it changed."""
        right = next_[position]
        after = next_[right]
        tokens[position] = merged[position]
        key[right] = _MERGED_AWAY
        next_[position] = after
        prev[after] = position  # the sentinel's prev is written too, and never read
        changed = np.concatenate((prev[position], position))  # the pairs that end and start at each merge
        value = self.pair_values(tokens[changed], tokens[next_[changed]])
        key[changed] = value & ~_LOW_MASK | changed
        merged[changed] = value & _LOW_MASK

    def pair_values(self, left: np.ndarray, right: np.ndarray) -> np.ndarray:
        """``rank << 32 | merged id`` of each pair; ``NO_RANK << 32`` where the pair has no merge."""
        return self._pairs.get(left * self._stride + right)


def run_starts(lengths: np.ndarray) -> np.ndarray:
    """Where each run starts when runs of these lengths lie end to end."""
    return np.cumsum(lengths) - lengths


def take_runs(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``values[starts[i]:starts[i] + lengths[i]]`` for each i, end to end."""
    return values[np.repeat(starts - run_starts(lengths), lengths) + np.arange(int(lengths.sum()))]


class _PairTable:
    """A read-only hash table int64 key -> int64 value with vectorized lookups: open addressing with linear
    probing in a power-of-two table at most a quarter full, so nearly every lookup is one gather (a binary
    search over the sorted keys costs ~17 dependent loads per pair)."""

    _MULTIPLIER = np.int64(-0x61C8864680B583EB)  # Fibonacci hashing (2^64 / phi, as int64): the top bits of key * it

    def __init__(self, keys: np.ndarray, values: np.ndarray) -> None:
        self._bits = max(int(4 * len(keys)).bit_length(), 4)
        self._mask = (1 << self._bits) - 1
        self._keys = np.full(self._mask + 1, -1, dtype=np.int64)
        self._values = np.full(self._mask + 1, _FINISHED, dtype=np.int64)
        home = self._home(keys)
        pending = np.arange(len(keys))
        self._max_probe = 0
        while pending.size:  # round p places keys p slots past home; a later key never frees an earlier slot
            slot = (home[pending] + self._max_probe) & self._mask
            free = self._keys[slot] == -1
            taken, first = np.unique(slot[free], return_index=True)  # one key per free slot this round
            placed = pending[free][first]
            self._keys[taken], self._values[taken] = keys[placed], values[placed]
            pending = np.setdiff1d(pending, placed, assume_unique=True)
            self._max_probe += pending.size > 0

    def _home(self, keys: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):  # the product wraps around on purpose
            return (keys * self._MULTIPLIER) >> (64 - self._bits) & self._mask

    def get(self, keys: np.ndarray) -> np.ndarray:
        """The value of each key; ``NO_RANK << 32`` for keys not in the table."""
        slot = self._home(keys)
        stored = self._keys[slot]
        hit = stored == keys
        values = np.where(hit, self._values[slot], _FINISHED)
        todo = np.flatnonzero(~hit & (stored != -1))  # an empty slot ends a key's probe: not in the table
        slot = slot[todo]
        for _ in range(self._max_probe):
            if not todo.size:
                break
            slot = (slot + 1) & self._mask
            stored = self._keys[slot]
            hit = stored == keys[todo]
            values[todo[hit]] = self._values[slot[hit]]
            going_on = ~hit & (stored != -1)
            todo, slot = todo[going_on], slot[going_on]
        return values
