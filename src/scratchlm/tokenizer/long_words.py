"""BPE training on long pre-tokens (DNA, minified code, base64: a line of letters is ONE GPT-2 pre-token).

``train_bpe.py`` keeps each word as a Python list and finds a merged pair's occurrences by scanning the word, once
per listed occurrence: fine for the few bytes of an ordinary word, quadratic for a word of a million bytes. Words of
at least ``LONG_WORD_MIN_BYTES`` bytes come here instead and are merged with numpy:

- The long words of equal count lie end to end in one int32 array, each after a ``SEPARATOR`` (-1) and the last one
  followed by one, so no pair crosses from one word into the next and every position has a left and a right.
- A merge of (a, b) finds its occurrences with one vectorised scan (``arr == a``, then the next token == b); for
  a == b, a run of k a's merges greedily from its left end (positions run_start, run_start + 2, ...), as the
  reference's left-to-right rewrite does. Around each occurrence at i, (left, a) and (b, right) lose the word's
  count and (left, new) and (new, right) gain it; back-to-back occurrences turn (b, a) into (new, new). The
  changes are summed per distinct pair with ``np.unique`` (at most a few thousand), then applied to the trainer's
  dict; the array is compacted in place.
- ``pair_counts`` here (the weighted counts of pairs inside long words) tells a merge whether to scan at all, so
  ordinary corpora with a few long words pay only for the merges that touch them.

A merge costs a scan of the long words (~a few ns a symbol, in C) plus numpy work proportional to its occurrences;
memory is 4 bytes a symbol plus a byte-sized mask (a 50 MB line: ~250 MB), never a Python object per symbol.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

# Words of at least this many bytes are merged here; shorter ones by train_bpe.py's list path, which is faster
# on them (a numpy call costs microseconds; a short word's scan in C costs less).
LONG_WORD_MIN_BYTES = 1024
SEPARATOR = -1
_LOW_MASK = (1 << 32) - 1
_COMPACT_CHUNK = 1 << 22  # symbols copied at a time when compacting in place (bounds the temporary)

Pair = tuple[int, int]


class LongWords:
    """The long words of a corpus, grouped by count, and the weighted counts of the pairs inside them."""

    def __init__(self, words: dict[bytes, int]) -> None:
        by_count: defaultdict[int, list[bytes]] = defaultdict(list)
        for word, count in words.items():
            by_count[count].append(word)
        self._groups: list[tuple[int, np.ndarray]] = [(count, _laid_end_to_end(group))
                                                      for count, group in by_count.items()]
        self.pair_counts: dict[Pair, int] = {}
        for count, symbols in self._groups:
            for pair, occurrences in _byte_pair_counts(symbols).items():
                self.pair_counts[pair] = self.pair_counts.get(pair, 0) + count * occurrences

    def merge(self, pair: Pair, new_id: int) -> dict[Pair, int]:
        """Merge every occurrence of pair (left to right) into new_id; return the change of each pair's count."""
        if self.pair_counts.pop(pair, 0) == 0:
            return {}
        codes, weights = [], []
        for index, (count, symbols) in enumerate(self._groups):
            starts = _occurrences(symbols, *pair)
            if starts.size == 0:
                continue
            group_codes, signs = _pair_changes(symbols, starts, pair, new_id)
            codes.append(group_codes)
            weights.append(signs * count)
            symbols[starts] = new_id
            self._groups[index] = (count, _compact(symbols, starts + 1))
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


def _laid_end_to_end(words: list[bytes]) -> np.ndarray:
    """The words' bytes as int32 ids, each word after a SEPARATOR, with one SEPARATOR at the end."""
    lengths = np.fromiter(map(len, words), np.int64, len(words))
    symbols = np.full(int(lengths.sum()) + len(words) + 1, SEPARATOR, dtype=np.int32)
    start = 1
    for word in words:
        symbols[start:start + len(word)] = np.frombuffer(word, np.uint8)
        start += len(word) + 1
    return symbols


def _byte_pair_counts(symbols: np.ndarray) -> dict[Pair, int]:
    """Occurrences of each adjacent pair of bytes (the initial symbols are all bytes or SEPARATOR)."""
    totals = np.zeros(256 * 256, np.int64)
    for start in range(0, symbols.size - 1, _COMPACT_CHUNK):  # in chunks: an int64 code per symbol at once is big
        left = symbols[start:start + _COMPACT_CHUNK]
        right = symbols[start + 1:start + 1 + _COMPACT_CHUNK]
        left = left[:right.size]
        inside = (left >= 0) & (right >= 0)
        totals += np.bincount(left[inside] * 256 + right[inside], minlength=256 * 256)
    codes = np.flatnonzero(totals)
    return {(int(code) >> 8, int(code) & 255): int(totals[code]) for code in codes}


def _occurrences(symbols: np.ndarray, a: int, b: int) -> np.ndarray:
    """Start positions of the non-overlapping occurrences of (a, b), chosen left to right."""
    starts = np.flatnonzero((symbols[:-1] == a) & (symbols[1:] == b))  # sparse: cheaper than nonzero of == a
    if a != b or starts.size < 2:
        return starts
    # A run of consecutive starts p, p+1, ... is a run of a's: the leftmost pair merges, then every second one.
    run_first = np.flatnonzero(np.diff(starts, prepend=-2) != 1)
    offsets = np.arange(starts.size) - np.repeat(run_first, np.diff(run_first, append=starts.size))
    return starts[offsets % 2 == 0]


def _code(left: int, right: int) -> int:
    return left << 32 | right


def _pair_changes(symbols: np.ndarray, starts: np.ndarray, pair: Pair, new_id: int) -> tuple[np.ndarray, np.ndarray]:
    """When the (non-overlapping) pairs at starts merge into new_id: the pairs (as ``left << 32 | right``) that
    lose (-1) or gain (+1) an occurrence, once per occurrence."""
    a, b = pair
    follows = np.diff(starts, prepend=-3) == 2  # the occurrence right before ends where this one starts
    lefts = symbols[starts[~follows] - 1].astype(np.int64)
    lefts = lefts[lefts != SEPARATOR]
    precedes = np.append(follows[1:], False)
    rights = symbols[starts[~precedes] + 2].astype(np.int64)
    rights = rights[rights != SEPARATOR]
    doubles = np.full(int(follows.sum()), 1, np.int64)
    lost = np.concatenate((lefts << 32 | a, _code(b, 0) | rights, doubles * _code(b, a)))
    gained = np.concatenate((lefts << 32 | new_id, _code(new_id, 0) | rights, doubles * _code(new_id, new_id)))
    signs = np.concatenate((np.full(lost.size, -1.0), np.full(gained.size, 1.0)))
    return np.concatenate((lost, gained)), signs


def _compact(symbols: np.ndarray, removed: np.ndarray) -> np.ndarray:
    """symbols without the positions in removed (sorted), compacted in place chunk by chunk; a view of the rest."""
    keep = np.ones(symbols.size, dtype=bool)
    keep[removed] = False
    written = 0
    for start in range(0, symbols.size, _COMPACT_CHUNK):  # writes never pass the chunk being read
        kept = symbols[start:start + _COMPACT_CHUNK][keep[start:start + _COMPACT_CHUNK]]
        symbols[written:written + kept.size] = kept
        written += kept.size
    return symbols[:written]
