"""The readable encoder (``bpe.py``, ``Tokenizer(fast=False)``) gives tiktoken's GPT-2 ids, and the fast path
(``tokenizer/fast/``, the default) gives the readable path's ids on random, adversarial and non-monotone input."""

from __future__ import annotations

import pickle
import random
from itertools import product
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import gpt2_tokenizer, require_shared
from scratchlm.tokenizer import Tokenizer
from scratchlm.tokenizer.bpe import ReadableBPE, bpe_merge
from scratchlm.tokenizer.fast import CachedBPE, long_merge
from scratchlm.tokenizer.fast.merge import merge_by_scan, merge_with_heap
from scratchlm.tokenizer.pretokenize import pretokens
from test_tokenizer import ADVERSARIAL, PIECES, _random_merge_table, gpt2_tiktoken

SETTINGS = settings(max_examples=100, deadline=None)
# The readable merge is O(n^2) in a pre-token's length: adversarial texts with longer pre-tokens are the fast path's.
READABLE_MAX_PRETOKEN = 2000
piece_text = st.lists(st.sampled_from(PIECES), max_size=60).map("".join)


@pytest.fixture(scope="module")
def readable() -> Tokenizer:
    return gpt2_tokenizer(fast=False)


@pytest.fixture(scope="module")
def fast(readable) -> Tokenizer:
    return Tokenizer(readable.vocab, readable.merges, readable.special_tokens)


@pytest.fixture(scope="module")
def tik():
    return gpt2_tiktoken()


def test_the_switch_picks_the_encoder(readable, fast):
    assert isinstance(readable._bpe, ReadableBPE) and not readable.fast
    assert isinstance(fast._bpe, CachedBPE) and fast.fast
    assert not pickle.loads(pickle.dumps(readable)).fast  # workers of `data encode` keep the choice


@pytest.mark.parametrize("text", [t for t in ADVERSARIAL if max(map(len, pretokens(t)), default=0)
                                  <= READABLE_MAX_PRETOKEN])
def test_readable_path_matches_tiktoken_and_the_fast_path_on_adversarial_text(readable, fast, tik, text):
    ids = readable.encode(text)
    assert ids == tik.encode(text, allowed_special="all") == fast.encode(text)
    assert readable.encode_ordinary(text) == tik.encode_ordinary(text)


@pytest.mark.parametrize("name", ["tinystories_sample.txt", "address.txt", "german.txt", "corpus.en"])
def test_readable_path_matches_tiktoken_on_fixture_files(readable, fast, tik, name):
    text = require_shared(f"fixtures/{name}").read_text(encoding="utf-8")
    ids = readable.encode(text)
    assert ids == tik.encode(text, allowed_special="all")
    fast.clear_cache()
    assert fast.encode(text) == ids
    with open(require_shared(f"fixtures/{name}"), encoding="utf-8", newline="") as handle:
        assert list(readable.encode_iterable(handle)) == ids


@SETTINGS
@given(st.one_of(st.text(), piece_text))
def test_readable_and_fast_paths_match_tiktoken_on_any_text(readable, fast, tik, text):
    ids = readable.encode(text)
    assert ids == tik.encode(text, allowed_special="all")
    assert fast.encode(text) == ids


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=300), st.integers(0, 50))
def test_fast_merge_loops_equal_the_readable_merge_on_any_merge_table(symbols, seed):
    """Random tables make merges that come before their inputs (not monotone), where rules that merge a pair
    everywhere at once, or in the wrong order, would differ."""
    table = _random_merge_table(random.Random(seed), 4)
    expected = bpe_merge(list(symbols), table)
    assert merge_by_scan(list(symbols), table) == expected
    assert merge_with_heap(list(symbols), table) == expected


def _shuffled_merges(seed: int) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Every split of every string of 2-3 letters over "ab c" as a merge, in a random order (not monotone)."""
    letters = [bytes([c]) for c in b"ab c"]
    merges = [(a, b) for a, b in product(letters, letters)]
    merges += [(a + b, c) for a, b, c in product(letters, repeat=3)] + [(a, b + c) for a, b, c in
                                                                       product(letters, repeat=3)]
    random.Random(seed).shuffle(merges)
    vocab = {i: bytes([i]) for i in range(256)}
    for token in dict.fromkeys(left + right for left, right in merges):
        vocab[len(vocab)] = token
    return vocab, merges


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="ab c\n", max_size=400), st.integers(0, 20), st.integers(1, 8))
def test_fast_path_equals_readable_path_on_merge_tables_out_of_order(text, seed, cache_size):
    """Tiny caches (cleared often), every piece through the long-piece merger, and batch learning of a cold block."""
    vocab, merges = _shuffled_merges(seed)
    expected = Tokenizer(vocab, merges, fast=False).encode(text)
    fast = Tokenizer(vocab, merges, cache_size=cache_size)
    with (mock.patch("scratchlm.tokenizer.fast.cached_bpe.LONG_PIECE_MIN_BYTES", 2),
          mock.patch.object(long_merge, "_MIN_WINDOW_BYTES", 16)):
        assert fast.encode(text) == expected
    assert fast.encode(text) == expected  # short pieces through the scan and heap loops, the caches now warm
    with mock.patch("scratchlm.tokenizer.fast.cached_bpe._BATCH_MIN_WORDS", 1):
        fast.clear_cache()
        assert fast.encode((text + " ") * 40) == Tokenizer(vocab, merges, fast=False).encode((text + " ") * 40)
