"""Tokenizer: ids identical to tiktoken's GPT-2 (built offline from the fixture files), streaming equals whole-text
encoding, round-trips, both file formats, and clear errors for bad input."""

from __future__ import annotations

import gc
import json
import random
from itertools import islice, product, repeat
from unittest import mock

import numpy as np
import pytest
import regex
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tiktoken_ext.openai_public import r50k_pat_str

from conftest import gpt2_file_paths, gpt2_tokenizer, require_shared
from scratchlm.tokenizer import Tokenizer
from scratchlm.tokenizer.bpe import merge_table, reference_encode
from scratchlm.tokenizer.fast.batch_merge import BatchMerger
from scratchlm.tokenizer.fast.long_merge import _is_monotone
from scratchlm.tokenizer.fast.merge import merge_by_scan, merge_with_heap
from scratchlm.tokenizer.pretokenize import GPT2_ASCII_SPLIT_REGEX, last_space_boundary, pretokens, split_pretokens

EOT = "<|endoftext|>"
SETTINGS = settings(max_examples=150, deadline=None)


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's unicode -> byte table, written out independently of scratchlm.tokenizer.formats.io (an oracle)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


@pytest.fixture(scope="module")
def gpt2() -> Tokenizer:
    return gpt2_tokenizer()


@pytest.fixture(scope="module")
def tik() -> tiktoken.Encoding:
    return gpt2_tiktoken()


def gpt2_tiktoken() -> tiktoken.Encoding:
    """tiktoken's GPT-2 encoding built offline from the fixture files (the oracle)."""
    decoder = _gpt2_byte_decoder()
    encoder = json.loads(gpt2_file_paths()[0].read_text(encoding="utf-8"))
    ranks = {bytes(decoder[c] for c in token): rank for token, rank in encoder.items() if token != EOT}
    # tiktoken's own spelling of the GPT-2 pattern, not ours: a bug in our pattern must not be copied into the oracle.
    return tiktoken.Encoding(name="gpt2-offline", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={EOT: encoder[EOT]})


# The pattern as openai/gpt-2's encoder.py spells it, written out here independently of scratchlm.
OPENAI_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


ADVERSARIAL = [
    "", " ", "\n", "\r\n", "\r\n\r\n", "  \n\n  \t\n", " " * 1000, "\n" * 500, "\t \n " * 50,
    "Hello, world! 😀🎉👨‍👩‍👧‍👦 family", "日本語のテキスト、中文字符。한국어", "e\u0301 n\u0303 a\u0308\u0301\u0327",
    "x" * 100_000, "ab" * 20_000, "0123456789" * 200, "'s 've 're 'll 'd 'm 't 'S 'LL",
    "I'll DON'TCARE x'LLy it's' ''s 'tis '' 'd'd", "'ll'll've", "a'\nll",
    f"{EOT}", f"{EOT}{EOT}", f"a{EOT}b", f" {EOT} ", f"\n{EOT}\n", f"<|endoftext|{EOT}|>", "<|endoftext", "|>",
    "\u00a0\u2003\u3000 nbsp", "\x00\x01\x7f control", "🏳️‍🌈" * 30, "ﬁ ligature ǅ title-case",
]


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_matches_tiktoken_on_adversarial_text(gpt2, tik, text):
    assert gpt2.encode(text) == tik.encode(text, allowed_special="all")
    assert gpt2.encode_ordinary(text) == tik.encode_ordinary(text)
    assert gpt2.decode(gpt2.encode(text)) == text


@pytest.mark.parametrize("name", ["tinystories_sample.txt", "address.txt", "german.txt", "corpus.en"])
def test_matches_tiktoken_on_fixture_files(gpt2, tik, name):
    text = require_shared(f"fixtures/{name}").read_text(encoding="utf-8")
    ids = gpt2.encode(text)
    assert ids == tik.encode(text, allowed_special="all")
    assert gpt2.decode(ids) == text
    with open(require_shared(f"fixtures/{name}"), encoding="utf-8", newline="") as handle:
        assert list(gpt2.encode_iterable(handle)) == ids
    gpt2.clear_cache()  # the same ids when every pre-token goes through BPE again
    assert gpt2.encode(text) == ids


