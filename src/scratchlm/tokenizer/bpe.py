"""Byte-level BPE as the CS336 handout and minbpe write it: training and encoding, slow and obviously correct.

Read this file first. The rest of tokenizer/ computes the same thing faster (``train_bpe.py``, ``fast/``: tested
equal to this file) or is plumbing: pre-tokenization (``pretokenize.py``, ``pipeline.py``), the ``Tokenizer`` around
an encoder (``tokenizer.py``) and the file formats (``formats/``).

Training. Cut out the special tokens (never merged), split the rest into pre-tokens with the pattern (GPT-2's by
default) and count them; each is a word of single bytes. Then, until the vocabulary is full, count every adjacent
pair of every word (weighted by its count), merge the most frequent (ties: the greater pair of byte strings)
everywhere, and give the merged bytes the next id. Vocabulary: the 256 bytes, the special tokens, one token per
merge. O(merges x corpus): small inputs only.

Encoding. A pre-token starts as its bytes; the adjacent pair with the lowest merge rank is merged (the leftmost if
it occurs twice) until no pair has a merge: GPT-2's rule (``bpe_merge``). ``ReadableBPE`` applies it after the
pipeline's NFC, and with ``ignore_merges`` a pre-token that is one token stays whole, as Llama 3 and tiktoken do.
``reference_encode`` spells the rule minbpe's way, applying each merge in rank order everywhere; the two agree on
trained merges. Both are O(n^2) per pre-token, so ``Tokenizer`` uses ``fast/`` unless built with ``fast=False``.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Protocol

from scratchlm.tokenizer.pipeline import GPT2_PIPELINE, Pipeline
from scratchlm.tokenizer.pretokenize import (
    GPT2_SPLIT_PATTERN,
    pretokens,
    special_token_regex,
    split_on_special_tokens,
    validate_special_tokens,
)

# -------------------------------------------------- training

Word = tuple[bytes, ...]


def reference_pretoken_counts(text: str, special_tokens: list[str],
                              pattern: str = GPT2_SPLIT_PATTERN) -> Counter[str]:
    """Counts of the pre-tokens of `text` (split by `pattern`, GPT-2's by default), special tokens cut out and not
    counted."""
    counts: Counter[str] = Counter()
    for piece, is_special in split_on_special_tokens(text, special_token_regex(special_tokens)):
        if not is_special:
            counts.update(pretokens(piece, pattern))
    return counts


def _merge_word(word: Word, pair: tuple[bytes, bytes]) -> Word:
    """Replace every occurrence of `pair` in `word`, scanning left to right."""
    merged: list[bytes] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            merged.append(word[i] + word[i + 1])
            i += 2
        else:
            merged.append(word[i])
            i += 1
    return tuple(merged)


def reference_train_from_counts(
    counts: Counter[str], vocab_size: int, special_tokens: list[str]
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """BPE merges learned from pre-token counts; vocab = 256 bytes, then specials, then merges."""
    special_tokens = validate_special_tokens(special_tokens)
    vocab = {i: bytes([i]) for i in range(256)}
    for token in special_tokens:
        vocab[len(vocab)] = token.encode("utf-8")
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size {vocab_size} is smaller than 256 bytes + {len(special_tokens)} special tokens")
    # Each pre-token is a word of single bytes. A merge keeps a word's bytes, so distinct words stay distinct.
    words: dict[Word, int] = {tuple(bytes([b]) for b in text.encode("utf-8")): count for text, count in counts.items()}
    merges: list[tuple[bytes, bytes]] = []
    while len(vocab) < vocab_size:
        pair_counts: Counter[tuple[bytes, bytes]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pair_counts[pair] += count
        if not pair_counts:
            break
        best = max(pair_counts, key=lambda pair: (pair_counts[pair], pair))
        merges.append(best)
        vocab[len(vocab)] = best[0] + best[1]
        words = {_merge_word(word, best): count for word, count in words.items()}
    return vocab, merges


def reference_train_bpe(
    input_path: str | os.PathLike, vocab_size: int, special_tokens: list[str], pattern: str = GPT2_SPLIT_PATTERN
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train on one UTF-8 file, read whole (small inputs only; bytes as stored, no newline translation)."""
    text = Path(input_path).read_bytes().decode("utf-8")
    counts = reference_pretoken_counts(text, special_tokens, pattern)
    return reference_train_from_counts(counts, vocab_size, special_tokens)


# -------------------------------------------------- encoding

# (left id, right id) -> (rank, merged id): the merge table both encoders read.
MergeTable = dict[tuple[int, int], tuple[int, int]]


class PieceEncoder(Protocol):
    """What ``Tokenizer`` asks of an encoder of ordinary text (special tokens already cut out)."""

    def encode(self, text: str, out: list[int]) -> None:
        """Append the ids of text to out."""

    def encode_pretokens(self, pretokens: list[str], out: list[int]) -> None:
        """Append the ids of each given pre-token to out (they are not pre-tokenized again)."""

    def clear(self) -> None:
        """Forget any cached work (the ids stay the same)."""


def merge_table(merges: list[tuple[bytes, bytes]], bytes_to_id: dict[bytes, int]) -> MergeTable:
    """(left id, right id) -> (rank, merged id); the first occurrence of a pair keeps its rank."""
    table: MergeTable = {}
    for rank, (left, right) in enumerate(merges):
        merged = left + right
        if left not in bytes_to_id or right not in bytes_to_id or merged not in bytes_to_id:
            missing = next(token for token in (left, right, merged) if token not in bytes_to_id)
            raise ValueError(f"merge #{rank} ({left!r}, {right!r}) uses or makes {missing!r}, which is not in the "
                             "vocab")
        table.setdefault((bytes_to_id[left], bytes_to_id[right]), (rank, bytes_to_id[merged]))
    return table


def bpe_merge(ids: list[int], table: MergeTable) -> list[int]:
    """The BPE of one pre-token given as its byte ids: merge the lowest-ranked adjacent pair (leftmost on ties)
    until no adjacent pair has a merge."""
    ids = list(ids)
    while len(ids) > 1:
        ranked = [(table[pair][0], index) for index, pair in enumerate(zip(ids, ids[1:])) if pair in table]
        if not ranked:
            break
        _, index = min(ranked)  # the lowest rank; among its occurrences, the leftmost
        ids[index:index + 2] = [table[ids[index], ids[index + 1]][1]]
    return ids


class ReadableBPE:
    """``PieceEncoder`` by the rule alone: normalize and pre-tokenize as the pipeline says, then ``bpe_merge`` each
    pre-token, or emit it whole when it is in ``tokens`` (bytes -> id, given for the pipeline's ignore_merges)."""

    def __init__(self, table: MergeTable, byte_ids: list[int], pipeline: Pipeline = GPT2_PIPELINE,
                 tokens: dict[bytes, int] | None = None) -> None:
        self._table = table
        self._byte_ids = byte_ids  # the id of each of the 256 single bytes
        self._pipeline = pipeline
        self._whole_tokens = tokens or {}

    def encode(self, text: str, out: list[int]) -> None:
        self.encode_pretokens(pretokens(self._pipeline.normalize(text), self._pipeline.pattern), out)

    def encode_pretokens(self, pretokens: list[str], out: list[int]) -> None:
        for piece in pretokens:
            data = piece.encode("utf-8")
            if data in self._whole_tokens:  # ignore_merges: a pre-token that is a token is emitted whole
                out.append(self._whole_tokens[data])
            else:
                out.extend(bpe_merge([self._byte_ids[byte] for byte in data], self._table))

    def clear(self) -> None:
        """Nothing to forget: this encoder caches nothing."""


def _encode_pretoken(piece: bytes, ranks: dict[tuple[bytes, bytes], int]) -> list[bytes]:
    """Apply the lowest-ranked applicable merge, everywhere it occurs, until none applies."""
    parts: Word = tuple(bytes([b]) for b in piece)
    while len(parts) > 1:
        candidates = [pair for pair in zip(parts, parts[1:]) if pair in ranks]
        if not candidates:
            break
        parts = _merge_word(parts, min(candidates, key=ranks.__getitem__))
    return list(parts)


def _special_ids(vocab: dict[int, bytes], special_tokens: list[str]) -> dict[str, int]:
    special_ids: dict[str, int] = {}
    next_id = max(vocab, default=-1) + 1
    for token in special_tokens:
        matches = [i for i, value in vocab.items() if value == token.encode("utf-8")]
        if matches:
            special_ids[token] = min(matches, key=lambda i: (i < 256, i))
        else:
            special_ids[token] = next_id
            next_id += 1
    return special_ids


def reference_encode(
    text: str, vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]], special_tokens: list[str] | None = None
) -> list[int]:
    """Token ids of `text`: specials (longest first) become their ids, the rest is BPE per pre-token.

    Where several ids share the same bytes, the lowest id is used (for a special token: the lowest id
    above the 256 single bytes); special tokens missing from the vocab get ids after the largest one.
    """
    special_tokens = validate_special_tokens(special_tokens)
    ids_of = {vocab[token_id]: token_id for token_id in sorted(vocab, reverse=True)}  # the lowest id wins
    special_ids = _special_ids(vocab, special_tokens)
    ranks = {pair: rank for rank, pair in reversed(list(enumerate(merges)))}
    ids: list[int] = []
    for piece, is_special in split_on_special_tokens(text, special_token_regex(special_tokens)):
        if is_special:
            ids.append(special_ids[piece])
            continue
        for pretoken in pretokens(piece):
            ids.extend(ids_of[part] for part in _encode_pretoken(pretoken.encode("utf-8"), ranks))
    return ids
