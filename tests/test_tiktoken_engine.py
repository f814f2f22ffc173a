"""The tiktoken engine (``tokenizer/fast/tiktoken_engine.py``) gives the readable encoder's ids, for GPT-2's vocab
and for a tokenizer trained here, on random and adversarial text, whole or streamed; and it refuses, in one line,
every tokenizer for which tiktoken's BPE would not (each refusal shown to be needed by a raw tiktoken that differs).
"""

from __future__ import annotations

import pickle
import sys

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import gpt2_tokenizer, require_shared
from scratchlm.cli import main
from scratchlm.extras import MissingExtra
from scratchlm.tokenizer import Tokenizer, train_bpe
from scratchlm.tokenizer.fast.tiktoken_engine import TiktokenBPE, TiktokenTokenizer, tiktoken_encoding
from scratchlm.tokenizer.pretokenize import GPT2_SPLIT_PATTERN, pretokens
from test_readable_bpe import READABLE_MAX_PRETOKEN
from test_tokenizer import ADVERSARIAL, EOT, PIECES

SETTINGS = settings(max_examples=100, deadline=None)
piece_text = st.lists(st.sampled_from(PIECES), max_size=60).map("".join)
# Adversarial texts whose pre-tokens the readable merge (O(n^2) per pre-token) finishes quickly.
SHORT_ADVERSARIAL = [t for t in ADVERSARIAL if max(map(len, pretokens(t)), default=0) <= READABLE_MAX_PRETOKEN]
LONG_ADVERSARIAL = [t for t in ADVERSARIAL if t not in SHORT_ADVERSARIAL]