@SETTINGS
@given(st.text())
def test_matches_tiktoken_on_any_unicode(gpt2, tik, text):
    assert gpt2.encode(text) == tik.encode(text, allowed_special="all")


PIECES = [" ", "  ", "\n", "\r\n", "\t", "a", "the", " cat", "'s", "'", "ll", "7", "42", "!", "?!", "😀", "👨‍👩‍👧",
          "日本", "\u0301", "é", EOT, "<|", "endoftext", "|>", "\u00a0", "\x1c", "\u0085", "\u2028", "\u3000"]
piece_text = st.lists(st.sampled_from(PIECES), max_size=60).map("".join)


@SETTINGS
@given(piece_text)
def test_matches_tiktoken_on_text_built_from_hard_pieces(gpt2, tik, text):
    ids = gpt2.encode(text)
    assert ids == tik.encode(text, allowed_special="all")
    assert gpt2.decode(ids) == text


@SETTINGS
@given(st.one_of(piece_text, st.text(max_size=80)), st.lists(st.integers(0, 200), max_size=8), st.integers(1, 8))
def test_encode_stream_equals_encode_for_any_chunking(gpt2, text, cuts, chunk_chars):
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    streamed = [i for ids in gpt2.encode_stream(chunks, chunk_chars=chunk_chars) for i in ids]
    assert streamed == gpt2.encode(text)


def test_encode_iterable_is_lazy_and_handles_lines(gpt2):
    lines = ["Once upon a time   \n", "   there was\n", "\n", "  <|endof", "text|>  \n", "end"]
    assert list(gpt2.encode_iterable(lines)) == gpt2.encode("".join(lines))
    line = "Once upon a time there was a cat.\n"

    def source():  # fails if read to its end: the first 1000 ids need ~100 of its lines
        yield from repeat(line, 10_000)
        raise AssertionError("encode_iterable read its whole input before yielding")

    assert list(islice(gpt2.encode_iterable(source()), 1000)) == gpt2.encode(line * 200)[:1000]


def test_overlapping_special_tokens_match_longest_first_also_when_streamed():
    vocab = {i: bytes([i]) for i in range(256)}
    specials = ["<|a|>", "<|a|><|b|>", "<|b|>"]
    tokenizer = Tokenizer(vocab, [], specials)
    text = "x<|a|><|b|>y<|a|>z<|b|><|a|>"
    expected = reference_encode(text, vocab, [], specials)
    assert tokenizer.encode(text) == expected
    assert tokenizer.encode(text)[1] == tokenizer.special_id("<|a|><|b|>")
    for cut in range(len(text) + 1):
        chunks = [text[:cut], text[cut:]]
        assert [i for ids in tokenizer.encode_stream(chunks, chunk_chars=1) for i in ids] == expected


def test_missing_special_tokens_are_appended(gpt2):
    tokenizer = Tokenizer(gpt2.vocab, gpt2.merges, [EOT, "<|pad|>", "<|sep|>"])
    assert tokenizer.special_id(EOT) == 50256
    assert (tokenizer.special_id("<|pad|>"), tokenizer.special_id("<|sep|>")) == (50257, 50258)
    assert tokenizer.vocab_size == 50259
    assert tokenizer.encode("a<|sep|>") == [64, 50258]
    assert tokenizer.decode([50258]) == "<|sep|>"
    with pytest.raises(ValueError, match="not a special token"):
        tokenizer.special_id("<|nope|>")


