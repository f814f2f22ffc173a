"""`tokenizer train` reads every input `data encode` reads.

Each format (JSON lines, JSON, parquet, .gz/.zst, folders, globs, datasets, and mixes with plain text) must train
exactly the merges of the same documents written as one plain text with <|endoftext|> between them, which the
slow reference trainer gives. The documents are built so that any two of them run together would change the
counts, so a pre-token that spans two documents cannot go unnoticed. A bad record is one line naming the file and
line or row, and leaves no tokenizer folder behind.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import re
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from document_files import write_jsonl, write_parquet, write_zst
from scratchlm.cli import main
from scratchlm.data import sources
from scratchlm.data.sources import Source, source_of
from scratchlm.tokenizer import Tokenizer, training_inputs
from scratchlm.tokenizer.bpe import reference_pretoken_counts, reference_train_from_counts
from scratchlm.tokenizer.commands import describe_size
from scratchlm.tokenizer.counting import count_text
from scratchlm.tokenizer.pretokenize import special_token_regex
from scratchlm.tokenizer.train_bpe import train_bpe
from scratchlm.tokenizer.training_inputs import count_input_pretokens, safe_parts

EOT = "<|endoftext|>"
VOCAB = 256 + 1 + 400  # more than the documents hold: training runs until every pre-token is one token
WORDS = ["the", "cat", "sat", "on", "a", "mat", "héllo", "世界", "it's", "don't", "!!", "...", "42", "😀", "\n", "  ",
         "tab\t"]


def make_documents(count: int = 60, seed: int = 0) -> list[str]:
    """Documents of words, punctuation and whitespace, empty ones among them."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 14))) for _ in range(count)]


DOCUMENTS = make_documents()


def joined(documents: list[str]) -> str:
    return "".join(document + EOT for document in documents)


def expected_merges(documents: list[str], special_tokens: list[str]) -> list[tuple[bytes, bytes]]:
    """The reference trainer's merges on the plain text of the documents, <|endoftext|> between them."""
    counts = reference_pretoken_counts(joined(documents), special_tokens)
    return reference_train_from_counts(counts, VOCAB, special_tokens)[1]


def write_text(path, documents):
    path.write_bytes(joined(documents).encode("utf-8"))
    return path


def write_bytes(path, data: bytes):
    path.write_bytes(data)
    return path


def write_folder(folder, documents):
    """A folder of mixed formats (and a file of an unknown suffix, which folders skip)."""
    (folder / "sub").mkdir(parents=True)
    write_jsonl(folder / "0.jsonl", documents[:20])
    write_parquet(folder / "sub" / "1.parquet", documents[20:40])
    write_bytes(folder / "2.txt.gz", gzip.compress(joined(documents[40:]).encode()))
    (folder / "notes.csv").write_text("not an input: folders skip unknown suffixes")
    return folder


def write_glob(folder, documents):
    write_jsonl(folder / "g0.jsonl", documents[:30])
    write_jsonl(folder / "g1.jsonl", documents[30:])
    return str(folder / "g*.jsonl")


def write_text_and_jsonl(folder, documents):
    """A plain text file (the byte-range path) beside JSON lines (the document stream)."""
    return [write_text(folder / "a.txt", documents[:30]), write_jsonl(folder / "b.jsonl", documents[30:])]


FORMATS = {
    "jsonl": lambda d, docs: write_jsonl(d / "c.jsonl", docs),
    "jsonl.gz": lambda d, docs: write_jsonl(d / "c.jsonl.gz", docs, opener=gzip.open),
    "jsonl.zst": lambda d, docs: write_zst(d / "c.jsonl.zst", "".join(json.dumps({"text": x}) + "\n"
                                                                      for x in docs).encode()),
    "json array": lambda d, docs: write_bytes(d / "c.json", json.dumps([{"text": x} for x in docs]).encode()),
    "parquet": lambda d, docs: write_parquet(d / "c.parquet", docs, row_group_size=7),
    "txt.gz": lambda d, docs: write_bytes(d / "c.txt.gz", gzip.compress(joined(docs).encode())),
    "txt.zst": lambda d, docs: write_zst(d / "c.txt.zst", joined(docs).encode()),
    "folder": lambda d, docs: write_folder(d / "f", docs),
    "glob": write_glob,
    "txt + jsonl": write_text_and_jsonl,
}


@pytest.fixture
def small_batches(monkeypatch):
    """Many batches and text blocks, so that the worker pool and the cutting of text streams are exercised."""
    monkeypatch.setattr(training_inputs, "BATCH_CHARS", 40)
    monkeypatch.setattr(sources, "READ_BLOCK", 13)


