"""Fuzzing the file readers: random and mutated tokenizer files and token files end in a correct result or a
clear error (ValueError or UserError with a message naming the file), never another exception type or a hang.

The mutations start from real files (a saved tokenizer, a GPT-2 vocab/merges pair, a token file), so most cases
are near-valid: those find the checks a purely random file never reaches. A hypothesis deadline bounds each case.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scratchlm.compat.gguf_export import export_gguf
from scratchlm.data.token_file import open_token_file, write_token_file
from scratchlm.errors import UserError
from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.tokenizer import Tokenizer
from scratchlm.tokenizer.formats.folder import write_tokenizer_dir
from scratchlm.tokenizer.formats.io import read_gpt2_files

HAS_GGUF = importlib.util.find_spec("gguf") is not None
FUZZ = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
CLEAR_ERRORS = (ValueError, UserError)


def _seed_tokenizer() -> Tokenizer:
    vocab = {i: bytes([i]) for i in range(256)} | {256: b"th", 257: b"the", 258: b"<|endoftext|>"}
    return Tokenizer(vocab, [(b"t", b"h"), (b"th", b"e")], ["<|endoftext|>"])


with tempfile.TemporaryDirectory() as _folder:  # the seed files every mutation starts from, read once
    write_tokenizer_dir(_folder, _seed_tokenizer())
    SEEDS = {name: (Path(_folder) / name).read_bytes()
             for name in ("scratchlm-tokenizer.json", "tokenizer.json", "vocab.json", "merges.txt")}
    write_token_file(Path(_folder) / "seed.tok", np.arange(40) % 300, vocab_size=300)
    SEEDS["seed.tok"] = (Path(_folder) / "seed.tok").read_bytes()
    if HAS_GGUF:  # a one-layer model in q8_0, so that the header (tokens, merges, keys) is about half the file
        export_gguf(TransformerLM(ModelConfig.preset("tiny", vocab_size=259, d_model=32, num_heads=2, d_ff=32,
                                                     num_layers=1)),
                    _seed_tokenizer(), Path(_folder) / "seed.gguf", "q8_0", name="seed")
        SEEDS["seed.gguf"] = (Path(_folder) / "seed.gguf").read_bytes()


@st.composite
def mutated(draw, seed: bytes) -> bytes:
    """Random bytes, or the seed with a few bytes overwritten, inserted, deleted or the file cut short."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=300))
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(0, max(len(data) - 1, 0)))
        action = draw(st.sampled_from(["flip", "insert", "delete", "cut"]))
        if action == "flip" and data:
            data[position] = draw(st.integers(0, 255))
        elif action == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=8))
        elif action == "delete":
            del data[position:position + draw(st.integers(1, 8))]
        else:
            del data[position:]
    return bytes(data)


def _must_be_clear(error: Exception, path: Path) -> None:
    assert isinstance(error, CLEAR_ERRORS), f"{type(error).__name__}: {error}"
    assert str(path.parent) in str(error) or str(path) in str(error), f"error does not name the file: {error}"


TOKENIZER_FILES = ("scratchlm-tokenizer.json", "tokenizer.json")  # ours, and Hugging Face's


@settings(FUZZ, max_examples=2 * FUZZ.max_examples)  # both files, as many mutations each as before
@given(case=st.sampled_from(TOKENIZER_FILES).flatmap(lambda name: st.tuples(st.just(name), mutated(SEEDS[name]))))
def test_tokenizer_load_of_a_mutated_tokenizer_file(tmp_path_factory, case):
    name, data = case
    folder = tmp_path_factory.mktemp("tok")
    (folder / name).write_bytes(data)
    try:
        tokenizer = Tokenizer.load(folder)
    except Exception as error:  # noqa: BLE001 the point: which exceptions escape
        _must_be_clear(error, folder / name)
        return
    assert tokenizer.decode(tokenizer.encode("the cat")) == "the cat"  # what loads, works


@FUZZ
@given(vocab=mutated(SEEDS["vocab.json"]), merges=mutated(SEEDS["merges.txt"]))
def test_gpt2_readers_on_mutated_vocab_and_merges(tmp_path_factory, vocab, merges):
    folder = tmp_path_factory.mktemp("gpt2")
    (folder / "vocab.json").write_bytes(vocab)
    (folder / "merges.txt").write_bytes(merges)
    try:
        tokenizer = Tokenizer.load(folder)
    except Exception as error:  # noqa: BLE001
        _must_be_clear(error, folder / "vocab.json")
        return
    assert tokenizer.decode(tokenizer.encode("the cat")) == "the cat"
    assert read_gpt2_files(folder / "vocab.json", folder / "merges.txt")[0] == tokenizer.vocab


@FUZZ
@given(data=mutated(SEEDS["seed.tok"]), expected_vocab=st.sampled_from([None, 300, 2**17]))
def test_token_file_reader_on_mutated_bytes(tmp_path_factory, data, expected_vocab):
    path = tmp_path_factory.mktemp("tok") / "data.tok"
    path.write_bytes(data)
    try:
        token_file = open_token_file(path, vocab_size=expected_vocab)
    except Exception as error:  # noqa: BLE001
        _must_be_clear(error, path)
        return
    tokens = np.asarray(token_file.tokens)
    assert len(tokens) == token_file.num_tokens and path.stat().st_size == 64 + tokens.nbytes
    if expected_vocab is not None:
        assert tokens.size == 0 or int(tokens.max()) < token_file.vocab_size <= expected_vocab


@pytest.mark.skipif(not HAS_GGUF, reason="the [gguf] extra is not installed")
@settings(FUZZ, deadline=10_000)  # a case builds a model (the first one imports the gguf package and numpy paths)
@given(data=mutated(SEEDS.get("seed.gguf", b"")))
def test_gguf_import_of_mutated_bytes(tmp_path_factory, data):
    from scratchlm.compat.gguf_import import read_gguf

    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    path.write_bytes(data)
    try:
        model, tokenizer, _ = read_gguf(path, max_gib=0.1)
    except Exception as error:  # noqa: BLE001
        _must_be_clear(error, path)
        return
    assert model.config.vocab_size >= 256  # what loads, runs
    model(torch.tensor([[0, 1, 2]]))
    if tokenizer is not None:
        assert tokenizer.decode(tokenizer.encode("the cat")) == "the cat"


def test_a_damaged_body_id_is_refused_at_open_with_its_position(tmp_path):
    """An id >= vocab written into the body (a bit flip) is caught when the file is opened for a model."""
    path = write_token_file(tmp_path / "data.tok", np.arange(100) % 50, vocab_size=50)
    raw = bytearray(path.read_bytes())
    raw[64 + 2 * 73:64 + 2 * 74] = (999).to_bytes(2, "little")
    path.write_bytes(bytes(raw))
    assert len(open_token_file(path).tokens) == 100  # no vocab to check against: opened as is
    with pytest.raises(ValueError, match=f"{path}: token id 999 at position 73 is outside the file's vocab"):
        open_token_file(path, vocab_size=50)


def test_the_id_scan_covers_every_chunk(tmp_path, monkeypatch):
    """A bad id in the last of several chunks is found (the scan does not stop at the first chunk)."""
    import scratchlm.data.token_file as token_file

    monkeypatch.setattr(token_file, "SCAN_CHUNK", 7)
    path = write_token_file(tmp_path / "data.tok", np.arange(50) % 20, vocab_size=20)
    raw = bytearray(path.read_bytes())
    raw[64 + 2 * 49:] = (25).to_bytes(2, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="token id 25 at position 49 "):
        open_token_file(path, vocab_size=20)