def test_agrees_with_reference_encoder_on_a_small_vocab():
    """A toy vocab with a one-character special token; the reference encoder is the oracle."""
    vocab = {i: bytes([i]) for i in range(256)}
    merges = [(b"a", b"b"), (b"ab", b"c"), (b" ", b"ab"), (b"c", b"c"), (b"cc", b"c")]
    for left, right in merges:
        vocab[len(vocab)] = left + right
    specials = ["|", "<s>"]
    tokenizer = Tokenizer(vocab, merges, specials)
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice(["a", "b", "c", " ", "|", "<s>", "\n", "abc"]) for _ in range(rng.randrange(30)))
        assert tokenizer.encode(text) == reference_encode(text, tokenizer.vocab, merges, specials)


def test_word_ends_decide_the_split_as_the_regex_does(gpt2, tik):
    """The hot loop decides "ends in whitespace" by a table for ASCII (regex's \\s, which unlike str.isspace
    excludes \\x1c-\\x1f) and encodes ASCII letter or digit words as one pre-token without the regex. A toy vocab
    where every character merges with a following space makes a wrong split change the ids."""
    ends = [chr(c) for c in range(128)] + ["\x85", "\xa0", "\u2028", "\u3000", "é", "٣"]
    words = [f"ab{end}" for end in ends] + ["word", "12345", "x9", "déjà", "٣٤", "ｗｏｒｄ", "it's"]
    text = " ".join(words) + "  ".join(words) + "".join(f"{a}  {b}   {a}" for a in words[::3] for b in words[::7])
    vocab = {i: bytes([i]) for i in range(256)}
    merges = [(end.encode(), b" ") for end in ends if end.isascii()] + [(b"a", b"b"), (b" ", b"ab")]
    for left, right in merges:
        vocab[len(vocab)] = left + right
    assert Tokenizer(vocab, merges).encode(text) == reference_encode(text, vocab, merges)
    gpt2.clear_cache()
    assert gpt2.encode_ordinary(text) == tik.encode_ordinary(text)


def test_ascii_pattern_splits_short_ascii_strings_as_the_unicode_pattern():
    """Every string of up to 4 characters over letters of the contractions, a digit, the apostrophe, punctuation,
    and whitespace both patterns treat alike (space, \\t, \\n, \\r, \\v, \\f) and unlike ``re``'s \\s (\\x1c, \\x1f)."""
    alphabet = "adelrstv0'.-" + " \t\n\r\x0b\x0c\x1c\x1f"
    for length in range(5):
        for text in map("".join, product(alphabet, repeat=length)):
            assert GPT2_ASCII_SPLIT_REGEX.findall(text) == pretokens(text), repr(text)


@SETTINGS
@given(st.one_of(st.text(), st.text("'sdmtlvreSDMTLVRE \n\t", max_size=30)))
def test_our_pattern_splits_as_openai_gpt2_spells_it(text):
    assert pretokens(text) == regex.findall(OPENAI_GPT2_PATTERN, text)


@SETTINGS
@given(st.text(st.characters(max_codepoint=127), max_size=60))
def test_ascii_pattern_splits_any_ascii_text_as_the_unicode_pattern(text):
    assert split_pretokens(text) == GPT2_ASCII_SPLIT_REGEX.findall(text) == pretokens(text)


@pytest.mark.parametrize("text,boundary", [("a  b", 1), ("a b", 1), ("ab", 0), (" ab", 0), ("a \n b", 1),
                                           ("a\n  b", 0), ("x. y  ", 4), ("\u3000 a", 0)])
def test_last_space_boundary_is_the_last_space_after_non_whitespace(text, boundary):
    """The streaming encoder holds back text from there: the last space that follows a non-whitespace character."""
    assert last_space_boundary(text) == boundary


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=300), st.randoms(use_true_random=False))
def test_heap_merging_equals_scan_merging(symbols, rng):
    pairs = [(a, b) for a in range(4) for b in range(4)]
    rng.shuffle(pairs)
    ranks, next_id = {}, 4
    for rank, pair in enumerate(pairs[:10]):
        ranks[pair] = (rank, next_id)
        for other in range(4):  # merged tokens merge further, in later ranks
            ranks.setdefault((next_id, other), (100 + rank * 4 + other, 1000 + next_id * 4 + other))
        next_id += 1
    assert merge_with_heap(list(symbols), ranks) == merge_by_scan(list(symbols), ranks)


