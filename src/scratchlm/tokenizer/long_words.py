"""BPE training on long pre-tokens (DNA, minified code, base64: a line of letters is ONE GPT-2 pre-token).

``train_bpe.py`` scans a word once per listed occurrence of a merged pair: quadratic for a word of a megabyte. Words
of at least ``train_bpe.LONG_WORD_MIN_BYTES`` bytes are merged here with numpy instead:

- The long words of equal count lie end to end in one id array (uint16 while ids fit, else uint32), each after a
  separator (the dtype's largest value, never an id), so no pair crosses two words.
- A merge of (a, b) finds its occurrences by comparing the array, read as pairs of ids (one wider integer each),
  with the pair's code from an even and an odd start. For a == b a run of a's merges from its left end, as the
  reference does. Around each occurrence (left, a) and (b, right) lose the word's count and (left, new) and
  (new, right) gain it; back-to-back occurrences turn (b, a) into (new, new). The changes are summed per pair
  with ``np.unique`` and returned to the trainer; the array is compacted in place.
- ``pair_counts`` tells a merge whether to scan at all, so a few long words cost only the merges that touch them.

Memory is 2 bytes a symbol (4 past 65,535 ids), never a Python object per symbol.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from scratchlm.tokenizer.fast.long_merge import compact_in_place, leftmost_non_overlapping

_LOW_MASK = (1 << 32) - 1
_CHUNK = 1 << 22  # pairs counted at a time (bounds the temporaries)
_PAIR_DTYPE = {np.dtype(np.uint16): np.uint32, np.dtype(np.uint32): np.uint64}

Pair = tuple[int, int]


class LongWords:
    """The long words of a corpus (ids below ``id_limit``), grouped by count, and the weighted counts of the pairs
    inside them."""

    def __init__(self, words: dict[bytes, int], id_limit: int) -> None:
        self._dtype = np.dtype(np.uint16 if id_limit < np.iinfo(np.uint16).max else np.uint32)
        self._separator = int(np.iinfo(self._dtype).max)
        by_count: defaultdict[int, list[bytes]] = defaultdict(list)
        for word, count in words.items():
            by_count[count].append(word)
        self._groups = [(count, self._laid_end_to_end(group)) for count, group in by_count.items()]
        self.pair_counts: dict[Pair, int] = {}
        for count, symbols in self._groups:
            for pair, occurrences in self._byte_pair_counts(symbols).items():
                self.pair_counts[pair] = self.pair_counts.get(pair, 0) + count * occurrences

    def merge(self, pair: Pair, new_id: int) -> dict[Pair, int]:
        """Merge every occurrence of pair (left to right) into new_id; return the change of each pair's count."""
        if self.pair_counts.pop(pair, 0) == 0:
            return {}
        codes, weights = [], []
        for index, (count, symbols) in enumerate(self._groups):
            starts = self._occurrences(symbols, *pair)
            if starts.size == 0:
                continue
            group_codes, signs = self._pair_changes(symbols, starts, pair, new_id)
            codes.append(group_codes)
            weights.append(signs * count)
            symbols[starts] = new_id
            self._groups[index] = (count, compact_in_place(starts + 1, symbols)[0])
        changed, inverse = np.unique(np.concatenate(codes), return_inverse=True)
        deltas = np.bincount(inverse, weights=np.concatenate(weights)).astype(np.int64)
        changes: dict[Pair, int] = {}
        merged_code = _code(*pair)  # (a, a) next to a merged (a, a): the merged pair is gone already
        for code, delta in zip(changed.tolist(), deltas.tolist()):
            if delta and code != merged_code:
                changed_pair = (code >> 32, code & _LOW_MASK)
                changes[changed_pair] = delta
                total = self.pair_counts.get(changed_pair, 0) + delta
                if total:
                    self.pair_counts[changed_pair] = total
                else:
                    del self.pair_counts[changed_pair]
        return changes

    def _laid_end_to_end(self, words: list[bytes]) -> np.ndarray:
        """The words' bytes as ids, each word after a separator, with one separator at the end."""
        symbols = np.full(sum(map(len, words)) + len(words) + 1, self._separator, dtype=self._dtype)
        start = 1
        for word in words:
            symbols[start:start + len(word)] = np.frombuffer(word, np.uint8)
            start += len(word) + 1
        return symbols

    def _byte_pair_counts(self, symbols: np.ndarray) -> dict[Pair, int]:
        """Occurrences of each adjacent pair of bytes (the initial symbols are all bytes or separators)."""
        totals = np.zeros(256 * 256, np.int64)
        for start in range(0, symbols.size - 1, _CHUNK):  # in chunks: an int64 code per symbol at once is big
            left = symbols[start:start + _CHUNK].astype(np.int64)
            right = symbols[start + 1:start + 1 + _CHUNK].astype(np.int64)
            left = left[:right.size]
            inside = (left != self._separator) & (right != self._separator)
            totals += np.bincount(left[inside] * 256 + right[inside], minlength=256 * 256)
        codes = np.flatnonzero(totals)
        return {(int(code) >> 8, int(code) & 255): int(totals[code]) for code in codes}

    def _occurrences(self, symbols: np.ndarray, a: int, b: int) -> np.ndarray:
        """Start positions of the non-overlapping occurrences of (a, b), chosen left to right.

        Each pair of neighbours read as one wider integer is compared with (a, b)'s: one pass over the array from
        an even start and one from an odd start, instead of two comparisons and an ``&`` over the whole array.
        """
        wide = _PAIR_DTYPE[self._dtype]
        code = np.array([a, b], dtype=self._dtype).view(wide)[0]
        found = []
        for first in (0, 1):
            usable = (symbols.size - first) // 2 * 2
            found.append(np.flatnonzero(symbols[first:first + usable].view(wide) == code) * 2 + first)
        starts = np.sort(np.concatenate(found))
        return leftmost_non_overlapping(starts) if a == b else starts

    def _pair_changes(self, symbols: np.ndarray, starts: np.ndarray, pair: Pair,
                      new_id: int) -> tuple[np.ndarray, np.ndarray]:
        """When the (non-overlapping) pairs at starts merge into new_id: the pairs (as ``left << 32 | right``) that
        lose (-1) or gain (+1) an occurrence, once per occurrence."""
        a, b = pair
        follows = np.diff(starts, prepend=-3) == 2  # the occurrence right before ends where this one starts
        lefts = symbols[starts[~follows] - 1].astype(np.int64)
        lefts = lefts[lefts != self._separator]
        precedes = np.append(follows[1:], False)
        rights = symbols[starts[~precedes] + 2].astype(np.int64)
        rights = rights[rights != self._separator]
        doubles = np.ones(int(follows.sum()), np.int64)
        lost = np.concatenate((lefts << 32 | a, _code(b, 0) | rights, doubles * _code(b, a)))
        gained = np.concatenate((lefts << 32 | new_id, _code(new_id, 0) | rights, doubles * _code(new_id, new_id)))
        signs = np.concatenate((np.full(lost.size, -1.0), np.full(gained.size, 1.0)))
        return np.concatenate((lost, gained)), signs


def _code(left: int, right: int) -> int:
    return left << 32 | right
