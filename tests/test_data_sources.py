"""Document inputs for `data encode`: every format gives the ids of the same text, documents end with
<|endoftext|>, validation files hold whole documents, and a bad record is one line naming file and line/row."""

from __future__ import annotations

import gzip
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import gpt2_tokenizer
from document_files import write_jsonl, write_parquet, write_zst
from scratchlm.cli import main
from scratchlm.data.encode import encode_corpus
from scratchlm.data.sources import expand_inputs, parse_hf_spec, read_documents, source_of
from scratchlm.data.token_file import open_token_file
from scratchlm.tokenizer import Tokenizer

EOT = "<|endoftext|>"
DOCUMENTS = ["Once upon a time, a cat.\n", "  Leading spaces\n\nand a paragraph 😀 日本語", "", "x",
             "it's   \n\n\t tabs", "ends with spaces   ", "\r\nwindows\r\n", "last one!"]


@pytest.fixture(scope="module")
def tokenizer():
    return gpt2_tokenizer()


def _expected(tokenizer, documents, end_of_text=True):
    eot = [tokenizer.special_id(EOT)] if end_of_text else []
    return [i for document in documents for i in tokenizer.encode(document) + eot]


def _ids(path):
    return open_token_file(path).tokens.tolist()


def _write_folder(folder, documents):
    folder.mkdir()
    write_jsonl(folder / "0.jsonl", documents[:3])
    (folder / "sub").mkdir()
    _write_text(folder / "sub" / "1.txt", documents[3:])
    (folder / "notes.csv").write_text("not an input: unknown suffixes in folders are skipped")
    return folder


def _write_glob(folder, documents):
    write_jsonl(folder / "g0.jsonl", documents[:5])
    write_jsonl(folder / "g1.jsonl", documents[5:])
    return str(folder / "g*.jsonl")


def _write_bytes(path, data: bytes):
    path.write_bytes(data)
    return path


FORMATS = {
    "txt": lambda d, docs: _write_text(d / "c.txt", docs),
    "txt.gz": lambda d, docs: _write_bytes(d / "c.txt.gz", gzip.compress(_joined(docs).encode())),
    "jsonl": lambda d, docs: write_jsonl(d / "c.jsonl", docs),
    "jsonl.gz": lambda d, docs: write_jsonl(d / "c.jsonl.gz", docs, opener=gzip.open),
    "jsonl.zst": lambda d, docs: write_zst(d / "c.jsonl.zst", "".join(json.dumps({"text": x}) + "\n"
                                                                      for x in docs).encode()),
    "json": lambda d, docs: _write_bytes(d / "c.json", json.dumps([{"text": x} for x in docs]).encode()),
    "json-lines": lambda d, docs: write_jsonl(d / "c.json", docs),
    "parquet": lambda d, docs: write_parquet(d / "c.parquet", docs),
    "folder": lambda d, docs: _write_folder(d / "f", docs),
    "glob": _write_glob,
}


def _joined(documents):
    return "".join(document + EOT for document in documents)


def _write_text(path, documents):
    path.write_text(_joined(documents), encoding="utf-8", newline="")
    return path


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("workers", [1, 2])
def test_every_format_gives_the_ids_of_the_same_documents(tokenizer, tmp_path, kind, workers):
    source = FORMATS[kind](tmp_path, DOCUMENTS)
    stats = encode_corpus(tokenizer, [source], tmp_path / "out.tok", workers=workers)
    assert _ids(tmp_path / "out.tok") == _expected(tokenizer, DOCUMENTS)
    assert stats.num_tokens == len(_expected(tokenizer, DOCUMENTS))


def test_hf_dataset_saved_to_disk(tokenizer, tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"story": DOCUMENTS}).save_to_disk(str(tmp_path / "saved"))
    encode_corpus(tokenizer, [f"hf:{tmp_path / 'saved'}"], tmp_path / "a.tok", workers=1, text_field="story")
    assert _ids(tmp_path / "a.tok") == _expected(tokenizer, DOCUMENTS)


