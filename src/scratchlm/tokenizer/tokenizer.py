"""Byte-level BPE Tokenizer: encode, decode, streaming encode, special tokens.

Design (pure Python, aimed at about half of tiktoken's single-thread speed):
- Text is split on special tokens (longest first). Each ordinary piece is cut with ``str.split(" ")`` into
  words, and the hot loop is one dict lookup per word in a bounded *word -> ids cache* plus a ``list.extend``:
  a space after a non-whitespace character always starts a new GPT-2 pre-token, so " " + word encodes on its
  own (``_encode_ordinary`` says when). Cache misses and whitespace runs go through the GPT-2 regex and a
  bounded *pre-token -> ids cache*. Natural text repeats a few thousand words, so most lookups hit, and the
  regex (15-20 MB/s alone) runs on a fraction of the text.
- A cache miss runs *rank-based* BPE on the pre-token's bytes (``merge.py``): repeatedly merge the adjacent
  pair with the lowest merge rank (leftmost first on ties), exactly GPT-2's and tiktoken's rule; many new
  pre-tokens at once (a cold cache) go through ``batch_merge.py`` instead.
- ``encode_iterable`` buffers chunks and encodes everything except a *held-back tail* that more text could
  still change (see ``_split_stable_prefix``), so its output equals ``encode`` of the whole text.
Serialization lives in ``io.py``; this module only knows vocab, merges and special tokens.
"""

from __future__ import annotations

import gc
import hashlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import chain, islice
from pathlib import Path

from scratchlm.tokenizer.batch_merge import BatchMerger
from scratchlm.tokenizer.merge import merge_ids, merge_table
from scratchlm.tokenizer.pretokenize import (
    ends_in_whitespace,
    is_complete_word,
    is_one_pretoken,
    last_space_boundary,
    spaced_word_pieces,
    special_token_regex,
    split_on_special_tokens,
    split_pretokens,
    validate_special_tokens,
)

# A pre-token match never depends on text more than this many characters past its end (the GPT-2 pattern
# looks at most 3 characters ahead: the contraction "'ll" tried at a match's last character).
_LOOKAHEAD_CHARS = 3
# Longer pre-tokens and words are not cached (they are rare, and would make the bounded caches large).
_MAX_CACHED_CHARS = 64
# A block of at least this many words learns its new words together (``_learn_words``) when at least one in
# _BATCH_MIN_MISS_RATE of its first _BATCH_SAMPLE words misses the word cache.
_BATCH_MIN_WORDS = 2048
_BATCH_SAMPLE = 256
_BATCH_MIN_MISS_RATE = 8