def test_documents_run_together_would_change_the_counts():
    """The check the format tests rely on: these documents do not train the same merges when joined."""
    together = reference_pretoken_counts("".join(DOCUMENTS), [EOT])
    assert together != reference_pretoken_counts(joined(DOCUMENTS), [EOT])
    assert reference_train_from_counts(together, VOCAB, [EOT])[1] != expected_merges(DOCUMENTS, [EOT])


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("workers", [1, 2])
def test_every_format_trains_the_merges_of_the_plain_text(tmp_path, small_batches, kind, workers):
    inputs = FORMATS[kind](tmp_path, DOCUMENTS)
    vocab, merges = train_bpe(inputs, VOCAB, [EOT], num_workers=workers)
    assert merges == expected_merges(DOCUMENTS, [EOT])
    assert vocab[256] == EOT.encode() and len(vocab) == 257 + len(merges)


@pytest.mark.parametrize("compression", ["gz", "zst"])
def test_compressed_text_counts_like_the_plain_file_without_special_tokens(tmp_path, small_batches, compression):
    """With no special tokens, <|endoftext|> is text: the compressed stream is not cut at it."""
    text = joined(DOCUMENTS).encode()
    path = tmp_path / f"c.txt.{compression}"
    if compression == "gz":
        path.write_bytes(gzip.compress(text))
    else:
        write_zst(path, text)
    assert count_input_pretokens([path], [], num_workers=1) == reference_pretoken_counts(text.decode(), [])
    assert train_bpe(path, VOCAB, [])[1] == reference_train_from_counts(reference_pretoken_counts(text.decode(), []),
                                                                        VOCAB, [])[1]


def test_text_field_names_the_json_field_and_the_parquet_column(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", DOCUMENTS[:30], field="story")
    write_parquet(tmp_path / "b.parquet", DOCUMENTS[30:], column="story")
    merges = train_bpe([tmp_path / "a.jsonl", tmp_path / "b.parquet"], VOCAB, [EOT], text_field="story")[1]
    assert merges == expected_merges(DOCUMENTS, [EOT])


def test_hf_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"story": DOCUMENTS}).save_to_disk(str(tmp_path / "saved"))
    merges = train_bpe([f"hf:{tmp_path / 'saved'}"], VOCAB, [EOT], text_field="story")[1]
    assert merges == expected_merges(DOCUMENTS, [EOT])


# --- cutting a stream of text ------------------------------------------------------------------------------

SPECIALS = [EOT, "a b", "! ", " x", "<|a|><|b|>", "<|a|>"]  # some hold spaces: a cut must not fall inside one


def blocks_of(text: str, sizes: list[int]) -> list[str]:
    blocks, start, index = [], 0, 0
    while start < len(text):
        size = sizes[index % len(sizes)]
        blocks.append(text[start:start + size])
        start, index = start + size, index + 1
    return blocks


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.one_of(st.text("ab !.x\n\té😀'", max_size=12), st.sampled_from(SPECIALS)), max_size=30),
       specials=st.lists(st.sampled_from(SPECIALS), unique=True, max_size=4),
       sizes=st.lists(st.integers(1, 15), min_size=1, max_size=5))
def test_safe_parts_count_like_the_whole_text(pieces, specials, sizes):
    text = "".join(pieces)
    parts = list(safe_parts(blocks_of(text, sizes), specials))
    assert "".join(parts) == text
    counts: Counter[str] = Counter()
    for part in parts:
        count_text(part, special_token_regex(specials), counts)
    assert counts == reference_pretoken_counts(text, specials)


def test_safe_parts_stay_small_and_a_text_without_cuts_stays_whole():
    text = "the cat sat on a mat. " * 5000
    parts = list(safe_parts(blocks_of(text, [1000]), [EOT]))
    assert "".join(parts) == text and len(parts) > 100 and max(map(len, parts)) <= 1100
    dna = "ACGT" * 1000
    assert list(safe_parts(blocks_of(dna, [100]), [])) == [dna]


# --- bad input ---------------------------------------------------------------------------------------------

GOOD_LINES = b'{"text": "the cat sat on the mat"}\n' * 40  # enough batches that the pool runs when the error comes


def _parquet_bytes(tmp_path, values):
    return write_parquet(tmp_path / "tmp.parquet", values).read_bytes()