BASE64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


@pytest.mark.parametrize("text", ["x" * 30_000, "ab" * 10_000, "".join(random.Random(11).choices("acgt", k=20_000)),
                                  "".join(random.Random(12).choices(BASE64, k=8000))])
def test_long_pieces_encode_like_tiktoken_with_gpt2_merges(gpt2, tik, text):
    """Pieces from LONG_PIECE_MIN_BYTES (made tiny here) go through ``long_merge.py``'s rank rounds."""
    assert _is_monotone(merge_table(gpt2.merges, gpt2._bytes_to_id))
    with mock.patch("scratchlm.tokenizer.fast.cached_bpe.LONG_PIECE_MIN_BYTES", 2):
        gpt2.clear_cache()
        assert gpt2.encode(text) == tik.encode_ordinary(text)
        assert gpt2.encode(" " + text) == tik.encode_ordinary(" " + text)  # a long word after a space


def test_cold_cache_batch_learning_matches_tiktoken(gpt2, tik, monkeypatch):
    """A long text with an empty cache goes through ``learn_words`` (batch BPE of its new words) first."""
    text = require_shared("fixtures/corpus.en").read_text(encoding="utf-8")
    learned = []
    learn = gpt2._bpe.learn_words
    monkeypatch.setattr(gpt2._bpe, "learn_words", lambda words: (learned.append(len(words)), learn(words)))
    gpt2.clear_cache()
    assert gpt2.encode(text) == tik.encode(text, allowed_special="all")
    assert learned and learned[0] > 1000


@pytest.mark.parametrize("collector_on", [True, False])
def test_learning_words_leaves_the_garbage_collector_as_it_found_it(gpt2, collector_on):
    """``learn_words`` pauses the cyclic GC; afterwards (even after an error) it is on again only if it was on."""
    was_on = gc.isenabled()
    try:
        gc.enable() if collector_on else gc.disable()
        gpt2.clear_cache()
        gpt2._bpe.learn_words({"alpha", "beta,", "(gamma)"})
        assert gc.isenabled() == collector_on
        with pytest.raises(UnicodeEncodeError):
            gpt2._bpe.learn_words({"lone\ud800surrogate"})
        assert gc.isenabled() == collector_on
    finally:
        gc.enable() if was_on else gc.disable()


@SETTINGS
@given(st.lists(st.text(st.characters(blacklist_characters=" ", blacklist_categories=("Cs",)), min_size=1,
                        max_size=12), max_size=40))
def test_words_learned_together_encode_as_each_alone(gpt2, tik, words):
    """Any words (Unicode whitespace, marks, digits, punctuation; no spaces) learned in one batch get the ids of
    " " + word; the ones ending in whitespace (regex ``\\s``) are not complete chunks and are not learned."""
    gpt2.clear_cache()
    gpt2._bpe.learn_words(set(words))
    complete = {word for word in words if not regex.fullmatch(r"\s", word[-1])}
    assert set(gpt2._bpe.word_cache) == complete
    for word in complete:
        assert list(gpt2._bpe.word_cache[word]) == tik.encode_ordinary(" " + word)


def test_small_caches_give_the_same_ids(gpt2, tik):
    """Caches that overflow (and are cleared) while a block is learned must not change any id."""
    text = require_shared("fixtures/corpus.en").read_text(encoding="utf-8")
    small = Tokenizer(gpt2.vocab, gpt2.merges, [EOT], cache_size=300)
    assert small.encode(text) == tik.encode(text, allowed_special="all")
    assert all(ids is not None for ids in small._bpe.word_cache.values())