def test_hf_dataset_of_a_local_parquet_folder(tokenizer, tmp_path):
    pytest.importorskip("datasets")
    (tmp_path / "pq").mkdir()
    write_parquet(tmp_path / "pq" / "train.parquet", DOCUMENTS)
    encode_corpus(tokenizer, [f"hf:{tmp_path / 'pq'}"], tmp_path / "b.tok", workers=1)
    assert _ids(tmp_path / "b.tok") == _expected(tokenizer, DOCUMENTS)


def test_hf_spec_parts():
    assert parse_hf_spec("roneneldan/TinyStories") == ("roneneldan/TinyStories", None, "train")
    assert parse_hf_spec("a/b::validation") == ("a/b", None, "validation")
    assert parse_hf_spec("a/b:en:test") == ("a/b", "en", "test")
    with pytest.raises(ValueError, match="expected hf:NAME"):
        parse_hf_spec("a:b:c:d")


def test_text_files_are_cut_at_end_of_text_and_joined_exactly(tokenizer, tmp_path, monkeypatch):
    from scratchlm.data import sources

    monkeypatch.setattr(sources, "READ_BLOCK", 5)  # tokens split over blocks
    text = "a" + EOT + EOT + "b\n" + EOT + "tail"
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    documents = list(read_documents(source_of(path)))
    assert documents == ["a" + EOT, EOT, "b\n" + EOT, "tail"] and "".join(documents) == text


def test_end_of_text_separates_files_and_documents_once(tokenizer, tmp_path):
    eot = tokenizer.special_id(EOT)
    first, second, ended = tmp_path / "1.txt", tmp_path / "2.txt", tmp_path / "3.txt"
    first.write_text("abc", encoding="utf-8")
    second.write_text("def", encoding="utf-8")
    ended.write_text("ghi" + EOT, encoding="utf-8")
    encode_corpus(tokenizer, [first, second, ended], tmp_path / "o.tok", workers=1)
    assert _ids(tmp_path / "o.tok") == [*tokenizer.encode("abc"), eot, *tokenizer.encode("def"), eot,
                                        *tokenizer.encode("ghi"), eot]
    encode_corpus(tokenizer, [first, second], tmp_path / "n.tok", workers=1, end_of_text=False)
    assert _ids(tmp_path / "n.tok") == tokenizer.encode("abc") + tokenizer.encode("def")
    plain = Tokenizer(tokenizer.vocab, tokenizer.merges)  # no special tokens
    with pytest.raises(ValueError, match="no <\\|endoftext\\|> special token.*--no-eot"):
        encode_corpus(plain, [first], tmp_path / "p.tok")


@pytest.mark.parametrize("workers", [1, 2])
def test_validation_split_takes_whole_documents(tokenizer, tmp_path, workers):
    source = write_jsonl(tmp_path / "c.jsonl", DOCUMENTS)
    stats = encode_corpus(tokenizer, [source], tmp_path / "t.tok", val_out=tmp_path / "v.tok", val_fraction=0.25,
                          workers=workers)
    val_docs = [DOCUMENTS[3], DOCUMENTS[7]]  # evenly spaced: documents 3 and 7 of 8
    assert _ids(tmp_path / "v.tok") == _expected(tokenizer, val_docs)
    assert _ids(tmp_path / "t.tok") == _expected(tokenizer, [d for d in DOCUMENTS if d not in val_docs])
    assert (stats.documents, stats.val_documents) == (6, 2)
    text = _write_text(tmp_path / "c.txt", DOCUMENTS)
    encode_corpus(tokenizer, [text], tmp_path / "t2.tok", val_out=tmp_path / "v2.tok", val_docs=2, workers=workers)
    assert _ids(tmp_path / "v2.tok") == _expected(tokenizer, DOCUMENTS[:2])
    assert _ids(tmp_path / "t2.tok") == _expected(tokenizer, DOCUMENTS[2:])


