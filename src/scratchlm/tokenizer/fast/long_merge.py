"""Rank-based BPE of one very long pre-token (a 50 MB line of letters is ONE GPT-2 pre-token) in bounded memory.

``merge.merge_with_heap`` holds a heap entry and linked-list ints per byte: ~200 bytes of Python objects a byte,
10 GB for 50 MB. Here the piece is two numpy arrays: ``tokens`` (int32, plus a sentinel at the end) and ``ranks``
(int32: the merge rank of the pair starting at each position, ``NO_RANK`` where none applies), 8 bytes a byte.
It merges in rounds, each for the lowest rank r present (one pass for ``min``, one for ``== r``):

- The rank-r pair (a, b) merges at its non-overlapping occurrences chosen left to right (for a == b a run of a's
  merges from its left end), exactly as the one-at-a-time rule would, *as long as no merge makes a pair of rank
  below r*: the rule merges the leftmost lowest pair, and a new pair of a lower rank would come first. The
  round therefore merges the occurrences up to and including the first one whose merge makes a lower-ranked pair
  (in the state where only the occurrences before it are merged), and the next round starts from there. Merges
  learned by BPE training never make a lower-ranked pair (a merge's inputs exist before it), so with them
  each round takes every occurrence and there is one round per rank that occurs.
- Only the pairs next to a merge are looked up again; the arrays are compacted in place.

Cost: O(length) numpy work per round, i.e. O(length x distinct ranks that occur) in all, and no Python object per
byte; the heap is faster on pieces of up to a megabyte (``LONG_PIECE_MIN_BYTES``) with large merge tables.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from scratchlm.tokenizer.fast.batch_merge import NO_RANK, BatchMerger

# Pieces of at least this many bytes are merged here; shorter ones by ``merge_with_heap`` (faster, ~200 B a byte).
LONG_PIECE_MIN_BYTES = 1 << 20
_CHUNK = 1 << 22  # positions handled at a time where a temporary per position would be large
_MIN_WINDOW_BYTES = 1 << 18  # a window's arrays stay in the CPU caches, so each round's passes run fast


class LongPieceMerger:
    """BPE of long byte strings with a ``BatchMerger``'s pair table (the same ranks and merged ids)."""

    def __init__(self, pairs: BatchMerger, merge_table: dict[tuple[int, int], tuple[int, int]],
                 byte_ids: list[int]) -> None:
        self._pairs = pairs
        self._byte_ids = np.asarray(byte_ids, dtype=np.int32)
        self._ids = np.array(range(pairs.sentinel), dtype=object)  # one int object per id, shared by the output
        self._num_merges = len(merge_table)
        self._lengths = _token_lengths(merge_table, byte_ids, pairs.sentinel) if _is_monotone(merge_table) else None
        self._window = max(_MIN_WINDOW_BYTES, 32 * self._num_merges)

    def merge(self, data: bytes) -> Iterator[int]:
        """The ids of data's BPE, left to right (yielded from shared int objects, a chunk at a time)."""
        data = np.frombuffer(data, np.uint8)
        if self._lengths is None:  # not monotone: no window is provably final, merge the piece whole
            yield from self._as_ints(self._merge_all(data))
            return
        start, window = 0, self._window
        while start < data.size:
            end = min(start + window, data.size)
            tokens = self._merge_all(data[start:end])
            settled = tokens.size if end == data.size else tokens.size - self._num_merges
            if settled <= 0:  # tokens so long that the window holds too few of them
                window *= 2
                continue
            yield from self._as_ints(tokens[:settled])
            start += int(self._lengths[tokens[:settled]].sum())

    def _as_ints(self, tokens: np.ndarray) -> Iterator[int]:
        ids = self._ids
        for start in range(0, tokens.size, _CHUNK):
            yield from ids[tokens[start:start + _CHUNK]].tolist()

    def _merge_all(self, data: np.ndarray) -> np.ndarray:
        """The BPE of data (at least one byte): the ids as int32."""
        tokens, ranks = self._initial(data)
        while ranks.size:
            rank = int(ranks.min())
            if rank == NO_RANK:
                break
            tokens, ranks = self._merge_round(tokens, ranks, rank, np.flatnonzero(ranks == rank))
        return tokens[:-1]

    def _initial(self, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Byte tokens with the sentinel after them, and the rank of each byte pair (NO_RANK for the last)."""
        tokens = np.append(self._byte_ids[data], np.int32(self._pairs.sentinel))
        ranks = np.full(data.size, NO_RANK, dtype=np.int32)
        for start in range(0, data.size - 1, _CHUNK):  # the table's int64 values one chunk at a time
            end = min(start + _CHUNK, data.size - 1)
            ranks[start:end] = self._pairs.byte_pair_value[data[start:end], data[start + 1:end + 1]] >> 32
        return tokens, ranks

    def _merge_round(self, tokens: np.ndarray, ranks: np.ndarray, rank: int,
                     starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Merge the pair of this rank at starts (its positions), as far as the one-at-a-time rule allows."""
        a, b = int(tokens[starts[0]]), int(tokens[starts[0] + 1])
        merged = int(self._pairs.pair_values(np.array([a]), np.array([b]))[0] & ((1 << 32) - 1))
        if a == b:
            starts = leftmost_non_overlapping(starts)
        follows = np.diff(starts, prepend=-3) == 2  # the occurrence before ends where this one starts
        new = np.full(starts.size, merged, dtype=np.int64)
        # tokens[-1] is the sentinel: a merge at position 0 has no left pair.
        made_left = np.where(follows, self._rank(new, new), self._rank(tokens[starts - 1], new))
        made_right = self._rank(new, tokens[starts + 2])  # if this is the last occurrence merged
        lower = np.flatnonzero(np.minimum(made_left, made_right) < rank)
        if lower.size:
            starts, follows = starts[:lower[0] + 1], follows[:lower[0] + 1]
        tokens[starts] = merged
        ranks[starts] = self._rank(tokens[starts], tokens[starts + 2])  # (new, new) before a following occurrence
        lefts = starts[~follows & (starts > 0)]
        ranks[lefts - 1] = self._rank(tokens[lefts - 1], tokens[lefts])
        kept, ranks = compact_in_place(starts + 1, tokens[:-1], ranks)  # tokens and ranks, both without the sentinel
        tokens[kept.size] = self._pairs.sentinel
        return tokens[:kept.size + 1], ranks

    def _rank(self, left: np.ndarray, right: np.ndarray) -> np.ndarray:
        return self._pairs.pair_values(left.astype(np.int64), right.astype(np.int64)) >> 32


def _is_monotone(merge_table: dict[tuple[int, int], tuple[int, int]]) -> bool:
    """Whether every merge comes after each merge that makes one of its two inputs (true of trained merges)."""
    if not merge_table:
        return True
    ranks, merged = np.array(list(merge_table.values()), dtype=np.int64).T
    inputs = np.array(list(merge_table), dtype=np.int64)
    made_last = np.full(int(max(merged.max(), inputs.max())) + 1, -1, dtype=np.int64)
    np.maximum.at(made_last, merged, ranks)  # the last rank that makes each id
    return bool((made_last[inputs].max(axis=1) < ranks).all())


def _token_lengths(merge_table: dict[tuple[int, int], tuple[int, int]], byte_ids: list[int], size: int) -> np.ndarray:
    """Bytes in each id (for a monotone table, where a merge's inputs are made before it)."""
    lengths = np.zeros(size, dtype=np.int64)
    lengths[byte_ids] = 1
    for (left, right), (_, merged) in sorted(merge_table.items(), key=lambda item: item[1][0]):
        lengths[merged] = lengths[left] + lengths[right]
    return lengths


def leftmost_non_overlapping(starts: np.ndarray) -> np.ndarray:
    """Of the sorted start positions of a pair (a, a), those merged left to right: in a run of consecutive starts
    (a run of a's) the first, the third, ..."""
    if starts.size < 2:
        return starts
    run_first = np.flatnonzero(np.diff(starts, prepend=-2) != 1)
    offsets = np.arange(starts.size) - np.repeat(run_first, np.diff(run_first, append=starts.size))
    return starts[offsets % 2 == 0]


def compact_in_place(removed: np.ndarray, *arrays: np.ndarray) -> list[np.ndarray]:
    """Each array (of one length) without the positions in removed, compacted in place a chunk at a time: views."""
    keep = np.ones(arrays[0].size, dtype=bool)
    keep[removed] = False
    written = 0
    for start in range(0, keep.size, _CHUNK):  # writes never pass the chunk being read
        chunk_keep = keep[start:start + _CHUNK]
        for values in arrays:
            kept = values[start:start + _CHUNK][chunk_keep]
            values[written:written + kept.size] = kept
        written += int(chunk_keep.sum())
    return [values[:written] for values in arrays]
