"""Rank-based BPE of many pre-tokens at once, with numpy: the encoder's cold-cache path.

Encoding text that the caches have not seen (the first megabytes of a corpus, every worker of ``data encode``)
spends its time running BPE on new pre-tokens one by one in Python, a few microseconds each. Here all of a
block's new pre-tokens are merged together, one merge per pre-token per round:

- Their bytes are laid end to end in one token array; ``last[i]`` marks the last token of each pre-token, and
  ``rank[i]`` holds the merge rank of the pair (token i, token i+1), ``NO_RANK`` across pre-token ends and where
  no merge applies.
- Each round takes, per pre-token, the lowest rank and, among equal ranks, the leftmost position: one
  ``minimum.reduceat`` over ``rank << 32 | position``. Pre-tokens with nothing left to merge are finished and
  leave the arrays; the others merge that pair, and only the two pairs next to each merge are looked up again.

That is exactly the rule of ``merge.merge_by_scan`` (GPT-2's and tiktoken's), so the ids are identical.
"""

from __future__ import annotations

import numpy as np

NO_RANK = (1 << 31) - 1  # above every real rank; ranks and positions share one int64 as rank << 32 | position
_POSITION_MASK = (1 << 32) - 1


class BatchMerger:
    """Merges byte strings with a merge table ``(left id, right id) -> (rank, merged id)``."""

    def __init__(self, merge_table: dict[tuple[int, int], tuple[int, int]], byte_ids: list[int]) -> None:
        size = len(merge_table)
        # Every id a piece can hold (bytes and merge results) is below the stride, so pair keys are unique.
        self._stride = 1 + max([merged_id for _, merged_id in merge_table.values()] + byte_ids)
        keys = np.fromiter((left * self._stride + right for left, right in merge_table), np.int64, size)
        ranks = np.fromiter((rank for rank, _ in merge_table.values()), np.int64, size)
        merged = np.fromiter((merged_id for _, merged_id in merge_table.values()), np.int64, size)
        if size and ranks.max() >= NO_RANK:
            raise ValueError(f"too many merges for batch merging ({size})")
        self._pairs = _PairTable(keys, ranks, merged)
        self._byte_ids = np.asarray(byte_ids, dtype=np.int64)
        # The first round's pairs are all byte pairs: a dense 256 x 256 table answers them in one gather.
        first_bytes, second_bytes = np.divmod(np.arange(256 * 256), 256)
        rank, merged = self._lookup(self._byte_ids[first_bytes], self._byte_ids[second_bytes])
        self._byte_pair_rank, self._byte_pair_merged = rank.reshape(256, 256), merged.reshape(256, 256)

    def merge(self, pieces: list[bytes]) -> list[list[int]]:
        """The BPE ids of each piece (each at least one byte), in order."""
        lengths = np.fromiter(map(len, pieces), np.int64, len(pieces))
        if len(pieces) == 0:
            return []
        if lengths.min() == 0:
            raise ValueError("cannot merge an empty piece")
        data = np.frombuffer(b"".join(pieces), dtype=np.uint8)
        tokens = self._byte_ids[data]
        last = np.zeros(tokens.size, dtype=bool)
        last[np.cumsum(lengths) - 1] = True
        rank = np.append(self._byte_pair_rank[data[:-1], data[1:]], NO_RANK)
        merged = np.append(self._byte_pair_merged[data[:-1], data[1:]], 0)
        rank[last] = NO_RANK
        piece_index = np.arange(len(pieces))  # which input piece each remaining piece is
        results: list[list[int]] = [[] for _ in pieces]
        while True:
            starts = np.flatnonzero(np.concatenate(([True], last[:-1])))
            best = np.minimum.reduceat((rank << 32) | np.arange(tokens.size), starts)
            finished = (best >> 32) == NO_RANK
            keep = self._collect_finished(tokens, starts, finished, piece_index, results)
            if keep is None:
                return results
            position = best[~finished] & _POSITION_MASK
            tokens[position] = merged[position]
            last[position] = last[position + 1]
            keep[position + 1] = False
            new_index = np.cumsum(keep) - 1
            tokens, last, rank, merged = tokens[keep], last[keep], rank[keep], merged[keep]
            piece_index = piece_index[~finished]
            self._update_pairs(tokens, last, rank, merged, new_index[position])

    def _collect_finished(self, tokens: np.ndarray, starts: np.ndarray, finished: np.ndarray,
                          piece_index: np.ndarray, results: list[list[int]]) -> np.ndarray | None:
        """Store the finished pieces' ids; return a mask of the tokens to keep, or None when all are done."""
        if not finished.any():
            return np.ones(tokens.size, dtype=bool)
        lengths = np.diff(np.append(starts, tokens.size))
        finished_tokens = np.repeat(finished, lengths)
        flat = tokens[finished_tokens].tolist()
        start = 0
        for piece, length in zip(piece_index[finished].tolist(), lengths[finished].tolist()):
            results[piece] = flat[start:start + length]
            start += length
        if finished.all():
            return None
        return ~finished_tokens

    def _update_pairs(self, tokens: np.ndarray, last: np.ndarray, rank: np.ndarray, merged: np.ndarray,
                      position: np.ndarray) -> None:
        """Look up again the pairs that a merge at each position changed: its left and its right neighbour."""
        left = position[position > 0] - 1
        left = left[~last[left]]  # position starts its piece: the pair to its left crosses a piece boundary
        right = position[~last[position]]
        changed = np.concatenate((left, right))
        rank[changed], merged[changed] = self._lookup(tokens[changed], tokens[changed + 1])
        rank[position[last[position]]] = NO_RANK

    def _lookup(self, left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rank, merged id) of each pair; NO_RANK where the pair has no merge."""
        return self._pairs.get(left * self._stride + right)


class _PairTable:
    """A read-only hash table int64 key -> (rank, merged id) with vectorized lookups: open addressing with linear
    probing in a power-of-two table at most half full, so a lookup is a gather or two (a binary search over the
    sorted keys costs ~17 dependent loads per pair)."""

    _MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the top bits of key * 2^64/phi

    def __init__(self, keys: np.ndarray, ranks: np.ndarray, merged: np.ndarray) -> None:
        self._bits = max(int(2 * len(keys)).bit_length(), 4)
        size = 1 << self._bits
        # One extra slot at the end, never filled, is where every miss points.
        self._keys = np.full(size + 1, -1, dtype=np.int64)
        self._ranks = np.full(size + 1, NO_RANK, dtype=np.int64)
        self._merged = np.zeros(size + 1, dtype=np.int64)
        home = self._home(keys)
        pending = np.arange(len(keys))
        self._max_probe = 0
        while pending.size:  # round p places keys p slots past home; a later key never frees an earlier slot
            slot = (home[pending] + self._max_probe) & (size - 1)
            free = self._keys[slot] == -1
            taken, first = np.unique(slot[free], return_index=True)  # one key per free slot this round
            placed = pending[free][first]
            self._keys[taken], self._ranks[taken], self._merged[taken] = keys[placed], ranks[placed], merged[placed]
            pending = np.setdiff1d(pending, placed, assume_unique=True)
            self._max_probe += pending.size > 0

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return ((keys.astype(np.uint64) * self._MULTIPLIER) >> np.uint64(64 - self._bits)).astype(np.int64)

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rank, merged id) per key; (NO_RANK, 0) for keys not in the table."""
        size = len(self._keys) - 1
        found = np.full(keys.shape, size, dtype=np.int64)
        home = self._home(keys)
        todo = np.arange(keys.size)
        for probe in range(self._max_probe + 1):
            slot = (home[todo] + probe) & (size - 1)
            stored = self._keys[slot]
            hit = stored == keys[todo]
            found[todo[hit]] = slot[hit]
            todo = todo[~hit & (stored != -1)]
            if not todo.size:
                break
        return self._ranks[found], self._merged[found]
