"""Long pre-tokens (a line of DNA, base64 or minified code is ONE GPT-2 pre-token): training them through the numpy
path (``long_words.py``) equals the reference trainer, and encoding them through rank rounds (``long_merge.py``,
windowed for monotone merge tables) equals the one-at-a-time rule, the reference encoder and tiktoken."""

from __future__ import annotations

import random
from collections import Counter
from functools import cache
from unittest import mock

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tiktoken_ext.openai_public import r50k_pat_str

from scratchlm.tokenizer import Tokenizer
from scratchlm.tokenizer.bpe import reference_encode, reference_train_from_counts
from scratchlm.tokenizer.fast import long_merge
from scratchlm.tokenizer.fast.batch_merge import BatchMerger
from scratchlm.tokenizer.fast.long_merge import LongPieceMerger, _is_monotone
from scratchlm.tokenizer.fast.merge import merge_by_scan
from scratchlm.tokenizer.long_words import LongWords
from scratchlm.tokenizer.train_bpe import train_bpe_from_counts
from test_tokenizer import _random_merge_table

LONG_TRAIN = "scratchlm.tokenizer.train_bpe.LONG_WORD_MIN_BYTES"
LONG_ENCODE = "scratchlm.tokenizer.fast.cached_bpe.LONG_PIECE_MIN_BYTES"


def _letters(alphabet: str, size: int, seed: int) -> str:
    return "".join(random.Random(seed).choices(alphabet, k=size))


LONG_WORDS = {
    "repeated": Counter({"a" * 3000: 1}),
    "alternating": Counter({"ab" * 1500: 1, "ba" * 600: 2}),
    "dna": Counter({_letters("acgt", 4000, 1): 1, "gattaca": 5}),
    "letters": Counter({_letters("abcdefghijklmnopqrstuvwxyz", 3000, 2): 1, "the": 9, "cat": 3}),
    "runs": Counter({"".join(c * random.Random(3).randint(1, 9) for c in _letters("ab", 600, 3)): 2}),
    "multibyte": Counter({"é" * 700 + "ü" * 600: 1, "\u00e9t\u00e9": 4}),
    "several-counts": Counter({_letters("abc", 1500, 4): 1, _letters("abc", 1100, 5): 3, _letters("abc", 1200, 6): 3}),
}


@pytest.mark.parametrize("name", sorted(LONG_WORDS))
def test_long_words_train_like_the_reference(name):
    counts = LONG_WORDS[name]
    with mock.patch.object(LongWords, "merge", autospec=True, side_effect=LongWords.merge) as merge:
        fast = train_bpe_from_counts(counts, 256 + 120, [])
    assert merge.called  # the long path really ran
    assert fast == reference_train_from_counts(counts, 256 + 120, [])


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(alphabet="abc", min_size=1, max_size=60), st.integers(1, 4), max_size=8),
       st.integers(2, 40), st.integers(0, 60))
def test_any_split_into_long_and_short_words_trains_like_the_reference(words, long_from, extra):
    """Words from `long_from` bytes up take the numpy path: with tiny thresholds most words do, mixed with list-path
    words in the same pair counts (dense ties over a 3-letter alphabet)."""
    counts = Counter(words)
    with mock.patch(LONG_TRAIN, long_from):
        fast = train_bpe_from_counts(counts, 256 + extra, [])
    assert fast == reference_train_from_counts(counts, 256 + extra, [])


@settings(max_examples=10, deadline=None)
@given(st.text(alphabet="ab", min_size=1024, max_size=2500), st.text(alphabet="xyz", min_size=1024, max_size=1500))
def test_long_random_strings_train_like_the_reference(first, second):
    counts = Counter({first: 1, second: 2})
    assert train_bpe_from_counts(counts, 256 + 40, []) == reference_train_from_counts(counts, 256 + 40, [])


# --- encoding ------------------------------------------------------------------------------------------------


@cache
def _random_table_and_merger(seed: int) -> tuple[dict, LongPieceMerger]:
    table = _random_merge_table(random.Random(seed), 4)
    return table, LongPieceMerger(BatchMerger(table, list(range(256))), table, list(range(256)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=200), st.integers(0, 30))
def test_rank_rounds_equal_one_merge_at_a_time_on_any_merge_table(symbols, seed):
    """Random ranks (not monotone): a merge can make a pair ranked below it, which must then come first."""
    table, merger = _random_table_and_merger(seed)
    assert list(merger.merge(bytes(symbols))) == merge_by_scan(list(symbols), table)


def _trained(text: str, vocab_size: int) -> tuple[Tokenizer, tiktoken.Encoding]:
    vocab, merges = train_bpe_from_counts(Counter({text: 1}), vocab_size, [])
    ranks = {token: token_id for token_id, token in vocab.items()}
    return Tokenizer(vocab, merges), tiktoken.Encoding("trained", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                                       special_tokens={})


@pytest.mark.parametrize("text,vocab_size", [
    ("a" * 5000, 300),  # tokens of up to 4096 bytes: a window holds fewer tokens than merges and must grow
    ("ab" * 3000, 300),
    (_letters("acgt", 6000, 7), 400),
    (_letters("abcdefghijklmnopqrstuvwxyz", 3000, 8), 500),
])
def test_long_pieces_encode_like_tiktoken_and_the_reference(text, vocab_size):
    """Trained merges are monotone, so the piece is merged in windows (made small here so that there are many)."""
    tokenizer, oracle = _trained(text, vocab_size)
    assert _is_monotone(tokenizer._bpe._merge_ranks)
    rolled = random.Random(9).sample(text, len(text))  # other text than the training text, same letters
    for piece in (text, "".join(rolled)):
        with mock.patch(LONG_ENCODE, 2), mock.patch.object(long_merge, "_MIN_WINDOW_BYTES", 64):
            tokenizer.clear_cache()
            ids = tokenizer.encode(piece)
        assert ids == oracle.encode_ordinary(piece)
        assert ids == reference_encode(piece, tokenizer.vocab, tokenizer.merges)


@settings(max_examples=25, deadline=None)
@given(st.text(alphabet="abc", min_size=1, max_size=3000), st.integers(1, 200))
def test_long_random_strings_encode_like_tiktoken(text, window):
    tokenizer, oracle = _trained(_letters("abc", 3000, 10), 256 + 60)
    with mock.patch(LONG_ENCODE, 2), mock.patch.object(long_merge, "_MIN_WINDOW_BYTES", window):
        tokenizer.clear_cache()
        assert tokenizer.encode(text) == oracle.encode_ordinary(text)


def test_a_merge_table_with_a_merge_before_its_input_is_not_monotone():
    assert not _is_monotone({(0, 1): (1, 256), (256, 2): (0, 257)})
    assert _is_monotone({(0, 1): (0, 256), (256, 2): (1, 257)})


def test_streaming_a_long_line_pre_tokenizes_its_held_back_tail_a_logarithmic_number_of_times():
    """A line with no space is held back whole until it ends; re-splitting it at every chunk would be quadratic."""
    tokenizer, oracle = _trained(_letters("abc", 3000, 13), 256 + 30)
    line = _letters("abc", 200_000, 14)
    chunks = [line[start:start + 100] for start in range(0, len(line), 100)]
    with mock.patch.object(Tokenizer, "_split_stable_prefix", autospec=True,
                           side_effect=Tokenizer._split_stable_prefix) as split:
        ids = [token for block in tokenizer.encode_stream(chunks, chunk_chars=100) for token in block]
    assert ids == oracle.encode_ordinary(line)
    assert split.call_count <= 2 + (len(line) // 100).bit_length()