def _random_merge_table(rng: random.Random, symbols: int) -> dict[tuple[int, int], tuple[int, int]]:
    """Merges over byte values 0..symbols-1 and their results, with distinct ranks in a random order."""
    pairs = [(a, b) for a in range(symbols) for b in range(symbols)]
    rng.shuffle(pairs)
    merged = {pair: 256 + index for index, pair in enumerate(pairs[:10])}
    pairs += [pair for new_id in merged.values() for other in range(symbols)
              for pair in ((new_id, other), (other, new_id))]
    pairs += [(a, b) for a in merged.values() for b in merged.values()]
    ranks = rng.sample(range(10 * len(pairs)), len(pairs))
    return {pair: (rank, merged.get(pair, 1000 + index)) for index, (pair, rank) in enumerate(zip(pairs, ranks))}


def _batch_merge(merger: BatchMerger, pieces: list[bytes]) -> list[list[int]]:
    ids, counts = merger.merge(b"".join(pieces), np.array([len(piece) for piece in pieces], dtype=np.int64))
    assert counts.sum() == ids.size
    flat = ids.tolist()
    ends = np.cumsum(counts).tolist()
    return [flat[end - count:end] for count, end in zip(counts.tolist(), ends)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), max_size=30), st.randoms(use_true_random=False))
def test_batch_merging_equals_scan_merging(pieces, rng):
    """Pieces of any lengths in any order (they are merged longest first, and must come back in order)."""
    table = _random_merge_table(rng, 4)
    merger = BatchMerger(table, list(range(256)))
    assert _batch_merge(merger, [bytes(piece) for piece in pieces]) == [merge_by_scan(list(p), table) for p in pieces]


def test_batch_merging_gpt2_pretokens_equals_scan_merging(gpt2):
    """Real merges on real pre-tokens, a few thousand at once: the pair table's probing and the long tail."""
    text = require_shared("fixtures/corpus.en").read_text(encoding="utf-8")
    pieces = sorted({piece.encode("utf-8") for piece in split_pretokens(text)})
    pieces += [b"x" * 300, "\u00e9t\u00e9 ".encode() * 9]  # long pieces: hundreds of rounds, and repeated pairs
    bpe = gpt2._bpe
    expected = [merge_by_scan([bpe._byte_ids[byte] for byte in piece], bpe._merge_ranks) for piece in pieces]
    assert _batch_merge(bpe._batch_merger(), pieces) == expected


def test_batch_merging_refuses_empty_pieces():
    with pytest.raises(ValueError, match="empty piece"):
        BatchMerger({}, list(range(256))).merge(b"a", np.array([1, 0]))


def test_decode_replaces_malformed_utf8_and_names_bad_ids(gpt2):
    emoji = gpt2.encode("😀")
    assert len(emoji) > 1  # a 4-byte character split across tokens
    assert gpt2.decode(emoji[:1]) == "\ufffd"
    assert gpt2.decode_bytes(emoji[:1]) == gpt2.vocab[emoji[0]]
    with pytest.raises(ValueError, match=r"id 50257 at position 2"):
        gpt2.decode([1, 2, 50257])
    with pytest.raises(ValueError, match=r"id -1 at position 0"):
        gpt2.decode([-1])
    assert gpt2.decode(iter(gpt2.encode("generator input"))) == "generator input"


def test_lone_surrogates_are_refused_with_position(gpt2):
    with pytest.raises(ValueError, match=r"position 6 is a lone surrogate"):
        gpt2.encode("hello \ud800 world")
    with pytest.raises(ValueError, match=r"position 6 is a lone surrogate"):
        list(gpt2.encode_iterable(["hel", "lo \ud83d!"]))
    with pytest.raises(ValueError, match=r"position 300003 is a lone surrogate"):
        list(gpt2.encode_iterable(["abc " * 75_000, "xyz\udfff"]))
    # the same inside a long block of new words, which the batch path learns together
    words = " ".join(f"w{index}x" for index in range(5000))
    gpt2.clear_cache()
    with pytest.raises(ValueError, match=rf"position {len(words) + 4} is a lone surrogate"):
        gpt2.encode(words + " ok \udc80 " + words)