BAD_INPUTS = {
    "missing field": ("c.jsonl", lambda t: GOOD_LINES + b'{"body": "b", "n": 1}\n', [],
                      r"c\.jsonl:41: no field 'text' \(fields: 'body', 'n'\); choose one with --text-field"),
    "invalid utf-8": ("c.jsonl", lambda t: GOOD_LINES + b'{"text": "caf\xe9"}\n', [], r"c\.jsonl:41: invalid UTF-8"),
    "invalid utf-8, compressed": ("c.jsonl.gz", lambda t: gzip.compress(GOOD_LINES + b'{"text": "\xff"}\n'), [],
                                  r"c\.jsonl\.gz:41: invalid UTF-8"),
    "invalid utf-8, compressed text": ("c.txt.gz", lambda t: gzip.compress(b"fine text\n" * 40 + b"caf\xe9"), [],
                                       r"c\.txt\.gz: invalid UTF-8 at byte offset 403"),
    "not text": ("c.jsonl", lambda t: GOOD_LINES + b'{"text": 5}\n', [], r"c\.jsonl:41: field 'text' is a int"),
    "malformed": ("c.jsonl", lambda t: GOOD_LINES + b'{"text": \n', [], r"c\.jsonl:41: malformed JSON"),
    "wrong column": ("c.parquet", lambda t: _parquet_bytes(t, ["a", "b"]), ["--text-field", "body"],
                     r"c\.parquet: no column 'body' \(columns: 'id', 'text'\); choose one with --text-field"),
    "null row": ("c.parquet", lambda t: _parquet_bytes(t, ["the cat sat"] * 40 + [None]), [],
                 r"c\.parquet: row 40: field 'text' is null, not text"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
@pytest.mark.parametrize("workers", ["1", "2"])
def test_bad_record_is_one_line_and_leaves_no_folder(tmp_path, capsys, small_batches, name, workers):
    filename, make, flags, message = BAD_INPUTS[name]
    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / filename
    path.write_bytes(make(tmp_path))
    code = main(["tokenizer", "train", "--input", str(path), "--vocab-size", "300", "--special-token", EOT,
                 "--out", str(tmp_path / "new" / "tok"), "--workers", workers, "--quiet", *flags])
    error = capsys.readouterr().err
    assert code == 1
    assert error.count("\n") == 1 and re.search(message, error) and "Traceback" not in error, error
    assert not (tmp_path / "new").exists()


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_hf_input_without_datasets_names_the_extra(tmp_path, capsys):
    code = main(["tokenizer", "train", "--input", "hf:roneneldan/TinyStories", "--vocab-size", "300",
                 "--out", str(tmp_path / "tok"), "--quiet"])
    error = capsys.readouterr().err
    assert code == 1 and error.count("\n") == 1 and "pip install 'scratchlm[data]'" in error, error
    assert not (tmp_path / "tok").exists()


# --- the command -------------------------------------------------------------------------------------------

def test_cli_trains_on_a_folder_and_a_glob_and_reports_their_size(tmp_path, capsys):
    folder = write_folder(tmp_path / "f", DOCUMENTS[:50])
    write_jsonl(tmp_path / "g.jsonl", DOCUMENTS[50:])
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--input", str(folder), str(tmp_path / "g*.jsonl"), "--vocab-size",
                 str(VOCAB), "--special-token", EOT, "--out", str(out), "--workers", "1"]) == 0
    assert Tokenizer.load(out).merges == expected_merges(DOCUMENTS, [EOT])
    assert "trained on 0.0 MB in" in capsys.readouterr().out


def test_summary_gives_the_size_of_the_files_and_counts_the_datasets(tmp_path):
    big = write_bytes(tmp_path / "big.txt", b"a" * (3 * 2**20 + 2**19))
    assert describe_size([source_of(big), source_of(write_bytes(tmp_path / "empty.jsonl", b""))]) == "3.5 MB"
    assert describe_size([source_of(big), Source("a/b", "hf")]) == "3.5 MB and 1 dataset"
    assert describe_size([Source("a/b", "hf"), Source("c", "hf")]) == "2 datasets"


def test_cli_refuses_an_output_inside_an_input_folder(tmp_path, capsys):
    folder = write_folder(tmp_path / "f", DOCUMENTS)
    code = main(["tokenizer", "train", "--input", str(folder), "--vocab-size", "300", "--out", str(folder / "tok")])
    error = capsys.readouterr().err
    assert code == 1 and f"--out {folder / 'tok'} lies inside the input {folder}" in error, error
    assert error.count("\n") == 1 and not (folder / "tok").exists()


# --- plain text without sources.py -------------------------------------------------------------------------

NAMES = [f"c{suffix}{compression}" for suffix in (*sources.KNOWN_SUFFIXES, ".en", "")
         for compression in ("", *sources.COMPRESSED_SUFFIXES)] + ["C.JSONL", "x.TXT.GZ", "data.json.txt"]


@pytest.mark.parametrize("name", NAMES)
def test_plain_text_names_agree_with_sources(tmp_path, name):
    """training_inputs repeats which names sources.py parses (to skip importing it): the two must agree."""
    path = write_bytes(tmp_path / name, b"")
    try:
        plain = source_of(path).is_plain_text
    except ValueError:  # a compressed parquet file: refused by sources.py
        plain = False
    assert (training_inputs.plain_text_files([path]) is not None) == plain
    assert training_inputs.plain_text_files([tmp_path]) is None and training_inputs.plain_text_files([]) is None


def test_plain_text_files_are_counted_without_importing_the_readers(tmp_path):
    corpus = write_text(tmp_path / "c.txt", DOCUMENTS)
    script = ("import sys; from scratchlm.tokenizer import train_bpe; "
              f"train_bpe({str(corpus)!r}, 300, [{EOT!r}]); print('scratchlm.data.sources' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
