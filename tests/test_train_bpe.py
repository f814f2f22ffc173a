"""BPE training: the fast trainer equals the slow reference on random, adversarial and real corpora.

Also: chunked and multi-process counting equal counting the whole text, the tie rule, the vocab layout,
clear errors for bad input, and the ``scratchlm tokenizer train`` command.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import require_shared
from scratchlm.cli import main
from scratchlm.tokenizer import counting
from scratchlm.tokenizer.bpe import (
    reference_encode,
    reference_pretoken_counts,
    reference_train_bpe,
    reference_train_from_counts,
)
from scratchlm.tokenizer.counting import count_pretokens, plan_chunks, word_aligned_parts
from scratchlm.tokenizer.pretokenize import pretokens
from scratchlm.tokenizer.train_bpe import _descending_key, train_bpe, train_bpe_from_counts

EOT = "<|endoftext|>"
ALPHABETS = ["ab", "abc ", "aab \n", "ab\r\n \t", "é字😀\u0301a ", "xy'sé\n  1."]
SPECIALS = [EOT, "<|a|>", "<|a|><|b|>", "ab", "é"]
ADVERSARIAL = {
    "repeated": "a" * 1000,
    "repeated-words": "aaaa aaa aa a " * 50,
    "ties": "ab ba cd dc ef fe " * 3,
    "unicode": "héllo 世界 😀😀 e\u0301 naïve 한국어 " * 20,
    "crlf": "line one\r\nline two\r\n\r\n  \r\n" * 20,
    "whitespace": "x" + " " * 200 + "y\n\n\n\t\t  z" + "\n" * 50,
    "adjacent-specials": f"{EOT}{EOT}a{EOT}b {EOT}<|a|><|a|><|b|><|a|>c<|a|><|b|>" * 10,
    "contractions": "don't won't I'll we've they're it's 's 'll " * 20,
    "digits": "123 4567 89 2024-11-29 3.14159 " * 20,
}
quick = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def corpora(draw) -> tuple[str, list[str]]:
    """Random text from a small or wide alphabet, with special tokens scattered through it."""
    alphabet = draw(st.sampled_from(ALPHABETS + [None]))
    texts = st.text(max_size=40) if alphabet is None else st.text(alphabet=alphabet, max_size=40)
    specials = draw(st.lists(st.sampled_from(SPECIALS), unique=True, max_size=3))
    pieces = st.one_of(texts, st.sampled_from(specials)) if specials else texts
    return "".join(draw(st.lists(pieces, max_size=12))), specials


def write(tmp_path: Path, text: str, name: str = "corpus.txt") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return path


# --- fast == reference --------------------------------------------------------------------------------------


@quick
@given(corpus=corpora(), extra=st.integers(0, 80))
def test_fast_equals_reference_on_random_corpora(corpus, extra):
    text, specials = corpus
    counts = reference_pretoken_counts(text, specials)
    vocab_size = 256 + len(specials) + extra
    assert train_bpe_from_counts(counts, vocab_size, specials) == reference_train_from_counts(
        counts, vocab_size, specials)


@quick
@given(words=st.dictionaries(st.text(alphabet="abc", min_size=1, max_size=8), st.integers(1, 5), max_size=12))
def test_fast_equals_reference_on_dense_ties(words):
    """Tiny alphabets and small counts: nearly every merge is decided by the tie rule."""
    counts = Counter(words)
    assert train_bpe_from_counts(counts, 300, []) == reference_train_from_counts(counts, 300, [])


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_fast_equals_reference_on_adversarial_corpora(tmp_path, name):
    path = write(tmp_path, ADVERSARIAL[name])
    specials = [EOT, "<|a|>", "<|a|><|b|>"]
    assert train_bpe(path, 400, specials) == reference_train_bpe(path, 400, specials)


def test_tie_goes_to_the_greater_byte_pair():
    # ("b", "c") and ("a", "b") both occur twice; ("b", "c") is the greater pair, so it is merged first.
    assert train_bpe_from_counts(Counter({"abc": 2}), 257, [])[1] == [(b"b", b"c")]
    # After "bc" exists, ("a", "bc") and ("a", "b") tie at 2: b"bc" > b"b" (a prefix is the smaller string).
    merges = train_bpe_from_counts(Counter({"bc": 10, "abc": 2, "ab": 2}), 259, [])[1]
    assert merges == [(b"b", b"c"), (b"a", b"bc"), (b"a", b"b")]


@quick
@given(x=st.binary(max_size=6), y=st.binary(max_size=6))
def test_heap_key_reverses_the_byte_order(x, y):
    assert (_descending_key(x) < _descending_key(y)) == (x > y)


def test_vocab_layout_bytes_then_specials_then_merges():
    vocab, merges = train_bpe_from_counts(Counter({"hello": 3, "help": 2}), 262, [EOT, "<|pad|>"])
    assert [vocab[i] for i in range(256)] == [bytes([i]) for i in range(256)]
    assert vocab[256] == EOT.encode() and vocab[257] == b"<|pad|>"
    assert [vocab[258 + k] for k in range(len(merges))] == [a + b for a, b in merges]
    assert len(vocab) == 262


def test_stops_early_when_no_pair_is_left():
    vocab, merges = train_bpe_from_counts(Counter({"ab": 5}), 10_000, [])
    assert merges == [(b"a", b"b")] and len(vocab) == 257


# --- counting: chunks and processes change nothing ---------------------------------------------------------


@quick
@given(corpus=corpora(), repeats=st.integers(1, 30), chunk_bytes=st.integers(1, 64))
def test_chunked_counting_equals_whole_text_counting(tmp_path_factory, corpus, repeats, chunk_bytes):
    text, specials = corpus
    text = (text + "x.\n") * repeats  # gives the boundary search newline cut points as well as specials
    path = write(tmp_path_factory.mktemp("chunks"), text)
    counted = count_pretokens([path], specials, num_workers=1, chunk_bytes=chunk_bytes, parallel_threshold=0)
    assert counted == reference_pretoken_counts(text, specials)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", " ", "  ", "\n", "\t", ".", "'s", "1", "é", "日", "\u00a0", "\x1f"]),
                max_size=100).map("".join), st.integers(1, 12))
def test_word_aligned_parts_keep_the_pretokens_of_the_whole(text, size):
    parts = list(word_aligned_parts(text, size))
    assert "".join(parts) == text
    assert [t for part in parts for t in pretokens(part)] == pretokens(text)


def test_chunks_cover_the_file_and_never_split_a_special(tmp_path):
    text = ("ab<|a|><|b|>\n" * 50) + ("x\n" * 50)
    path = write(tmp_path, text)
    chunks = plan_chunks(path, ["<|a|>", "<|a|><|b|>"], chunk_bytes=7)
    assert chunks[0].start == 0 and chunks[-1].end == len(text.encode())
    assert all(left.end == right.start for left, right in zip(chunks, chunks[1:]))
    assert len(chunks) > 50
    data = text.encode()
    assert all(not data[c.start:].startswith(b"<|b|>") for c in chunks)


def test_multiprocess_counting_equals_in_process(tmp_path):
    text = "".join(ADVERSARIAL.values()) * 3
    path = write(tmp_path, text)
    specials = [EOT, "<|a|>", "<|a|><|b|>"]
    forked = count_pretokens([path], specials, num_workers=2, chunk_bytes=512, parallel_threshold=0)
    assert forked == count_pretokens([path], specials, num_workers=1)
    assert forked == reference_pretoken_counts(text, specials)


@pytest.mark.parametrize("small_part_chars", [4, 64])
def test_non_ascii_parts_counted_in_small_pieces_equal_the_reference(tmp_path, monkeypatch, small_part_chars):
    # Non-ASCII parts are pre-tokenized in small word-aligned pieces (the ASCII ones by the ASCII pattern).
    monkeypatch.setattr(counting, "SMALL_PART_CHARS", small_part_chars)
    text = "".join(ADVERSARIAL.values()) * 3 + " naïve café, it's 12 o'clock.\n" * 40
    path = write(tmp_path, text)
    assert count_pretokens([path], [EOT], num_workers=1) == reference_pretoken_counts(text, [EOT])


def test_several_input_files_are_counted_together(tmp_path):
    first, second = write(tmp_path, "one two two", "a.txt"), write(tmp_path, " two three", "b.txt")
    assert train_bpe([first, second], 300, []) == train_bpe_from_counts(
        Counter({"one": 1, " two": 3, " three": 1}), 300, [])


# --- real data ---------------------------------------------------------------------------------------------


def test_tinystories_sample_equals_reference(tinystories_sample):
    vocab, merges = train_bpe(tinystories_sample, 1000, [EOT])
    assert (vocab, merges) == reference_train_bpe(tinystories_sample, 1000, [EOT])
    learned = [vocab[i] for i in range(257, len(vocab))]
    assert all(EOT.encode() not in token and b"<|" not in token for token in learned)
    text = tinystories_sample.read_text(encoding="utf-8")
    ids = reference_encode(text, vocab, merges, [EOT])
    assert b"".join(vocab[i] for i in ids) == text.encode()
    assert len(ids) < len(text.encode()) / 2  # the learned merges compress the text they were trained on


def test_cs336_corpus_en_merges_equal_reference():
    path = require_shared("fixtures/corpus.en")
    vocab, merges = train_bpe(path, 500, [EOT])
    reference_vocab, reference_merges = reference_train_bpe(path, 500, [EOT])
    assert merges == reference_merges
    assert set(vocab.values()) == set(reference_vocab.values()) and len(vocab) == 500


# --- bad input ---------------------------------------------------------------------------------------------


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        train_bpe(tmp_path / "missing.txt", 300, [])


def test_folder_without_inputs_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no input files"):
        train_bpe(tmp_path, 300, [])


@pytest.mark.parametrize("workers", [1, 2])
def test_invalid_utf8_names_file_and_offset(tmp_path, workers):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine text.\n" * 300 + b"caf\xe9 au lait\n" + b"more.\n" * 300)
    offset = len(b"fine text.\n" * 300) + 3
    with pytest.raises(ValueError, match=rf"bad\.txt: invalid UTF-8 at byte offset {offset} \(byte 0xe9"):
        count_pretokens([path], [], num_workers=workers, chunk_bytes=256, parallel_threshold=0)


def test_invalid_utf8_replace_policy_substitutes_replacement_character(tmp_path):
    path = tmp_path / "bad.txt"
    raw = b"caf\xe9 caf\xe9 ok\xff\n" * 10
    path.write_bytes(raw)
    counts = count_pretokens([path], [], errors="replace")
    assert counts == reference_pretoken_counts(raw.decode("utf-8", errors="replace"), [])
    assert sum(n for pretoken, n in counts.items() if "\ufffd" in pretoken) == 30


def test_unknown_error_policy_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="errors must be one of"):
        train_bpe(write(tmp_path, "x"), 300, [], errors="ignore")


def test_vocab_too_small_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"vocab_size 256 is too small.*= 257"):
        train_bpe(write(tmp_path, "abc"), 256, [EOT])


@pytest.mark.parametrize("specials, message", [([""], "empty"), ([EOT, EOT], "more than once")])
def test_bad_special_tokens_are_rejected(tmp_path, specials, message):
    with pytest.raises(ValueError, match=message):
        train_bpe(write(tmp_path, "abc"), 300, specials)


def test_empty_corpus_gives_bytes_and_specials_only(tmp_path):
    vocab, merges = train_bpe(write(tmp_path, ""), 1000, [EOT])
    assert merges == [] and len(vocab) == 257 and vocab[256] == EOT.encode()


def test_corpus_of_only_specials_gives_no_merges(tmp_path):
    assert train_bpe(write(tmp_path, EOT * 100), 1000, [EOT])[1] == []


# --- CLI ---------------------------------------------------------------------------------------------------


def test_cli_train_saves_the_trained_tokenizer(tmp_path, capsys):
    from scratchlm.tokenizer.tokenizer import Tokenizer

    corpus = write(tmp_path, ADVERSARIAL["unicode"] + EOT + ADVERSARIAL["contractions"])
    out = tmp_path / "tok"
    code = main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--special-token", EOT,
                 "--out", str(out), "--workers", "1"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "merges" in printed and "peak RSS" in printed and "longest tokens" in printed
    loaded = Tokenizer.load(out)
    vocab, merges = train_bpe(corpus, 300, [EOT])
    assert loaded.merges == merges and loaded.vocab == vocab


def test_cli_out_that_is_a_file_fails_before_training(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world")
    code = main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--out", str(corpus)])
    assert code == 1
    error = capsys.readouterr().err
    assert f"--out {corpus} is a file" in error and error.count("\n") == 1
    assert corpus.read_text() == "hello world"


def test_cli_reports_bad_input_in_one_line(tmp_path, capsys):
    code = main(["tokenizer", "train", "--input", str(tmp_path / "nope.txt"), "--vocab-size", "300",
                 "--out", str(tmp_path / "tok")])
    assert code == 1
    error = capsys.readouterr().err
    assert "nope.txt" in error and error.count("\n") == 1 and "Traceback" not in error