def test_save_load_round_trips_both_formats(gpt2, tmp_path):
    tokenizer = Tokenizer(gpt2.vocab, gpt2.merges, [EOT, "<|pad|>"])
    tokenizer.save(tmp_path)
    loaded = Tokenizer.load(tmp_path)
    assert (loaded.vocab, loaded.merges, loaded.special_tokens) == (tokenizer.vocab, tokenizer.merges,
                                                                       tokenizer.special_tokens)
    assert loaded.hash == tokenizer.hash
    for name in ("scratchlm-tokenizer.json", "tokenizer.json"):  # ours, and Hugging Face's
        assert Tokenizer.from_files(tmp_path / name).hash == tokenizer.hash
    from_gpt2 = Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt", [EOT, "<|pad|>"])
    assert from_gpt2.hash == tokenizer.hash
    (tmp_path / "scratchlm-tokenizer.json").unlink()
    assert Tokenizer.load(tmp_path).hash == tokenizer.hash  # Hugging Face's tokenizer.json next
    (tmp_path / "tokenizer.json").unlink()
    assert Tokenizer.load(tmp_path).vocab == tokenizer.vocab  # GPT-2 files alone; no special-token list


def test_version_1_tokenizer_files_still_load(tmp_path):
    vocab = {i: bytes([i]) for i in range(256)} | {256: b"ab", 257: b"abc", 300: b"\x00\xff"}
    merges = [(b"a", b"b"), (b"ab", b"c"), (b"\x00", b"\xff")]
    version_1 = {"format_version": 1, "vocab": {str(i): token.hex() for i, token in vocab.items()},
                 "merges": [[left.hex(), right.hex()] for left, right in merges], "special_tokens": [EOT]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(version_1), encoding="utf-8")  # the name it had then
    loaded = Tokenizer.load(tmp_path)
    assert (loaded.vocab, loaded.merges, loaded.special_tokens) == ({**vocab, 301: EOT.encode()}, merges, [EOT])
    loaded.save(tmp_path)  # rewritten as version 2, with null for the unused ids 258..299
    assert json.loads((tmp_path / "scratchlm-tokenizer.json").read_text())["vocab"][258:300] == [None] * 42
    assert Tokenizer.load(tmp_path).hash == loaded.hash


def test_gpt2_format_round_trips_every_byte(tmp_path):
    vocab = {i: bytes([i]) for i in range(256)}
    merges = [(b" ", b"\n"), (b"\xff", b"\x00"), (b" \n", b"\xff\x00")]
    for left, right in merges:
        vocab[len(vocab)] = left + right
    Tokenizer(vocab, merges, ["<|end of text|>"]).save(tmp_path)
    loaded = Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert loaded.vocab == {**vocab, 259: b"<|end of text|>"}
    assert loaded.merges == merges


def test_hash_depends_on_special_tokens(gpt2):
    assert len(gpt2.hash) == 64
    assert Tokenizer(gpt2.vocab, gpt2.merges, [EOT]).hash == gpt2.hash
    assert Tokenizer(gpt2.vocab, gpt2.merges, []).hash != gpt2.hash


SCRATCHLM_FILE = "scratchlm-tokenizer.json"


