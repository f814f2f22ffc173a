"""Slow, obviously-correct byte-level BPE: the oracles the fast trainer and encoder are tested against.

Nothing here is clever. The trainer reads the whole text, recounts every adjacent pair of every pre-token
after each merge, picks the most frequent pair (ties: the lexicographically greater pair of byte strings) and
rewrites every pre-token. The encoder applies each merge in rank order to every occurrence at once, minbpe style:
a second spelling of the rule that ``bpe.py`` (the Tokenizer's readable path) applies one merge at a time; the
two agree on merges learned by training, where no merge comes before the merges that make its inputs.
Tokens are byte strings throughout, so two merges that produce the same bytes are the same token.

Use them only on small inputs: training costs O(merges x corpus).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from scratchlm.tokenizer.pretokenize import (
    GPT2_SPLIT_PATTERN,
    pretokens,
    special_token_regex,
    split_on_special_tokens,
    validate_special_tokens,
)

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
    words: dict[Word, int] = {}
    for text, count in counts.items():
        word = tuple(bytes([b]) for b in text.encode("utf-8"))
        words[word] = words.get(word, 0) + count
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
        merged_words: dict[Word, int] = {}
        for word, count in words.items():
            merged = _merge_word(word, best)
            merged_words[merged] = merged_words.get(merged, 0) + count
        words = merged_words
    return vocab, merges


def reference_train_bpe(
    input_path: str | os.PathLike, vocab_size: int, special_tokens: list[str], pattern: str = GPT2_SPLIT_PATTERN
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train on one UTF-8 file, read whole (small inputs only; bytes as stored, no newline translation)."""
    text = Path(input_path).read_bytes().decode("utf-8")
    counts = reference_pretoken_counts(text, special_tokens, pattern)
    return reference_train_from_counts(counts, vocab_size, special_tokens)


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
    ids_of: dict[bytes, int] = {}
    for token_id in sorted(vocab, reverse=True):
        ids_of[vocab[token_id]] = token_id
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
