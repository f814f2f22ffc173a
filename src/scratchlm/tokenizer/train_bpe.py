"""Fast byte-level BPE training with incremental merges, tested equal to ``bpe.reference_train_from_counts``.

Phase 1 (``training_inputs.py``, ``counting.py``) reduces the corpus to counts of distinct pre-tokens ("words").
Phase 2, here, learns the merges on those words without ever rescanning the corpus:

* each word is a list of token ids (rewritten in place) with its count; ``pair_counts`` holds the weighted count
  of every adjacent pair and ``where`` maps a pair to the indices of the words that (may) hold it. The index is
  lazy: a word stays listed under pairs it lost, once per occurrence (an append is cheaper than exact sets);
* a merge rewrites only the words listed under the merged pair and moves only the counts of pairs around its
  occurrences, so its cost is proportional to the words it touches, never to the corpus;
* the best pair comes from a heap keyed by (count descending, pair bytes descending), the reference's tie rule
  (``_descending_key`` inverts the bytes for Python's min-heap). Entries are lazy upper bounds: a count that grows
  pushes a fresh entry, one that shrinks is corrected when its stale entry reaches the top.

Words of at least ``LONG_WORD_MIN_BYTES`` bytes (a line of DNA is one pre-token) would make this quadratic: they
are merged by ``long_words.py`` with numpy, into the same ``pair_counts``. As in the reference, tokens are bytes: a
merge whose bytes an earlier token has reuses that token's id in the words (the vocab still gets a new entry).
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Mapping
from heapq import heapify, heappop, heappush, heapreplace
from typing import TYPE_CHECKING

from scratchlm.progress import progress_bar
from scratchlm.tokenizer.pretokenize import GPT2_SPLIT_PATTERN, compile_pattern, validate_special_tokens

if TYPE_CHECKING:
    from scratchlm.tokenizer.long_words import LongWords

Vocab = dict[int, bytes]
Merges = list[tuple[bytes, bytes]]

# Words of at least this many bytes are merged by long_words.py (numpy); shorter ones here, where a word's scan in
# C costs less than a numpy call.
LONG_WORD_MIN_BYTES = 1024
_INVERT_BYTES = bytes(range(255, -1, -1))
_AFTER_ALL_BYTES = "\u0100"  # sorts after every inverted byte (chr(0)..chr(255))


def _descending_key(token: bytes) -> str:
    """A string whose order is the reverse of the byte strings' order (so a min-heap pops the greatest).

    Each byte v becomes chr(255 - v), and a terminator that sorts after all of them is appended, so that a
    longer string sorts before its own prefix (for bytes, the prefix is the smaller one).
    """
    return token.translate(_INVERT_BYTES).decode("latin-1") + _AFTER_ALL_BYTES


def initial_vocab(special_tokens: list[str]) -> Vocab:
    """The 256 single bytes, then the special tokens."""
    vocab = {i: bytes([i]) for i in range(256)}
    for token in special_tokens:
        vocab[len(vocab)] = token.encode("utf-8")
    return vocab


def _check_vocab_size(vocab_size: int, special_tokens: list[str]) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ValueError(f"vocab_size must be an integer, got {vocab_size!r}")
    if vocab_size < 256 + len(special_tokens):
        raise ValueError(
            f"vocab_size {vocab_size} is too small: it must be at least 256 (the byte values) + "
            f"{len(special_tokens)} (special tokens) = {256 + len(special_tokens)}"
        )


def train_bpe_from_counts(
    word_counts: Mapping[str, int], vocab_size: int, special_tokens: list[str], *, progress: bool = False
) -> tuple[Vocab, Merges]:
    """Learn merges from pre-token counts (phase 2 of ``train_bpe``)."""
    special_tokens = validate_special_tokens(special_tokens)
    _check_vocab_size(vocab_size, special_tokens)
    vocab = initial_vocab(special_tokens)
    words: list[list[int]] = []
    counts: list[int] = []
    long_words: dict[bytes, int] = {}
    for text, count in word_counts.items():
        encoded = text.encode("utf-8")
        if len(encoded) >= LONG_WORD_MIN_BYTES:
            long_words[encoded] = count
        elif len(encoded) > 1:  # a single byte has no pair to merge
            words.append(list(encoded))
            counts.append(count)
    long_merger = None
    if long_words:  # numpy is imported only then
        from scratchlm.tokenizer.long_words import LongWords

        long_merger = LongWords(long_words, vocab_size)
    return vocab, _learn_merges(words, counts, long_merger, vocab, vocab_size - len(vocab), progress)


def _count_pairs(words: list[list[int]], counts: list[int]) -> tuple[dict, dict]:
    """Weighted counts of every adjacent pair, and for each pair the indices of the words holding it."""
    where: defaultdict[tuple[int, int], list[int]] = defaultdict(list)
    for index, word in enumerate(words):
        for pair in zip(word, word[1:]):
            where[pair].append(index)  # once per occurrence, so summing the words' counts weighs each one
    weight = counts.__getitem__
    pair_counts = {pair: sum(map(weight, indices)) for pair, indices in where.items()}
    return pair_counts, dict(where)


def _pop_best(heap: list, pair_counts: dict) -> tuple[int, int] | None:
    """The most frequent pair (ties: greatest bytes), correcting stale entries on the way."""
    while heap:
        stored, key_a, key_b, a, b = heap[0]
        actual = pair_counts.get((a, b), 0)
        if actual == -stored:
            heappop(heap)
            return a, b
        if actual:
            heapreplace(heap, (-actual, key_a, key_b, a, b))
        else:
            heappop(heap)
    return None


def _occurrences(word: list[int], a: int, b: int) -> list[int]:
    """Start positions of the pair (a, b) in `word`, non-overlapping, left to right (list.index runs in C)."""
    found = []
    remaining = word.count(a)
    last = len(word) - 1
    step = 2 if a == b else 1  # an occurrence of (a, a) uses up two of the counted a's
    i = 0
    while remaining > 0 and i < last:
        i = word.index(a, i)
        if i < last and word[i + 1] == b:
            found.append(i)
            i += 2
            remaining -= step
        else:
            i += 1
            remaining -= 1
    return found


def _apply_merge(pair, new_id, words, counts, where, pair_counts) -> set[tuple[int, int]]:
    """Rewrite the words holding `pair` in place, then move the pair counts around the occurrences in bulk.

    Around an occurrence at i, the pairs (word[i-1], a) and (b, word[i+2]) lose the word's count and
    (word[i-1], new) and (new, word[i+2]) gain it; back-to-back occurrences turn (b, a) into (new, new).
    So one list of word indices per distinct neighbour (one entry per occurrence) is all a merge needs to
    record per occurrence; the counts are then moved once per neighbour (``_move_counts``), which is far
    cheaper than updating two dicts and a set per occurrence. The gaining pairs are returned for the heap.
    """
    a, b = pair
    pair_counts.pop(pair, None)
    lefts: defaultdict[int, list[int]] = defaultdict(list)  # left neighbour -> indices of words, per occurrence
    rights: defaultdict[int, list[int]] = defaultdict(list)
    doubles: list[int] = []  # words with back-to-back occurrences, once per (b, a) between them
    for index in where.pop(pair, ()):
        word = words[index]
        occurrences_of_a = word.count(a)
        if occurrences_of_a == 1:  # the common case, done without the general scan
            i = word.index(a)
            end = len(word)
            if i + 1 == end or word[i + 1] != b:  # a stale index entry: the word lost this pair earlier
                continue
            if i:
                lefts[word[i - 1]].append(index)
            if i + 2 < end:
                rights[word[i + 2]].append(index)
            word[i] = new_id
            del word[i + 1]
        elif occurrences_of_a:  # else a stale index entry
            _merge_occurrences(word, index, a, b, new_id, lefts, rights, doubles)
    gained: set[tuple[int, int]] = set()
    for left, indices in lefts.items():
        gained.add(_move_counts((left, a), (left, new_id), indices, counts, where, pair_counts))
    for right, indices in rights.items():
        gained.add(_move_counts((b, right), (new_id, right), indices, counts, where, pair_counts))
    if doubles:
        gained.add(_move_counts((b, a), (new_id, new_id), doubles, counts, where, pair_counts))
    return gained


def _merge_occurrences(word: list[int], index: int, a: int, b: int, new_id: int, lefts, rights, doubles) -> None:
    """The general case of ``_apply_merge``: any number of (possibly back-to-back or (a, a)) occurrences."""
    found = _occurrences(word, a, b)
    end = len(word)
    for k, i in enumerate(found):
        if i > 0:
            if k > 0 and found[k - 1] + 2 == i:
                doubles.append(index)
            else:
                lefts[word[i - 1]].append(index)
        if i + 2 < end and (k + 1 == len(found) or found[k + 1] != i + 2):
            rights[word[i + 2]].append(index)
    for i in reversed(found):  # right to left, so the earlier positions stay valid
        word[i] = new_id
        del word[i + 1]


def _move_counts(lost, gain, indices: list[int], counts, where, pair_counts) -> tuple[int, int]:
    """Move the weight of the words in `indices` (one entry per occurrence) from pair `lost` to pair `gain`."""
    moved = sum(map(counts.__getitem__, indices))
    total = pair_counts.get(lost)
    if total is not None:  # None: (a, a) beside a merged (a, a), i.e. the merged pair, already dropped
        if total > moved:
            pair_counts[lost] = total - moved
        else:
            del pair_counts[lost]
            where.pop(lost, None)
    pair_counts[gain] = pair_counts.get(gain, 0) + moved
    listed = where.get(gain)
    if listed is None:
        where[gain] = indices
    else:  # only when the new token reuses an earlier token's id (same bytes)
        listed.extend(indices)
    return gain


def _apply_long_merge(long_words: LongWords, pair, new_id: int, where, pair_counts) -> list[tuple[int, int]]:
    """Merge pair in the long words and move their pair counts; return the pairs whose counts grew."""
    gained = []
    for changed, delta in long_words.merge(pair, new_id).items():
        total = pair_counts.get(changed, 0) + delta
        if total:
            pair_counts[changed] = total
        else:
            del pair_counts[changed]
            where.pop(changed, None)
        if delta > 0:
            gained.append(changed)
    return gained


def _learn_merges(words, counts, long_words: LongWords | None, vocab: Vocab, num_merges: int,
                  progress: bool) -> Merges:
    pair_counts, where = _count_pairs(words, counts)
    for pair, count in (long_words.pair_counts.items() if long_words else ()):
        pair_counts[pair] = pair_counts.get(pair, 0) + count
    keys = {token_id: _descending_key(token) for token_id, token in vocab.items()}
    id_of_bytes = {bytes([i]): i for i in range(256)}  # word tokens only: specials never occur in words
    heap = [(-count, keys[a], keys[b], a, b) for (a, b), count in pair_counts.items()]
    heapify(heap)
    merges: Merges = []
    bar = progress_bar(num_merges, progress, unit="merge", desc="merging")
    while len(merges) < num_merges:
        best = _pop_best(heap, pair_counts)
        if best is None:  # every word is a single token
            break
        left, right = vocab[best[0]], vocab[best[1]]
        token = left + right
        vocab_id = len(vocab)
        vocab[vocab_id] = token
        merges.append((left, right))
        token_id = id_of_bytes.setdefault(token, vocab_id)
        if token_id not in keys:
            keys[token_id] = _descending_key(token)
        gained = _apply_merge(best, token_id, words, counts, where, pair_counts)
        if long_words is not None:
            gained.update(_apply_long_merge(long_words, best, token_id, where, pair_counts))
        for a, b in gained:
            heappush(heap, (-pair_counts[a, b], keys[a], keys[b], a, b))
        bar.update(1)
    bar.close()
    return merges


def train_bpe(
    input_path: str | os.PathLike | list[str | os.PathLike],
    vocab_size: int,
    special_tokens: list[str],
    *,
    num_workers: int | None = None,
    progress: bool = False,
    errors: str = "strict",
    text_field: str = "text",
    pattern: str = GPT2_SPLIT_PATTERN,
) -> tuple[Vocab, Merges]:
    """Train a byte-level BPE tokenizer on one or more inputs, as ``data encode`` takes them: text, JSON lines,
    JSON or parquet files (optionally .gz / .zst), folders and globs of those, ``hf:NAME[:CONFIG][:SPLIT]``
    datasets (``data/sources.py``). No pre-token spans two documents (records, rows), as none spans an
    ``<|endoftext|>`` special token in a text file. `pattern` is the split regex (``pretokenize.py``: GPT-2's by
    default; the tokenizer built from the result needs the same, as ``pipeline.Pipeline(pattern)``).

    Returns ``vocab`` (id -> bytes: 256 single bytes, the special tokens, then the merged tokens) and
    ``merges`` in creation order. Stops early when no pair is left to merge. `errors` is the UTF-8 policy
    ("strict" raises naming the file and byte offset or line, "replace" substitutes U+FFFD); `text_field` is the
    JSON field or the column holding the text; `num_workers` defaults to the usable CPUs.
    """
    # Imported here: the readers of data/sources.py are not needed by `import scratchlm.tokenizer`.
    from scratchlm.tokenizer.training_inputs import count_input_pretokens

    special_tokens = validate_special_tokens(special_tokens)
    _check_vocab_size(vocab_size, special_tokens)
    compile_pattern(pattern)  # a bad regex is refused before any input is read
    inputs = list(input_path) if isinstance(input_path, (list, tuple)) else [input_path]
    word_counts: Counter[str] = count_input_pretokens(
        inputs, special_tokens, num_workers=num_workers, errors=errors, text_field=text_field, progress=progress,
        pattern=pattern,
    )
    return train_bpe_from_counts(word_counts, vocab_size, special_tokens, progress=progress)
