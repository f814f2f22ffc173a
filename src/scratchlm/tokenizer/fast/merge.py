"""Rank-based BPE of one pre-token, faster than ``bpe.bpe_merge`` (the readable rule) and equal to it.

The rule: merge the adjacent pair with the lowest merge rank, leftmost first on ties (GPT-2's and tiktoken's).
Both loops here read ``bpe.merge_table``'s ``(left id, right id) -> (rank, merged id)``. Short pieces (nearly all
pre-tokens are a few bytes) use ``merge_by_scan``; long ones (``"x" * 100_000``) ``merge_with_heap``, which keeps
the cost O(n log n) instead of O(n^2). ``batch_merge.py`` applies the same rule to many pieces at once with numpy.
"""

from __future__ import annotations

import heapq
from itertools import islice

NO_MERGE = (float("inf"), -1)  # sorts after every real (rank, merged id)
# Pieces with at least this many bytes use heap merging; below it a linear scan per merge is faster.
HEAP_MERGE_MIN_BYTES = 256


def merge_ids(ids: list[int], ranks: dict[tuple[int, int], tuple[int, int]]) -> list[int]:
    """The BPE of a piece given as its byte ids, by whichever loop suits its length."""
    if len(ids) >= HEAP_MERGE_MIN_BYTES:
        return merge_with_heap(ids, ranks)
    return merge_by_scan(ids, ranks)


def merge_by_scan(ids: list[int], ranks: dict[tuple[int, int], tuple[int, int]]) -> list[int]:
    """Merge the lowest-rank adjacent pair (leftmost on ties) until none is mergeable.

    O(n) per merge, but in C: ``min`` and ``index`` over the pairs' (rank, merged id), of which only the two
    next to a merge change. Used for short pieces (most pre-tokens are a few bytes).
    """
    pair_ranks = [ranks.get(pair, NO_MERGE) for pair in zip(ids, islice(ids, 1, None))]
    while pair_ranks:
        best = min(pair_ranks)  # ties: equal tuples are the same pair, and min returns the leftmost
        if best is NO_MERGE:
            break
        index = pair_ranks.index(best)
        ids[index:index + 2] = [best[1]]
        del pair_ranks[index]
        if index < len(pair_ranks):
            pair_ranks[index] = ranks.get((ids[index], ids[index + 1]), NO_MERGE)
        if index > 0:
            pair_ranks[index - 1] = ranks.get((ids[index - 1], ids[index]), NO_MERGE)
    return ids


def merge_with_heap(ids: list[int], ranks: dict[tuple[int, int], tuple[int, int]]) -> list[int]:
    """Same result as ``merge_by_scan`` in O(n log n): a heap of (rank, position) over a linked list.

    A heap entry is stale when either end was merged away or changed since it was pushed; it is skipped on pop.
    Popping by (rank, position) merges the lowest rank first and, among equal ranks, the leftmost first.
    """
    n = len(ids)
    tokens = list(ids)
    next_index = list(range(1, n + 1))
    prev_index = list(range(-1, n - 1))
    alive = [True] * n
    heap = []
    for index in range(n - 1):
        found = ranks.get((tokens[index], tokens[index + 1]))
        if found is not None:
            heap.append((found[0], index, tokens[index], tokens[index + 1], found[1]))
    heapq.heapify(heap)
    while heap:
        _, index, left, right, merged = heapq.heappop(heap)
        right_index = next_index[index] if alive[index] else n
        if right_index >= n or tokens[index] != left or tokens[right_index] != right:
            continue  # stale
        tokens[index] = merged
        alive[right_index] = False
        next_index[index] = next_index[right_index]
        if next_index[index] < n:
            prev_index[next_index[index]] = index
        for a in (prev_index[index], index):
            b = next_index[a] if a >= 0 else n
            if a >= 0 and b < n and (found := ranks.get((tokens[a], tokens[b]))) is not None:
                heapq.heappush(heap, (found[0], a, tokens[a], tokens[b], found[1]))
    return [tokens[i] for i in range(n) if alive[i]]