@pytest.mark.parametrize("name, content, message", [
    (SCRATCHLM_FILE, '{"format_version": 99, "vocab": {}, "merges": [], "special_tokens": []}',
     "unsupported tokenizer format_version 99"),
    ("tokenizer.json", '{"format_version": 99, "vocab": {}, "merges": [], "special_tokens": []}',
     "tokenizer.json: unsupported tokenizer format_version 99"),  # ours, under the name it had before
    (SCRATCHLM_FILE, '{"format_version": 1,\n "vocab": {"0": "zz"}, "merges": [], "special_tokens": []}',
     "vocab entry '0'"),
    (SCRATCHLM_FILE, '{"format_version": 1,\n "vocab": {\n', "scratchlm-tokenizer.json:3: malformed JSON"),
    ("tokenizer.json", '{"format_version": 1,\n "vocab": {\n', "tokenizer.json:3: malformed JSON"),
    (SCRATCHLM_FILE, '{"format_version": 1, "vocab": {}, "merges": [["00"]], "special_tokens": []}',
     "merge #0"),
    (SCRATCHLM_FILE, '[1, 2]', "expected a JSON object"),
    (SCRATCHLM_FILE, '{"format_version": 2, "vocab": {}, "merges": [], "special_tokens": []}',
     "key 'vocab' is missing or not a JSON list"),
    (SCRATCHLM_FILE, '{"format_version": 2, "vocab": ["61", "zz"], "merges": [], "special_tokens": []}',
     "vocab entry for id 1: 'zz'"),
    (SCRATCHLM_FILE, '{"format_version": 2, "vocab": ["61", "62"], "merges": [0, 1, 0], "special_tokens": []}',
     "two ids per merge, got an odd count"),
    (SCRATCHLM_FILE, '{"format_version": 2, "vocab": ["61", null], "merges": [0, 0, 0, 1], "special_tokens": []}',
     r"merge #1 \[0, 1\] is not a pair of ids in the vocab"),
    (SCRATCHLM_FILE, '{"format_version": 2, "vocab": ["61", "62"], "merges": [0, 1.0], "special_tokens": []}',
     r"merge #0 \[0, 1.0\]"),
    (SCRATCHLM_FILE, '{"format_version": 2, "vocab": ["61"], "merges": [], "special_tokens": ["a"], '
                     '"added_token_flags": {"a": {"special": 0, "normalized": true}}}',
     "added_token_flags of 'a' is"),
    (SCRATCHLM_FILE, '{"format_version": 2, "vocab": ["61"], "merges": [], "special_tokens": [], '
                     '"added_token_flags": {"a": {"special": false, "normalized": true}}}',
     "added-token flags given for 'a', which is not a special token"),
])
def test_malformed_scratchlm_files_are_refused(tmp_path, name, content, message):
    (tmp_path / name).write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        Tokenizer.load(tmp_path)


