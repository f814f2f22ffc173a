"""`data encode`: parallel chunked encoding equals whole-file encoding, bad UTF-8 is located, failures leave no
complete-looking output, and the CLI reports compression."""

from __future__ import annotations

import json
import re

import pytest

from conftest import gpt2_tokenizer, require_shared
from scratchlm.cli import main
from scratchlm.data import encode as encode_module
from scratchlm.data.encode import SAMPLE_CHARS, _first_texts, _plan_ranges, encode_corpus
from scratchlm.data.sources import expand_inputs
from scratchlm.data.token_file import open_token_file
from scratchlm.tokenizer import Tokenizer
from scratchlm.tokenizer.fast.tiktoken_engine import TiktokenBPE

EOT = "<|endoftext|>"
# Whitespace runs that span lines, \r\n, specials next to text, emoji and CJK around the newlines chunks cut at.
TRICKY = ("Hi  \n\n  there\r\n\r\nx\ny 😀\n日本\n" + EOT + "\nOnce\n\n\n   \n" + EOT + EOT + "a'\nll\n!\n?\n") * 40


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return gpt2_tokenizer().save(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return Tokenizer.load(tokenizer_dir)


@pytest.fixture
def corpus(tmp_path):
    story = require_shared("fixtures/corpus.en").read_text(encoding="utf-8")
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_bytes((story[:40_000] + TRICKY).encode())
    second.write_bytes((TRICKY + story[40_000:80_000]).encode())
    return [first, second]


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(encode_module, "MIN_CHUNK_BYTES", 1000)
    monkeypatch.setattr(encode_module, "CHUNKS_PER_WORKER", 20)


def _expected_ids(tokenizer, paths):
    """Each file's ids, then <|endoftext|> unless the file already ends with it."""
    ids = []
    for path in paths:
        text = path.read_bytes().decode("utf-8")
        ids += tokenizer.encode(text) + ([] if text.endswith(EOT) or not text else [tokenizer.special_id(EOT)])
    return ids


def test_one_and_two_workers_give_identical_files_equal_to_encode(tokenizer, tokenizer_dir, corpus, tmp_path,
                                                                 small_chunks):
    assert len(_plan_ranges(corpus, tokenizer, workers=2)) > 20  # many cuts, some inside TRICKY
    one = encode_corpus(tokenizer_dir, corpus, tmp_path / "one.tok", workers=1)
    two = encode_corpus(tokenizer, corpus, tmp_path / "two.tok", workers=2)
    assert (tmp_path / "one.tok").read_bytes() == (tmp_path / "two.tok").read_bytes()
    opened = open_token_file(tmp_path / "two.tok", vocab_size=tokenizer.vocab_size, tokenizer_hash=tokenizer.hash)
    assert opened.tokens.tolist() == _expected_ids(tokenizer, corpus)
    assert one.num_tokens == two.num_tokens == opened.num_tokens
    assert two.input_bytes == sum(p.stat().st_size for p in corpus)
    assert 3 < two.bytes_per_token < 5 and two.workers == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "one.tok", "two.tok"]


def test_ranges_shrink_towards_the_end_so_workers_finish_together(tokenizer, tmp_path, small_chunks):
    path = tmp_path / "lines.txt"
    path.write_text("a line of text\n" * 20_000, encoding="utf-8")
    sizes = [end - start for _, start, end in _plan_ranges([path], tokenizer, workers=2)]
    assert sizes[0] > 4 * sizes[-2] and sorted(sizes[:-1], reverse=True) == sizes[:-1]


def test_paragraph_breaks_are_safe_cuts(tokenizer, tmp_path, small_chunks):
    # Only paragraph breaks X"\n\n"Y can be cut here; the other separators must never be cut inside.
    separators = [".\n\nThe", "!\n\n\nA", " \n\nB", "c\n\n C", "d\n\n\tD", "e\n\n\r\nE", "f\r\n\r\nF"]
    text = "".join(f"word{i} " * 40 + separators[i % len(separators)] for i in range(400))
    path = tmp_path / "paragraphs.txt"
    path.write_text(text, encoding="utf-8", newline="")
    ranges = _plan_ranges([path], tokenizer, workers=2)
    assert len(ranges) > 10
    data = path.read_bytes()
    # Every cut falls between the two newlines of printable + "\n\n" + printable (the ".\n\nThe" separator).
    assert {data[end - 2:end + 2] for _, _, end in ranges[:-1]} == {b".\n\nT"}
    encode_corpus(tokenizer, [path], tmp_path / "o.tok", workers=2)
    assert open_token_file(tmp_path / "o.tok").tokens.tolist() == _expected_ids(tokenizer, [path])