@pytest.fixture(scope="module")
def gpt2() -> Tokenizer:
    """GPT-2's tokenizer through the readable encoder: the oracle."""
    return gpt2_tokenizer(fast=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Tokenizer:
    """A tokenizer trained here on English, German, CJK, emoji and whitespace runs (the readable encoder)."""
    corpus = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    text = "".join(require_shared(f"fixtures/{name}").read_text(encoding="utf-8")
                   for name in ("tinystories_sample.txt", "german.txt", "address.txt"))
    corpus.write_text((text + EOT + "".join(SHORT_ADVERSARIAL) + "日本語の文章です。😀😀 ") * 3, encoding="utf-8")
    vocab, merges = train_bpe(corpus, 800, [EOT], num_workers=1)
    return Tokenizer(vocab, merges, [EOT], fast=False)


@pytest.fixture(scope="module", params=["gpt2", "trained"])
def pair(request) -> tuple[Tokenizer, TiktokenTokenizer]:
    """(the readable encoder, its tiktoken twin) for each tokenizer."""
    readable = request.getfixturevalue(request.param)
    return readable, TiktokenTokenizer.like(readable)


def test_the_twin_is_the_same_tokenizer_with_tiktoken_inside(pair):
    readable, engine = pair
    assert isinstance(engine._bpe, TiktokenBPE)
    assert (engine.hash, engine.vocab_size, engine.special_tokens) == (readable.hash, readable.vocab_size,
                                                                        readable.special_tokens)
    unpickled = pickle.loads(pickle.dumps(engine))  # what a spawned worker of `data encode` gets
    assert isinstance(unpickled, TiktokenTokenizer) and unpickled.encode("a cat's 😀") == readable.encode("a cat's 😀")


@pytest.mark.parametrize("text", SHORT_ADVERSARIAL, ids=range(len(SHORT_ADVERSARIAL)))
def test_ids_equal_the_readable_encoder_on_adversarial_text(pair, text):
    readable, engine = pair
    ids = readable.encode(text)
    assert engine.encode(text) == ids
    assert engine.encoding.encode(text, allowed_special="all") == ids  # the Encoding on its own, specials included
    assert engine.encode_ordinary(text) == readable.encode_ordinary(text)


@pytest.mark.parametrize("text", LONG_ADVERSARIAL, ids=range(len(LONG_ADVERSARIAL)))
def test_ids_equal_the_fast_encoder_on_long_pretokens(pair, text):
    readable, engine = pair  # the fast path is tested equal to the readable one on these (test_readable_bpe.py)
    assert engine.encode(text) == Tokenizer(readable.vocab, readable.merges, readable.special_tokens).encode(text)


@SETTINGS
@given(st.one_of(st.text(), piece_text))
def test_ids_equal_the_readable_encoder_on_any_text(pair, text):
    readable, engine = pair
    assert engine.encode(text) == readable.encode(text)


@SETTINGS
@given(st.one_of(piece_text, st.text(max_size=80)), st.lists(st.integers(0, 200), max_size=8), st.integers(1, 8))
def test_streamed_ids_equal_the_readable_encoder(pair, text, cuts, chunk_chars):
    """Small chunks make ``encode_stream`` hold back tails and encode pre-tokens one by one (encode_pretokens)."""
    readable, engine = pair
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    streamed = [i for ids in engine.encode_stream(chunks, chunk_chars=chunk_chars) for i in ids]
    assert streamed == readable.encode(text)


@SETTINGS
@given(st.one_of(st.text(), piece_text))
def test_a_pretoken_alone_is_one_pretoken(text):
    """What TiktokenBPE.encode_pretokens relies on to hand tiktoken one pre-token at a time."""
    for piece in pretokens(text):
        assert pretokens(piece) == [piece]


@pytest.mark.parametrize("name", ["tinystories_sample.txt", "address.txt", "german.txt", "corpus.en"])
def test_ids_equal_on_fixture_files(pair, name):
    readable, engine = pair
    text = require_shared(f"fixtures/{name}").read_text(encoding="utf-8")
    assert engine.encode(text) == readable.encode(text)


def test_overlapping_special_tokens_are_cut_by_our_rule():
    """Special tokens are cut out by Tokenizer (longest first), not by tiktoken (which tries them in no set order)."""
    vocab = {i: bytes([i]) for i in range(256)}
    specials = ["<|a|>", "<|a|><|b|>", "<|b|>"]
    text = "x<|a|><|b|>y<|a|>z<|b|><|a|>"
    readable = Tokenizer(vocab, [], specials, fast=False)
    assert TiktokenTokenizer.like(readable).encode(text) == readable.encode(text)


def test_lone_surrogates_are_refused_as_by_our_encoder(gpt2):
    engine = TiktokenTokenizer.like(gpt2)
    with pytest.raises(ValueError, match=r"position 6 is a lone surrogate"):
        engine.encode("hello \ud800 world")
    with pytest.raises(ValueError, match=r"position 300003 is a lone surrogate"):
        list(engine.encode_iterable(["abc " * 75_000, "xyz\udfff"]))


# ---------------------------------------------------------------------------------------------- refusals
def _byte_vocab() -> dict[int, bytes]:
    return {i: bytes([i]) for i in range(256)}


def _with_merges(merges: list[tuple[bytes, bytes]], ids: list[int] | None = None) -> Tokenizer:
    """Single bytes, then each merge's result (at ``ids``, default 256, 257, ...)."""
    vocab = _byte_vocab()
    for token_id, (left, right) in zip(ids or range(256, 256 + len(merges)), merges):
        vocab[token_id] = left + right
    return Tokenizer(vocab, merges, fast=False)


def _raw_tiktoken(tokenizer: Tokenizer) -> tiktoken.Encoding:
    """tiktoken with ranks = our ids and none of the checks: what the refusals keep from being used."""
    return tiktoken.Encoding(name="unchecked", pat_str=GPT2_SPLIT_PATTERN, special_tokens={},
                             mergeable_ranks={data: token_id for token_id, data in tokenizer.vocab.items()})


def test_refuses_a_token_that_the_merges_do_not_make_of_its_bytes():
    # (b, c) merges first, so BPE makes [a, bc] of "abc"; tiktoken would emit "abc" whole, and merge a + bc.
    tokenizer = _with_merges([(b"b", b"c"), (b"a", b"b"), (b"ab", b"c")])
    assert tokenizer.encode("abc") == [97, 256] and _raw_tiktoken(tokenizer).encode("abc") == [258]
    assert tokenizer.encode("abcd") == [97, 256, 100] and _raw_tiktoken(tokenizer).encode_ordinary("abcd") == [258, 100]
    with pytest.raises(ValueError, match=r"token 258 b'abc' is not what the merges make of its bytes \(\[97, 256\]\)"):
        TiktokenTokenizer.like(tokenizer)


def test_refuses_merges_out_of_id_order():
    # Merge #0 makes id 257 and merge #1 id 256: tiktoken would merge "bc" before "ab".
    tokenizer = _with_merges([(b"a", b"b"), (b"b", b"c")], ids=[257, 256])
    assert tokenizer.encode("abc") == [257, 99] and _raw_tiktoken(tokenizer).encode("abc") == [97, 256]
    with pytest.raises(ValueError, match=r"merge #1 \(b'b', b'c'\) makes token 256, but merge #0 made token 257: "
                                         r"tiktoken ranks merges by id"):
        TiktokenTokenizer.like(tokenizer)


def test_refuses_a_token_no_merge_makes():
    tokenizer = Tokenizer({**_byte_vocab(), 256: b"ab", 257: b"xyz"}, [(b"a", b"b")], fast=False)
    assert tokenizer.encode("xyz") == [120, 121, 122] and _raw_tiktoken(tokenizer).encode("xyz") == [257]
    with pytest.raises(ValueError, match=r"token 257 b'xyz' is not what the merges make of its bytes"):
        TiktokenTokenizer.like(tokenizer)


def test_refuses_bytes_held_by_two_ids():
    tokenizer = Tokenizer({**_byte_vocab(), 256: b"ab", 257: b"ab"}, [(b"a", b"b")], fast=False)
    with pytest.raises(ValueError, match=r"ids 256 and 257 are both b'ab'"):
        TiktokenTokenizer.like(tokenizer)


def test_refuses_a_byte_that_only_a_special_token_holds():
    tokenizer = Tokenizer(_byte_vocab(), [], ["|"], fast=False)  # "|" is then a special token and byte 124 both
    with pytest.raises(ValueError, match=r"byte b'\|' is a special token only.*--engine scratchlm"):
        TiktokenTokenizer.like(tokenizer)


def test_a_refusal_is_one_line_from_the_cli(tmp_path, capsys):
    directory = _with_merges([(b"b", b"c"), (b"a", b"b"), (b"ab", b"c")]).save(tmp_path / "tok")
    (tmp_path / "in.txt").write_text("abc abc\n", encoding="utf-8")
    argv = ["data", "encode", "--tokenizer", str(directory), "--input", str(tmp_path / "in.txt"), "--out",
            str(tmp_path / "out.tok"), "--no-eot", "--engine", "tiktoken"]
    assert main(argv) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "token 258 b'abc' is not what the merges make" in error
    assert not (tmp_path / "out.tok").exists()


def test_without_tiktoken_the_engine_names_the_fast_extra(gpt2, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(MissingExtra, match=r"needs the tiktoken package.*pip install 'scratchlm\[fast\]'"):
        tiktoken_encoding(gpt2)