def test_validation_split_that_selects_nothing_is_refused(tokenizer, tmp_path):
    source = write_jsonl(tmp_path / "c.jsonl", DOCUMENTS)
    with pytest.raises(ValueError, match="--val-fraction 0.1 selects none of the 8 documents"):
        encode_corpus(tokenizer, [source], tmp_path / "t.tok", val_out=tmp_path / "v.tok", val_fraction=0.1)
    assert not (tmp_path / "t.tok").exists() and not (tmp_path / "v.tok").exists()


def test_cli_writes_validation_file_beside_the_train_file(tokenizer, tmp_path, capsys):
    tokenizer_dir = tokenizer.save(tmp_path / "tok")
    source = write_jsonl(tmp_path / "c.jsonl", DOCUMENTS)
    assert main(["data", "encode", "--tokenizer", str(tokenizer_dir), "--input", str(source), "--out",
                 str(tmp_path / "train.tok"), "--val-docs", "1", "--workers", "1"]) == 0
    assert "validation" in capsys.readouterr().out
    assert _ids(tmp_path / "train.val.tok") == _expected(tokenizer, DOCUMENTS[:1])


BAD_JSONL = {
    "malformed": (b'{"text": "a"}\n{"text": "b"}\n{"text": \n', r"c\.jsonl:3: malformed JSON"),
    "missing field": (b'{"text": "a"}\n{"body": "b", "n": 1}\n', r"c\.jsonl:2: no field 'text' \(fields: 'body', "
                                                                 r"'n'\); choose one with --text-field"),
    "not text": (b'{"text": "a"}\n\n{"text": 5}\n', r"c\.jsonl:3: field 'text' is a int, not text"),
    "null": (b'{"text": null}\n', r"c\.jsonl:1: field 'text' is null, not text"),
    "not an object": (b'["text"]\n', r"c\.jsonl:1: expected a JSON object with a 'text' field, got a list"),
    "invalid utf-8": (b'{"text": "a"}\n{"text": "\xff"}\n', r"c\.jsonl:2: invalid UTF-8"),
    "lone surrogate": (b'{"text": "a\\ud800"}\n', r"c\.jsonl:1: field 'text' holds a lone surrogate"),
}


@pytest.mark.parametrize("name", BAD_JSONL)
def test_bad_record_is_one_cli_line_naming_file_and_line(tokenizer, tmp_path, capsys, name):
    data, message = BAD_JSONL[name]
    (tmp_path / "c.jsonl").write_bytes(data)
    tokenizer_dir = tokenizer.save(tmp_path / "tok")
    assert main(["data", "encode", "--tokenizer", str(tokenizer_dir), "--input", str(tmp_path / "c.jsonl"),
                 "--out", str(tmp_path / "o.tok"), "--quiet", "--workers", "1"]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and re.search(message, error), error
    assert not (tmp_path / "o.tok").exists()


def test_bad_parquet_column_and_row_are_named(tokenizer, tmp_path):
    path = write_parquet(tmp_path / "c.parquet", ["a", None, "c"])
    with pytest.raises(ValueError, match=r"c\.parquet: no column 'body' \(columns: 'id', 'text'\)"):
        encode_corpus(tokenizer, [path], tmp_path / "o.tok", text_field="body")
    with pytest.raises(ValueError, match=r"c\.parquet: row 1: field 'text' is null, not text"):
        encode_corpus(tokenizer, [path], tmp_path / "o.tok")


def test_bad_specs_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no files"):
        expand_inputs([str(tmp_path / "*.jsonl")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no input files"):
        expand_inputs([tmp_path / "empty"])
    (tmp_path / "broken.txt.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="broken.txt.gz: cannot decompress"):
        list(read_documents(source_of(tmp_path / "broken.txt.gz")))


texts = st.text(st.characters(blacklist_categories=["Cs"]), max_size=40)


@settings(max_examples=60, deadline=None)
@given(documents=st.lists(texts, max_size=6), ascii_only=st.booleans())
def test_jsonl_round_trip(tmp_path_factory, documents, ascii_only):
    path = tmp_path_factory.mktemp("rt") / "r.jsonl"
    path.write_text("".join(json.dumps({"text": d}, ensure_ascii=ascii_only) + "\n" for d in documents),
                    encoding="utf-8")
    assert list(read_documents(source_of(path))) == documents
