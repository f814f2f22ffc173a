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

That is exactly the rule of ``_merge_by_scan`` (GPT-2's and tiktoken's), so the ids are identical.
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
        order = np.argsort(keys)
        # Sorted pair keys with their rank and merged id, plus a sentinel that no pair matches.
        self._keys = np.append(keys[order], -1)
        self._ranks = np.append(ranks[order], NO_RANK)
        self._merged = np.append(merged[order], 0)
        self._byte_ids = np.asarray(byte_ids, dtype=np.int64)

    def merge(self, pieces: list[bytes]) -> list[list[int]]:
        """The BPE ids of each piece (each at least one byte), in order."""
        lengths = np.fromiter(map(len, pieces), np.int64, len(pieces))
        if len(pieces) == 0:
            return []
        if lengths.min() == 0:
            raise ValueError("cannot merge an empty piece")
        tokens = self._byte_ids[np.frombuffer(b"".join(pieces), dtype=np.uint8)]
        last = np.zeros(tokens.size, dtype=bool)
        last[np.cumsum(lengths) - 1] = True
        rank, merged = self._lookup(tokens[:-1], tokens[1:])
        rank, merged = np.append(rank, NO_RANK), np.append(merged, 0)
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
        ends = np.append(starts[1:], tokens.size)
        flat = tokens.tolist()
        for piece, start, end in zip(piece_index[finished].tolist(), starts[finished].tolist(),
                                     ends[finished].tolist()):
            results[piece] = flat[start:end]
        if finished.all():
            return None
        return np.repeat(~finished, ends - starts)

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
        pair = left * self._stride + right
        slot = np.searchsorted(self._keys[:-1], pair)
        slot[self._keys[slot] != pair] = len(self._keys) - 1  # the sentinel
        return self._ranks[slot], self._merged[slot]