def test_no_paragraph_cut_before_a_special_token(tokenizer, tmp_path, small_chunks):
    # The ordinary piece before EOT ends in "\n\n", one pre-token; cut between the newlines it would be two.
    path = tmp_path / "documents.txt"
    path.write_text(("The quick brown fox jumps over the lazy dog. " * 40 + "The end.\n\n" + EOT) * 100,
                    encoding="utf-8")
    encode_corpus(tokenizer, [path], tmp_path / "o.tok", workers=2)
    assert open_token_file(tmp_path / "o.tok").tokens.tolist() == _expected_ids(tokenizer, [path])


def test_file_without_safe_cuts_is_one_chunk(tokenizer, tmp_path, small_chunks):
    path = tmp_path / "line.txt"
    path.write_text("word  " * 3000 + "\n\n  \n" * 2000, encoding="utf-8")
    assert len(_plan_ranges([path], tokenizer, workers=2)) == 1
    encode_corpus(tokenizer, [path], tmp_path / "o.tok", workers=2)
    assert open_token_file(tmp_path / "o.tok").tokens.tolist() == _expected_ids(tokenizer, [path])


@pytest.mark.parametrize("workers", [1, 2])
def test_invalid_utf8_is_located_and_leaves_no_output(tokenizer, corpus, tmp_path, small_chunks, monkeypatch,
                                                      workers):
    monkeypatch.setattr(encode_module, "READ_BLOCK", 7)  # blocks cut multi-byte characters (in-process runs)
    data = corpus[1].read_bytes()
    offset = len(data) - 5000
    corpus[1].write_bytes(data[:offset] + b"\xe2\x28\xa1" + data[offset:])
    with pytest.raises(ValueError, match=rf"b\.txt: invalid UTF-8 at byte offset {offset} .*--errors replace"):
        encode_corpus(tokenizer, corpus, tmp_path / "out.tok", workers=workers)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]


def test_replace_policy_matches_python_decode(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(encode_module, "READ_BLOCK", 5)
    path = tmp_path / "bad.txt"
    raw = "héllo wörld 😀 ".encode() * 3 + b"\xff\xfe ok \xf0\x9f\x98 cut\n\xc3"
    path.write_bytes(raw)
    encode_corpus(tokenizer, [path], tmp_path / "o.tok", workers=1, errors="replace", end_of_text=False)
    expected = tokenizer.encode(raw.decode("utf-8", errors="replace"))
    assert open_token_file(tmp_path / "o.tok").tokens.tolist() == expected


def test_interrupted_encode_keeps_previous_output_and_leaves_nothing(tokenizer, corpus, tmp_path, monkeypatch):
    out = tmp_path / "out.tok"
    encode_corpus(tokenizer, corpus[:1], out, workers=1)
    before = out.read_bytes()

    def interrupted_stream(self, chunks, **kwargs):
        yield self.encode(next(iter(chunks)))
        raise KeyboardInterrupt

    monkeypatch.setattr(Tokenizer, "encode_stream", interrupted_stream)
    with pytest.raises(KeyboardInterrupt):
        encode_corpus(tokenizer, corpus, out, workers=1)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "out.tok"]