@pytest.mark.parametrize("vocab_text, merges_text, message", [
    ('{"a": 0, "b": "1"}', "", r"token 'b' has id '1'"),
    ('{"a": 0, "b": 0}', "", "id 0 is given to both"),
    ('{"a": 0, "\u2603": 1}', "", "not in GPT-2's byte table"),
    ('{"a": 0}', "#version: 0.2\na b\nab c d\n", r"merges.txt:3: expected two tokens"),
    ('{"a": 0}', "#version: 0.2\n\u2603 b\n", r"merges.txt:2: character"),
])
def test_malformed_gpt2_files_are_refused(tmp_path, vocab_text, merges_text, message):
    (tmp_path / "vocab.json").write_text(vocab_text, encoding="utf-8")
    (tmp_path / "merges.txt").write_text(merges_text, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt")


def test_plain_text_never_gets_a_special_id_when_a_merge_shares_its_bytes():
    vocab = {i: bytes([i]) for i in range(256)} | {256: b"ab", 257: b"ab"}  # 256: the special, 257: the merge
    tokenizer = Tokenizer(vocab, [(b"a", b"b")], ["ab"])
    assert tokenizer.special_id("ab") == 256
    assert tokenizer.encode_ordinary("ab") == [257] and tokenizer.encode("xab") == [ord("x"), 256]


def test_save_skips_the_gpt2_pair_when_ids_share_bytes(tmp_path):
    vocab = {i: bytes([i]) for i in range(256)} | {256: b"|", 257: b"ab"}
    tokenizer = Tokenizer(vocab, [(b"a", b"b")], ["|"])
    for stale in ("vocab.json", "tokenizer.json"):  # GPT-2 and Hugging Face files of an earlier save are removed
        (tmp_path / stale).write_text("{}")
    with pytest.warns(UserWarning) as warned:
        tokenizer.save(tmp_path)
    assert [str(w.message).split(": ", 1)[1] for w in warned] == [
        "no tokenizer.json + tokenizer_config.json written: Hugging Face's tokenizer.json cannot hold two ids with "
        "the same bytes (scratchlm-tokenizer.json holds the whole tokenizer)",
        "no vocab.json + merges.txt written: GPT-2's format cannot hold two ids with the same bytes "
        "(scratchlm-tokenizer.json holds the whole tokenizer)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scratchlm-tokenizer.json"]
    loaded = Tokenizer.load(tmp_path)
    assert (loaded.vocab, loaded.special_id("|"), loaded.encode_ordinary("|")) == (vocab, 256, [ord("|")])


def test_a_failed_gpt2_write_leaves_a_folder_that_loads_whole(tmp_path, gpt2):
    (tmp_path / "vocab.json.tmp").mkdir()  # makes the GPT-2 vocab write fail
    with pytest.raises(IsADirectoryError):
        Tokenizer(gpt2.vocab, gpt2.merges, [EOT]).save(tmp_path)
    assert Tokenizer.load(tmp_path).special_tokens == [EOT]


def test_bad_vocab_ids_text_types_and_versions_are_refused(tmp_path):
    byte_vocab = {i: bytes([i]) for i in range(256)}
    with pytest.raises(ValueError, match="vocab ids must be non-negative integers, got -1"):
        Tokenizer({**byte_vocab, -1: b"zz"}, [])
    with pytest.raises(TypeError, match="text to encode must be a str, got bytes"):
        Tokenizer(byte_vocab, []).encode(b"abc")
    for version in ("true", "2.0"):
        (tmp_path / "tokenizer.json").write_text(
            f'{{"format_version": {version}, "vocab": [], "merges": [], "special_tokens": []}}')
        with pytest.raises(ValueError, match=f"unsupported tokenizer format_version {version.title()}"):
            Tokenizer.load(tmp_path)
    # A file that parses but describes no valid tokenizer: the error names the file.
    (tmp_path / "tokenizer.json").write_text(json.dumps(
        {"format_version": 2, "vocab": [bytes([i]).hex() for i in range(256)] + ["6162"], "merges": [97, 99],
         "special_tokens": []}))
    with pytest.raises(ValueError, match=r"tokenizer\.json: merge #0 \(b'a', b'c'\) uses or makes b'ac'"):
        Tokenizer.from_files(tmp_path / "tokenizer.json")


def test_inconsistent_vocab_and_merges_are_refused():
    vocab = {i: bytes([i]) for i in range(256)}
    with pytest.raises(ValueError, match=r"merge #0 \(b'a', b'b'\) uses or makes b'ab'"):
        Tokenizer(vocab, [(b"a", b"b")])
    with pytest.raises(ValueError, match="lacks 1 of the 256 single-byte tokens"):
        Tokenizer({i: bytes([i]) for i in range(255)}, [])
    with pytest.raises(ValueError, match="given more than once"):
        Tokenizer(vocab, [], ["<s>", "<s>"])
    with pytest.raises(ValueError, match="empty"):
        Tokenizer(vocab, [], [""])


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.load(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        Tokenizer.load(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file; expected the directory"):
        Tokenizer.load(tmp_path / "file")
    with pytest.raises(FileNotFoundError, match="vocab.json does not exist"):
        Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
