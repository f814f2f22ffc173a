"""Byte-level BPE of ordinary text (no special tokens) through two bounded caches: the fast ``PieceEncoder``.

It gives the ids of ``bpe.ReadableBPE``, faster. With GPT-2's pattern:

- Text is cut with ``str.split(" ")`` into words: a space after a non-whitespace character always starts a GPT-2
  pre-token, so " " + word encodes on its own (``CachedBPE.encode`` says when). The hot loop is one lookup per word
  in a bounded *word -> ids cache* plus a ``list.extend``; misses and whitespace runs go through the GPT-2 regex
  and a bounded *pre-token -> ids cache*. Natural text repeats a few thousand words, so most lookups hit.
- A miss runs rank-based BPE on the pre-token's bytes (``merge.py``). Many new words at once (a cold cache) are
  learned together (``learn_words``), their distinct pre-tokens merged at once by ``batch_merge.py``. A pre-token
  of a megabyte or more is merged by ``long_merge.py`` in bounded memory, its ids yielded a chunk at a time and
  never cached.

Any other pattern takes no GPT-2 shortcut: the pattern splits the whole text (``pretokenize.split_pretokens``) and
each pre-token goes through the pre-token cache; a block of mostly new ones is merged at once (``learn_pretokens``).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import chain, compress, islice
from operator import itemgetter, not_

import numpy as np

from scratchlm.tokenizer.fast.batch_merge import BatchMerger, run_starts, take_runs
from scratchlm.tokenizer.fast.long_merge import LONG_PIECE_MIN_BYTES, LongPieceMerger
from scratchlm.tokenizer.fast.merge import merge_ids
from scratchlm.tokenizer.pipeline import GPT2_PIPELINE, Pipeline
from scratchlm.tokenizer.pretokenize import (
    GPT2_SPLIT_PATTERN,
    ends_in_whitespace,
    spaced_word_pieces,
    split_pretokens,
)

# Longer pre-tokens and words are not cached (they are rare, and would make the bounded caches large).
_MAX_CACHED_CHARS = 64
# A block of at least this many words learns its new words together (``learn_words``) when at least one in
# _BATCH_MIN_MISS_RATE of its first _BATCH_SAMPLE words misses the word cache.
_BATCH_MIN_WORDS = 2048
_BATCH_SAMPLE = 256
_BATCH_MIN_MISS_RATE = 32  # OWT valid after OWT train misses ~1 in 9: 1.2x faster learned together


class CachedBPE:
    """BPE with a merge table ``(left id, right id) -> (rank, merged id)`` and the ids of the 256 bytes, under a
    pipeline (``tokens``, bytes -> id, given for the pipeline's ignore_merges: pre-tokens emitted whole).

    ``word_cache`` maps a word to the ids of " " + word (GPT-2's pattern only); ``pretoken_cache`` a pre-token to
    its ids. Each is cleared when it would pass ``cache_size`` entries (one batch of new words larger than that is
    still cached whole) and holds only keys of at most 64 characters.
    """

    def __init__(self, merge_ranks: dict[tuple[int, int], tuple[int, int]], byte_ids: list[int],
                 cache_size: int, pipeline: Pipeline = GPT2_PIPELINE, tokens: dict[bytes, int] | None = None) -> None:
        self._merge_ranks = merge_ranks
        self._byte_ids = byte_ids
        self._cache_size = cache_size
        self._pipeline = pipeline
        self._whole_tokens = tokens or {}
        self.word_cache: dict[str, tuple[int, ...]] = {}
        self.pretoken_cache: dict[str, tuple[int, ...]] = {}
        self._merger: BatchMerger | None = None  # built on the first cold block
        self._long_merger: LongPieceMerger | None = None  # built on the first piece of LONG_PIECE_MIN_BYTES

    def clear(self) -> None:
        """Forget both caches (the ids are unchanged; later encodes run BPE from scratch)."""
        self.word_cache.clear()
        self.pretoken_cache.clear()

    def encode(self, text: str, out: list[int]) -> None:
        """Append the ids of text (no special tokens) to out: the hot loop.

        ``str.split(" ")`` is far cheaper than the GPT-2 regex, so text is cut at spaces that follow a
        non-whitespace character: there a pre-token always ends, and no pre-token to the left looks past the
        space (see docs/tokenizer-encoding.md). Each such chunk is " " + word; a word that ends in a non-space is
        a complete chunk, looked up in the word cache. Words ending in whitespace (or empty ones, from runs of
        spaces) join the following words into one segment that goes through the regex. When most words are new
        (a cold cache), they are first learned together by ``learn_words``. Another pattern than GPT-2's takes
        ``_encode_by_pattern`` instead.
        """
        text = self._pipeline.normalize(text)
        if self._pipeline.pattern != GPT2_SPLIT_PATTERN:
            self._encode_by_pattern(text, out)
            return
        words = text.split(" ")
        if _mostly_missing(words, self.word_cache):
            self.learn_words(set(words).difference(self.word_cache))
        lookup = self.word_cache.get
        extend = out.extend
        segment: list[str] | None = None  # an open segment: chunks that must be pre-tokenized together
        first = words[0]
        if first:
            if ends_in_whitespace(first):
                segment = [first]
            else:
                self.encode_pretokens(split_pretokens(first), out)
        for word in islice(words, 1, None):
            ids = lookup(word)
            if ids is not None and segment is None:
                extend(ids)
                continue
            complete = bool(word) and not ends_in_whitespace(word)
            if segment is None and complete and len(word) > _MAX_CACHED_CHARS:
                self.encode_pretokens(spaced_word_pieces(word), out)  # not cached: no tuple of a long word's ids
            elif segment is None and complete:
                extend(self._encode_spaced_word(word))
            elif segment is None:
                segment = [" ", word]
            else:
                segment += (" ", word)
                if complete:
                    self.encode_pretokens(split_pretokens("".join(segment)), out)
                    segment = None
        if segment is not None:
            self.encode_pretokens(split_pretokens("".join(segment)), out)

    def _encode_by_pattern(self, text: str, out: list[int]) -> None:
        """The general path: the pattern on the whole text, each pre-token through the pre-token cache (a block of
        mostly new ones learned together first)."""
        pieces = split_pretokens(text, self._pipeline.pattern)
        if _mostly_missing(pieces, self.pretoken_cache):
            self.learn_pretokens(set(pieces).difference(self.pretoken_cache))
        self.encode_pretokens(pieces, out)

    def learn_pretokens(self, pieces: Iterable[str]) -> None:
        """Put the ids of many new pre-tokens (those of at most 64 characters) into the pre-token cache at once,
        merged together by ``BatchMerger`` (the collector paused, as in ``learn_words``)."""
        with _gc_paused():
            pieces = [piece for piece in pieces if len(piece) <= _MAX_CACHED_CHARS]
            if not pieces:
                return
            ids, counts = self._merge_pieces(list(map(str.encode, pieces)))
            self._remember(self.pretoken_cache, pieces, _split_runs(ids.tolist(), counts))

    def encode_pretokens(self, pretokens: list[str], out: list[int]) -> None:
        """Append the ids of each pre-token to out, through the pre-token cache."""
        lookup = self.pretoken_cache.get
        extend = out.extend
        for piece in pretokens:
            ids = lookup(piece)
            extend(self._encode_new_piece(piece) if ids is None else ids)

    def learn_words(self, words: Iterable[str]) -> None:
        """Put the ids of many new words into the word cache at once (the complete ones of at most 64 characters:
        the hot loop encodes any other on its own).

        The words are joined with spaces and pre-tokenized in one regex call per group (ASCII words, then the
        rest): each is complete, so the space before it starts its first pre-token and no pre-token crosses it.
        Their distinct pre-tokens are merged at once by ``BatchMerger``, and each word's ids are its pre-tokens'.
        The cyclic garbage collector is paused meanwhile: the tens of thousands of id tuples made here hold no
        cycles, yet would set off a collection every few hundred (a fifth of a cold encode's time).
        """
        with _gc_paused():
            groups = _pattern_groups(_cacheable_words(words))
            pieces: list[str] = []
            first_pieces: list[np.ndarray] = []
            for group, text in groups:
                group_pieces = split_pretokens(text)
                first_pieces.append(len(pieces) + _first_pieces(group, group_pieces))
                pieces += group_pieces
            if not pieces:
                return
            ids = self._merge_words(pieces, np.concatenate(first_pieces))
            self._remember(self.word_cache, list(chain.from_iterable(group for group, _ in groups)), ids)

    def _merge_words(self, pieces: list[str], first_pieces: np.ndarray) -> list[tuple[int, ...]]:
        """The ids of each word, given its pre-tokens (``pieces`` from ``first_pieces[i]`` to the next word's)."""
        distinct = list(dict.fromkeys(pieces))
        index = dict(zip(distinct, range(len(distinct))))
        piece_index = np.fromiter(map(index.__getitem__, pieces), np.int64, len(pieces))
        ids, counts = self._merge_pieces(list(map(str.encode, distinct)))
        piece_counts = counts[piece_index]
        flat = take_runs(ids, run_starts(counts)[piece_index], piece_counts).tolist()
        return _split_runs(flat, np.add.reduceat(piece_counts, first_pieces))

    def _merge_pieces(self, encoded: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """(ids end to end, the number of ids of each) of pre-tokens given as bytes, merged at once; with
        ignore_merges, one whose bytes are a token is that token."""
        whole = [self._whole_tokens.get(data) for data in encoded] if self._whole_tokens else []
        if not any(token is not None for token in whole):
            return self._batch_merger().merge(b"".join(encoded), _lengths(encoded))
        is_whole = np.array([token is not None for token in whole])
        merged = [data for data, token in zip(encoded, whole) if token is None]
        merged_ids, merged_counts = self._batch_merger().merge(b"".join(merged), _lengths(merged))
        counts = np.ones(len(encoded), np.int64)
        counts[~is_whole] = merged_counts
        ids = np.empty(int(counts.sum()), np.int64)
        whole_starts = run_starts(counts)[is_whole]
        ids[whole_starts] = [token for token in whole if token is not None]
        rest = np.ones(len(ids), bool)
        rest[whole_starts] = False
        ids[rest] = merged_ids
        return ids, counts

    def _encode_spaced_word(self, word: str) -> tuple[int, ...]:
        """Ids of " " + word (a complete chunk of at most _MAX_CACHED_CHARS characters), through the word cache."""
        ids: list[int] = []
        self.encode_pretokens(spaced_word_pieces(word), ids)
        result = tuple(ids)
        self._remember(self.word_cache, [word], [result])
        return result

    def _batch_merger(self) -> BatchMerger:
        if self._merger is None:
            self._merger = BatchMerger(self._merge_ranks, self._byte_ids)
        return self._merger

    def _long_piece_merger(self) -> LongPieceMerger:
        if self._long_merger is None:
            self._long_merger = LongPieceMerger(self._batch_merger(), self._merge_ranks, self._byte_ids)
        return self._long_merger

    def _encode_new_piece(self, piece: str) -> Iterable[int]:
        """BPE of a pre-token missing from the cache, which then remembers it (if it is short)."""
        ids = self._encode_piece(piece)
        if len(piece) > _MAX_CACHED_CHARS:  # not cached; a long piece's ids may come as a one-pass iterator
            return ids
        ids = tuple(ids)
        self._remember(self.pretoken_cache, [piece], [ids])
        return ids

    def _remember(self, cache: dict, keys: list[str], ids: list[tuple[int, ...]]) -> None:
        """Put keys -> ids into cache, clearing it first when it would pass cache_size (bounded memory; natural text
        refills the frequent entries at once)."""
        if len(cache) + len(keys) > self._cache_size:
            cache.clear()
        cache.update(zip(keys, ids))

    def _encode_piece(self, piece: str) -> Iterable[int]:
        """BPE of one pre-token (raises UnicodeEncodeError for lone surrogates): a tuple, or for a piece of at least
        LONG_PIECE_MIN_BYTES an iterator that yields its ids a chunk at a time (no Python int per byte)."""
        data = piece.encode("utf-8")
        whole = self._whole_tokens.get(data)
        if whole is not None:  # ignore_merges: a pre-token that is a token is that token
            return (whole,)
        if len(data) == 1:
            return (self._byte_ids[data[0]],)
        if len(data) >= LONG_PIECE_MIN_BYTES:
            return self._long_piece_merger().merge(data)
        return tuple(merge_ids([self._byte_ids[byte] for byte in data], self._merge_ranks))


def _mostly_missing(keys: list[str], cache: dict) -> bool:
    """Whether keys (words or pre-tokens) is a long block and a sample of it misses the cache often enough for
    batch BPE."""
    if len(keys) < _BATCH_MIN_WORDS:
        return False
    sample = islice(keys, 1, _BATCH_SAMPLE + 1)
    return sum(key not in cache for key in sample) * _BATCH_MIN_MISS_RATE >= _BATCH_SAMPLE


def _split_runs(flat: list[int], counts: np.ndarray) -> list[tuple[int, ...]]:
    """flat cut into tuples of counts[0], counts[1], ... ids."""
    ends = np.cumsum(counts).tolist()
    return [tuple(flat[start:end]) for start, end in zip([0, *ends], ends)]


def _lengths(encoded: list[bytes]) -> np.ndarray:
    return np.fromiter(map(len, encoded), np.int64, len(encoded))


def _cacheable_words(words: Iterable[str]) -> list[str]:
    """The complete words (not empty, ending in a non-whitespace character: " " + word is a chunk on its own) of
    at most _MAX_CACHED_CHARS characters."""
    words = list(words)
    lengths = np.fromiter(map(len, words), np.int64, len(words))
    keep = (lengths > 0) & (lengths <= _MAX_CACHED_CHARS)
    if not keep.all():
        words = list(compress(words, keep.tolist()))
    last_characters = list(map(itemgetter(-1), words))
    whitespace = {character for character in set(last_characters) if ends_in_whitespace(character)}
    if whitespace:
        words = list(compress(words, map(not_, map(whitespace.__contains__, last_characters))))
    return words


def _pattern_groups(words: list[str]) -> list[tuple[list[str], str]]:
    """The words split into ASCII ones and the rest, each group with its text: " " + the words joined by spaces
    (``split_pretokens`` runs the faster ASCII pattern on the first)."""
    joined = " ".join(words)
    if joined.isascii():
        return [(words, " " + joined)] if words else []
    is_ascii = list(map(str.isascii, words))
    groups = [list(compress(words, is_ascii)), list(compress(words, map(not_, is_ascii)))]
    return [(group, " " + " ".join(group)) for group in groups if group]


def _first_pieces(words: list[str], pieces: list[str]) -> np.ndarray:
    """The index in pieces (the pre-tokens of " " + the words joined by spaces) of each word's first pre-token."""
    piece_starts = run_starts(np.fromiter(map(len, pieces), np.int64, len(pieces)))
    word_starts = run_starts(np.fromiter(map(len, words), np.int64, len(words)) + 1)
    first = np.searchsorted(piece_starts, word_starts)
    assert np.array_equal(piece_starts[first], word_starts), "each joined word must start its own pre-token"
    return first


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Switch the cyclic garbage collector off for the block (if it was on), then back on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