class Tokenizer:
    """Byte-level BPE over ``vocab`` (id -> bytes) and ``merges`` (in creation order), plus special tokens."""

    def __init__(self, vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]],
                 special_tokens: list[str] | None = None, *, cache_size: int = 100_000) -> None:
        self.vocab: dict[int, bytes] = dict(vocab)
        self.merges: list[tuple[bytes, bytes]] = [(bytes(a), bytes(b)) for a, b in merges]
        self.special_tokens: list[str] = validate_special_tokens(special_tokens)
        self._bytes_to_id = _invert_vocab(self.vocab)
        self._byte_ids = _single_byte_ids(self._bytes_to_id)
        self._special_ids = self._add_special_tokens()
        self._merge_ranks = merge_table(self.merges, self._bytes_to_id)
        self._special_regex = special_token_regex(self.special_tokens)
        self._special_prefixes = {token[:k] for token in self.special_tokens for k in range(1, len(token))}
        self._max_special_prefix = max((len(p) for p in self._special_prefixes), default=0)
        self._cache: dict[str, tuple[int, ...]] = {}  # pre-token -> ids
        self._word_cache: dict[str, tuple[int, ...]] = {}  # word -> ids of " " + word
        self._cache_size = cache_size
        self._merger: BatchMerger | None = None  # built on the first cold block
        self._hash: str | None = None

    # ------------------------------------------------------------------ construction and identity
    @classmethod
    def from_files(cls, vocab_path: str | Path, merges_path: str | Path | None = None,
                   special_tokens: list[str] | None = None) -> Tokenizer:
        """Read GPT-2 ``vocab.json`` + ``merges.txt``, or a scratchlm ``tokenizer.json`` (merges_path=None)."""
        from scratchlm.tokenizer.io import read_tokenizer_files

        vocab, merges, stored_specials = read_tokenizer_files(vocab_path, merges_path)
        return cls(vocab, merges, special_tokens if special_tokens is not None else stored_specials)

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """Read a directory written by ``save`` (``tokenizer.json``, else ``vocab.json`` + ``merges.txt``)."""
        from scratchlm.tokenizer.io import read_tokenizer_dir

        vocab, merges, specials = read_tokenizer_dir(directory)
        return cls(vocab, merges, specials)

    def save(self, directory: str | Path) -> Path:
        """Write ``tokenizer.json`` (scratchlm format) and GPT-2 ``vocab.json`` + ``merges.txt`` into directory."""
        from scratchlm.tokenizer.io import write_tokenizer_dir

        return write_tokenizer_dir(directory, self.vocab, self.merges, self.special_tokens)

    @property
    def vocab_size(self) -> int:
        """One more than the largest id (the embedding table size a model needs)."""
        return max(self.vocab) + 1 if self.vocab else 0

    @property
    def hash(self) -> str:
        """sha256 hex digest of the canonical (vocab, merges, special tokens); token files record it."""
        if self._hash is None:
            vocab = self.vocab
            lines = [f"v{token_id}:{vocab[token_id].hex()}\n" for token_id in sorted(vocab)]
            lines += [f"m{left.hex()} {right.hex()}\n" for left, right in self.merges]
            lines += [f"s{token.encode('utf-8').hex()}\n" for token in self.special_tokens]
            self._hash = hashlib.sha256("".join(lines).encode("ascii")).hexdigest()
        return self._hash

    def special_id(self, token: str) -> int:
        """The id of a registered special token."""
        try:
            return self._special_ids[token]
        except KeyError:
            raise ValueError(f"{token!r} is not a special token of this tokenizer "
                             f"(special tokens: {self.special_tokens})") from None

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
                f"special_tokens={self.special_tokens})")

    def __getstate__(self) -> dict:
        # Workers rebuild the lookup tables; the cache is per process.
        return {"vocab": self.vocab, "merges": self.merges, "special_tokens": self.special_tokens,
                "cache_size": self._cache_size}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["vocab"], state["merges"], state["special_tokens"], cache_size=state["cache_size"])

    # ------------------------------------------------------------------ encoding
    def clear_cache(self) -> None:
        """Forget the pre-token and word caches (ids are unchanged; the next encodes run BPE from scratch)."""
        self._cache.clear()
        self._word_cache.clear()

    def encode(self, text: str) -> list[int]:
        """Token ids of text; registered special tokens in the text become their ids and are never split."""
        try:
            return self._encode_text(text)
        except UnicodeEncodeError:
            raise ValueError(_unencodable_message(text, 0)) from None

    def encode_ordinary(self, text: str) -> list[int]:
        """Token ids of text with special tokens treated as plain text (tiktoken's ``encode_ordinary``)."""
        ids: list[int] = []
        try:
            self._encode_ordinary(text, ids)
        except UnicodeEncodeError:
            raise ValueError(_unencodable_message(text, 0)) from None
        return ids

    def encode_iterable(self, iterable: Iterable[str]) -> Iterator[int]:
        """Lazily yield the ids of the concatenated strings (e.g. a file read line by line); equals ``encode``."""
        return chain.from_iterable(self.encode_stream(iterable))

    def encode_stream(self, iterable: Iterable[str], *, chunk_chars: int = 1 << 16) -> Iterator[list[int]]:
        """Like ``encode_iterable`` but yields lists of ids, one per buffered chunk of about ``chunk_chars``."""
        parts: list[str] = []
        buffered = 0
        offset = 0  # characters already encoded, for error positions
        for text in iterable:
            parts.append(text)
            buffered += len(text)
            if buffered < chunk_chars:
                continue
            buffer = "".join(parts)
            try:
                ids, rest = self._split_stable_prefix(buffer)
            except UnicodeEncodeError:
                raise ValueError(_unencodable_message(buffer, offset)) from None
            offset += len(buffer) - len(rest)
            parts, buffered = [rest], len(rest)
            if ids:
                yield ids
        buffer = "".join(parts)
        try:
            ids = self._encode_text(buffer)
        except UnicodeEncodeError:
            raise ValueError(_unencodable_message(buffer, offset)) from None
        if ids:
            yield ids

    def _encode_text(self, text: str) -> list[int]:
        ids: list[int] = []
        if self._special_regex is None:
            self._encode_ordinary(text, ids)
            return ids
        for piece, is_special in split_on_special_tokens(text, self._special_regex):
            if is_special:
                ids.append(self._special_ids[piece])
            else:
                self._encode_ordinary(piece, ids)
        return ids

    def _encode_ordinary(self, text: str, out: list[int]) -> None:
        """Append the ids of text (no special tokens) to out: the hot loop.

        ``str.split(" ")`` is far cheaper than the GPT-2 regex, so text is cut at spaces that follow a
        non-whitespace character: there a pre-token always ends, and no pre-token to the left looks past the
        space (see docs/tokenizer-encoding.md). Each such chunk is " " + word; a word that ends in a non-space is
        a complete chunk, looked up in a word -> ids cache. Words ending in whitespace (or empty ones, from runs
        of spaces) join the following words into one segment that goes through the regex. When most words are
        new (a cold cache), they are first learned together by ``_learn_words``.
        """
        words = text.split(" ")
        if self._mostly_new(words):
            self._learn_words(set(words).difference(self._word_cache))
        lookup = self._word_cache.get
        extend = out.extend
        segment: list[str] | None = None  # an open segment: chunks that must be pre-tokenized together
        first = words[0]
        if first:
            if ends_in_whitespace(first):
                segment = [first]
            else:
                self._encode_pretokens(split_pretokens(first), out)
        for word in islice(words, 1, None):
            ids = lookup(word)
            if ids is not None and segment is None:
                extend(ids)
                continue
            complete = bool(word) and not ends_in_whitespace(word)
            if segment is None and complete:
                extend(self._encode_spaced_word(word))
            elif segment is None:
                segment = [" ", word]
            else:
                segment += (" ", word)
                if complete:
                    self._encode_pretokens(split_pretokens("".join(segment)), out)
                    segment = None
        if segment is not None:
            self._encode_pretokens(split_pretokens("".join(segment)), out)

    def _mostly_new(self, words: list[str]) -> bool:
        """Whether words is a long block and a sample of it misses the word cache often enough for batch BPE."""
        if len(words) < _BATCH_MIN_WORDS:
            return False
        cache = self._word_cache
        sample = islice(words, 1, _BATCH_SAMPLE + 1)
        return sum(word not in cache for word in sample) * _BATCH_MIN_MISS_RATE >= _BATCH_SAMPLE

    def _encode_spaced_word(self, word: str) -> tuple[int, ...]:
        """Ids of " " + word (a complete chunk), through the word cache."""
        ids: list[int] = []
        self._encode_pretokens(spaced_word_pieces(word), ids)
        result = tuple(ids)
        if len(word) <= _MAX_CACHED_CHARS:
            if len(self._word_cache) >= self._cache_size:
                self._word_cache.clear()
            self._word_cache[word] = result
        return result

    def _learn_words(self, words: set[str]) -> None:
        """Put the ids of many new words into the word cache at once; their pre-tokens that the pre-token cache
        lacks are merged together by ``BatchMerger`` (cold caches: the first megabytes of a corpus).

        Words that are one pre-token (``is_one_pretoken``) need no regex. The others are joined with spaces and
        pre-tokenized in one regex call per group (ASCII words, then the rest): each is complete, so the space
        before it starts its first pre-token and no pre-token crosses it, and each word's pre-tokens are the run
        that starts with " ".
        The cyclic garbage collector is paused meanwhile: the tens of thousands of id tuples made here hold no
        cycles, yet would set off a collection every few hundred (a fifth of a cold encode's time).
        """
        with _gc_paused():
            complete = [word for word in words if len(word) < _MAX_CACHED_CHARS and is_complete_word(word)]
            simple: list[str] = []
            ascii_other: list[str] = []
            unicode_other: list[str] = []
            for word in complete:
                (simple if is_one_pretoken(word) else ascii_other if word.isascii() else unicode_other).append(word)
            simple_pieces = [" " + word for word in simple]
            other = ascii_other + unicode_other  # each group is pre-tokenized in one call; ASCII by the fast pattern
            other_pieces = [piece for group in (ascii_other, unicode_other) if group
                            for piece in split_pretokens(" " + " ".join(group))]
            cache = self._cache
            pieces = set(simple_pieces).union(other_pieces)
            if len(cache) + len(pieces) > self._cache_size:
                cache.clear()
            new_pieces = [piece for piece in pieces.difference(cache) if len(piece) <= _MAX_CACHED_CHARS]
            merged = self._batch_merger().merge([piece.encode("utf-8") for piece in new_pieces])
            cache.update(zip(new_pieces, map(tuple, merged)))  # now every piece of every word is cached
            word_cache = self._word_cache
            if len(word_cache) + len(complete) > self._cache_size:
                word_cache.clear()
            word_cache.update(zip(simple, map(cache.__getitem__, simple_pieces)))
            firsts = [index for index, piece in enumerate(other_pieces) if piece[0] == " "]
            assert len(firsts) == len(other), "each joined word must start exactly one pre-token with its space"
            piece_ids = list(map(cache.__getitem__, other_pieces))
            ends = firsts[1:] + [len(piece_ids)]
            word_cache.update(zip(other, [tuple(chain.from_iterable(piece_ids[first:end]))
                                          for first, end in zip(firsts, ends)]))

    def _batch_merger(self) -> BatchMerger:
        if self._merger is None:
            self._merger = BatchMerger(self._merge_ranks, self._byte_ids)
        return self._merger

    def _encode_pretokens(self, pretokens: list[str], out: list[int]) -> None:
        """Append the ids of each pre-token to out, through the pre-token cache."""
        lookup = self._cache.get
        extend = out.extend
        for piece in pretokens:
            ids = lookup(piece)
            extend(self._encode_new_piece(piece) if ids is None else ids)

    def _encode_new_piece(self, piece: str) -> tuple[int, ...]:
        """BPE of a pre-token missing from the cache, which then remembers it."""
        ids = self._encode_piece(piece)
        cache = self._cache
        if len(cache) >= self._cache_size:
            cache.clear()  # bounded memory; natural text refills the frequent pieces at once
        if len(piece) <= _MAX_CACHED_CHARS:
            cache[piece] = ids
        return ids

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        """BPE of one pre-token (raises UnicodeEncodeError for lone surrogates)."""
        data = piece.encode("utf-8")
        token_id = self._bytes_to_id.get(data) if len(data) == 1 else None
        if token_id is not None:
            return (token_id,)
        return tuple(merge_ids([self._byte_ids[byte] for byte in data], self._merge_ranks))

    def _split_stable_prefix(self, buffer: str) -> tuple[list[int], str]:
        """Encode the part of buffer that no later text can change; return (its ids, the held-back rest).

        Held back: (1) a tail that is a proper prefix of a special token (more text may complete it, or make a
        longer special match), and (2) the end of the last ordinary piece: from its last space that follows a
        non-whitespace character (a boundary no later text can move, as in ``_encode_ordinary``), or, when it
        has none, the final pre-tokens covering its last ``_LOOKAHEAD_CHARS`` characters: a match ending earlier
        was decided by characters already present (e.g. GPT-2's ``\\s+(?!\\S)`` gives trailing spaces away to
        the next word only once that word arrives).
        """
        cut = len(buffer) - self._partial_special_length(buffer)
        head, pending = buffer[:cut], buffer[cut:]
        pieces = list(split_on_special_tokens(head, self._special_regex))
        open_piece = pieces.pop()[0] if pieces and not pieces[-1][1] else ""
        ids: list[int] = []
        for piece, is_special in pieces:
            if is_special:
                ids.append(self._special_ids[piece])
            else:
                self._encode_ordinary(piece, ids)
        boundary = last_space_boundary(open_piece)
        if boundary > 0:
            self._encode_ordinary(open_piece[:boundary], ids)
            return ids, open_piece[boundary:] + pending
        pretokens = split_pretokens(open_piece)
        held: list[str] = []
        held_chars = 0
        while pretokens and held_chars < _LOOKAHEAD_CHARS:
            held.append(pretokens.pop())
            held_chars += len(held[-1])
        self._encode_pretokens(pretokens, ids)  # not re-joined: joining could merge them into new pre-tokens
        return ids, "".join(reversed(held)) + pending

    def _partial_special_length(self, buffer: str) -> int:
        """Length of the longest tail of buffer that is a proper prefix of some special token (0 if none)."""
        for length in range(min(self._max_special_prefix, len(buffer)), 0, -1):
            if buffer[-length:] in self._special_prefixes:
                return length
        return 0

    # ------------------------------------------------------------------ decoding
    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The raw bytes of ids (may be invalid UTF-8 when a multi-byte character is cut)."""
        ids = ids if isinstance(ids, list | tuple) else list(ids)
        vocab = self.vocab
        try:
            return b"".join([vocab[token_id] for token_id in ids])
        except (KeyError, TypeError):
            position, bad = next((i, t) for i, t in enumerate(ids) if not _is_known_id(vocab, t))
            raise ValueError(f"cannot decode id {bad!r} at position {position}: "
                             f"not in the vocabulary (ids 0..{self.vocab_size - 1})") from None

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids; malformed UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ set-up helpers
    def _add_special_tokens(self) -> dict[str, int]:
        """Map each special token to its id, appending the ones the vocab lacks after the largest id.

        A one-character special token (say "|") also exists as a single byte; its special id is then the
        entry above the 256 bytes (where trainers put specials), while plain text keeps the byte id.
        """
        special_ids = {}
        for token in self.special_tokens:
            data = token.encode("utf-8")
            if data not in self._bytes_to_id:
                new_id = self.vocab_size
                self.vocab[new_id] = data
                self._bytes_to_id[data] = new_id
            candidates = [i for i, value in self.vocab.items() if value == data] if len(data) == 1 else []
            special_ids[token] = min(candidates or [self._bytes_to_id[data]], key=lambda i: (i < 256, i))
        return special_ids


def _is_known_id(vocab: dict[int, bytes], token_id: object) -> bool:
    try:
        return token_id in vocab
    except TypeError:  # unhashable
        return False


def _invert_vocab(vocab: dict[int, bytes]) -> dict[bytes, int]:
    """bytes -> id; where two ids share bytes the smaller id wins (a deterministic choice)."""
    inverse: dict[bytes, int] = {}
    for token_id in sorted(vocab, reverse=True):
        token = vocab[token_id]
        if not isinstance(token_id, int) or not isinstance(token, bytes):
            raise ValueError(f"vocab entries must be int -> bytes, got {token_id!r} -> {token!r}")
        inverse[token] = token_id
    return inverse


def _single_byte_ids(bytes_to_id: dict[bytes, int]) -> list[int]:
    missing = [value for value in range(256) if bytes([value]) not in bytes_to_id]
    if missing:
        raise ValueError(f"vocab lacks {len(missing)} of the 256 single-byte tokens, e.g. {bytes([missing[0]])!r}; "
                         "a byte-level BPE vocab needs all of them")
    return [bytes_to_id[bytes([value])] for value in range(256)]


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


def _unencodable_message(text: str, offset: int) -> str:
    """Name the first character that UTF-8 cannot encode (a lone surrogate) and its position."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return (f"text is not encodable as UTF-8: character {text[error.start]!r} at position "
                f"{offset + error.start} is a lone surrogate")
    return "text is not encodable as UTF-8"