def test_cli_encodes_and_reports(tokenizer_dir, corpus, tmp_path, capsys):
    out = tmp_path / "cli.tok"
    argv = ["data", "encode", "--tokenizer", str(tokenizer_dir), "--input", *map(str, corpus), "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "bytes/token" in printed and "MB/s" in printed and str(out) in printed
    assert open_token_file(out).num_tokens > 0
    assert main([*argv, "--quiet", "--workers", "1"]) == 0
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("change, message", [
    (lambda argv, d: argv.__setitem__(5, str(d / "missing.txt")), "missing.txt does not exist"),
    (lambda argv, d: argv.__setitem__(3, str(d)), "holds no tokenizer"),
    (lambda argv, d: argv.__setitem__(7, str(d / "no" / "o.tok")), "folder .* does not exist"),
    (lambda argv, d: argv.__setitem__(7, str(d)), "it is a folder"),
])
def test_cli_bad_input_is_one_clear_line(tokenizer_dir, corpus, tmp_path, capsys, change, message):
    argv = ["data", "encode", "--tokenizer", str(tokenizer_dir), "--input", str(corpus[0]), "--out",
            str(tmp_path / "o.tok"), "--quiet"]
    change(argv, tmp_path)
    assert main(argv) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "error:" in error
    assert re.search(message, error)


def test_cli_rejects_bad_flags(tokenizer_dir, corpus, tmp_path):
    for extra in (["--workers", "0"], ["--errors", "ignore"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["data", "encode", "--tokenizer", str(tokenizer_dir), "--input", str(corpus[0]), "--out",
                  str(tmp_path / "o.tok"), *extra])
        assert exit_info.value.code == 2


# ---------------------------------------------------------------------------------------------- --engine tiktoken
@pytest.mark.parametrize("workers", [1, 2])
def test_the_tiktoken_engine_writes_the_same_file(tokenizer, corpus, tmp_path, small_chunks, workers):
    encode_corpus(tokenizer, corpus, tmp_path / "ours.tok", workers=workers)
    encode_corpus(tokenizer, corpus, tmp_path / "tiktoken.tok", workers=workers, engine="tiktoken")
    assert (tmp_path / "tiktoken.tok").read_bytes() == (tmp_path / "ours.tok").read_bytes()
    assert open_token_file(tmp_path / "ours.tok").tokens.tolist() == _expected_ids(tokenizer, corpus)


def test_the_tiktoken_engine_writes_the_same_files_from_documents(tokenizer, corpus, tmp_path):
    """The document path, with a validation split: JSON lines whose texts hold special tokens, emoji, CJK."""
    documents = tmp_path / "documents.jsonl"
    text = corpus[0].read_text(encoding="utf-8")
    documents.write_text("".join(json.dumps({"text": text[start:start + 997]}) + "\n"
                                 for start in range(0, len(text), 997)), encoding="utf-8")
    for engine in ("scratchlm", "tiktoken"):
        encode_corpus(tokenizer, [documents], tmp_path / f"{engine}.tok", workers=2, val_out=tmp_path / f"{engine}.val",
                      val_fraction=0.2, engine=engine)
    for suffix in ("tok", "val"):
        assert (tmp_path / f"tiktoken.{suffix}").read_bytes() == (tmp_path / f"scratchlm.{suffix}").read_bytes()


def test_cli_engine_flag_gives_the_default_engines_file(tokenizer_dir, corpus, tmp_path):
    argv = ["data", "encode", "--tokenizer", str(tokenizer_dir), "--input", *map(str, corpus), "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "default.tok")]) == 0
    assert main([*argv, "--out", str(tmp_path / "tiktoken.tok"), "--engine", "tiktoken"]) == 0
    assert (tmp_path / "tiktoken.tok").read_bytes() == (tmp_path / "default.tok").read_bytes()


@pytest.fixture
def upon_becomes_down(tokenizer, monkeypatch):
    """tiktoken made to encode " upon" as " down": (upon id, down id)."""
    (upon,), (down,) = tokenizer.encode(" upon"), tokenizer.encode(" down")
    encode = TiktokenBPE.encode

    def altered(self, text, out):
        start = len(out)
        encode(self, text, out)
        out[start:] = [down if token == upon else token for token in out[start:]]

    monkeypatch.setattr(TiktokenBPE, "encode", altered)
    return upon, down


def test_cli_refuses_an_engine_that_differs_in_one_line_and_writes_nothing(tokenizer_dir, tmp_path, capsys,
                                                                          upon_becomes_down):
    upon, down = upon_becomes_down
    text_file = tmp_path / "story.txt"
    text_file.write_text("Once upon a time there was a cat.\n" * 100, encoding="utf-8")
    argv = ["data", "encode", "--tokenizer", str(tokenizer_dir), "--input", str(text_file), "--out",
            str(tmp_path / "out.tok"), "--engine", "tiktoken", "--workers", "2"]
    assert main(argv) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "error:" in error
    assert (f"--engine tiktoken gives other ids than the tokenizer on {text_file}: token 1 (at byte 4) is "
            f"{down} b' down' instead of {upon} b' upon'; encode with the default --engine scratchlm") in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["story.txt"]


def test_a_difference_in_a_document_names_the_document(tokenizer, tmp_path, upon_becomes_down):
    upon, down = upon_becomes_down
    documents = tmp_path / "stories.jsonl"
    documents.write_text('{"text": "Hello."}\n{"text": "And upon a hill"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=rf"on document 2 of {re.escape(str(documents))}: token 1 \(at byte 3\) is "
                                         rf"{down} b' down' instead of {upon} b' upon'"):
        encode_corpus(tokenizer, [documents], tmp_path / "out.tok", engine="tiktoken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stories.jsonl"]


def test_the_engine_is_checked_on_the_first_megabyte_as_encoded(tokenizer, tmp_path):
    """Whole documents and the beginning of a text file, cut at SAMPLE_CHARS characters in all."""
    documents, big = tmp_path / "a.jsonl", tmp_path / "b.txt"
    documents.write_text('{"text": "first"}\n{"text": "second 😀"}\n', encoding="utf-8")
    big.write_text("wörd " * 500_000, encoding="utf-8")  # 3 MB, 2.5 M characters
    texts = list(_first_texts(expand_inputs([documents, big]), tokenizer, errors="strict", text_field="text",
                              limit=SAMPLE_CHARS))
    assert texts == [(f"document 1 of {documents}", "first"), (f"document 2 of {documents}", "second 😀"),
                     (str(big), ("wörd " * 500_000)[:SAMPLE_CHARS - len("first") - len("second 😀")])]
