"""Hostile files are refused before any work: one line naming the file, exit status 1, and every file that existed
before the command is byte-identical afterwards (nothing lost, nothing silently wrong)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from scratchlm.cli import main
from scratchlm.compat.hf_export import export_hf
from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.tokenizer import Tokenizer

pytest.importorskip("transformers")


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"scratchlm {command}: error:"), err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    return err


# ------------------------------------------------------------------------------------------------ import hf

@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A small exported Hugging Face Llama folder (untied), made once and copied per test."""
    torch.manual_seed(0)
    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    model = TransformerLM(ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size))
    folder = tmp_path_factory.mktemp("hf") / "model"
    export_hf(model, tokenizer, folder)
    return folder


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text()) | changes
    (folder / "config.json").write_text(json.dumps(config))


def _edit_tensors(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def _rewrite_header(folder: Path, edit) -> None:
    """Replace the JSON header of model.safetensors by edit(header), keeping the data bytes."""
    raw = (folder / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.dumps(edit(json.loads(raw[8:8 + length]))).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + length:])


def _first_tensor(header: dict) -> str:
    return next(name for name in header if name != "__metadata__")


def _truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def _huge_header_length(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 2**40) + path.read_bytes()[8:])


def _distinct_tied_head(folder: Path) -> None:
    _edit_config(folder, tie_word_embeddings=True)
    _edit_tensors(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}))


def _shape_lie(header: dict) -> dict:
    header[_first_tensor(header)]["shape"][0] += 1
    return header


def _integer_weights(header: dict) -> dict:
    entry = header["model.norm.weight"]
    entry["dtype"] = "I32"  # F32 and I32 have the same size: only the dtype is wrong
    return header


IMPORT_CASES = {
    "vocab_size_float": (lambda f: _edit_config(f, vocab_size=2e7),
                         "config.json: Validation error for field 'vocab_size'"),
    "vocab_size_huge": (lambda f: _edit_config(f, vocab_size=20_000_000), "--max-gib"),
    "vocab_size_1e12": (lambda f: _edit_config(f, vocab_size=10**12), "--max-gib"),
    "context_huge": (lambda f: _edit_config(f, max_position_embeddings=10**9), "--max-gib"),
    "context_1e12": (lambda f: _edit_config(f, max_position_embeddings=10**12), "--max-gib"),
    "heads_zero": (lambda f: _edit_config(f, num_attention_heads=0), "config.json: integer modulo by zero"),
    "config_not_json": (lambda f: (f / "config.json").write_text("{not json"), "config.json: not valid JSON"),
    "config_a_list": (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json: a JSON list"),
    "hidden_size_mismatch": (lambda f: _edit_config(f, intermediate_size=96), "config.json implies"),
    "truncated_weights": (_truncate, "model.safetensors: header describes"),
    "empty_weights": (lambda f: (f / "model.safetensors").write_bytes(b""), "too short for a safetensors file"),
    "huge_header_length": (_huge_header_length, "model.safetensors: header claims"),
    "header_not_json": (lambda f: _rewrite_header(f, lambda h: None) or (f / "model.safetensors").write_bytes(
        struct.pack("<Q", 4) + b"{{{{"), "not valid JSON"),
    "shape_lies_about_bytes": (lambda f: _rewrite_header(f, _shape_lie), "needs"),
    "integer_weights": (lambda f: _rewrite_header(f, _integer_weights), "model.norm.weight' is I32"),
    "extra_tensor": (lambda f: _edit_tensors(f, lambda t: t.update({"extra.weight": torch.zeros(3)})),
                     "extra.weight"),
    "missing_tensor": (lambda f: _edit_tensors(f, lambda t: t.pop("model.norm.weight")),
                       "model.safetensors: no tensor 'model.norm.weight'"),
    "tied_head_differs": (_distinct_tied_head, "lm_head.weight"),
    "index_escapes_folder": (lambda f: (f / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "../model.safetensors"}})), "not a file name inside"),
    "index_not_json": (lambda f: (f / "model.safetensors.index.json").write_text("nope"),
                       "model.safetensors.index.json: not a safetensors index"),
    "tokenizer_json_broken": (lambda f: (f / "tokenizer.json").write_text('{"model": {"type": "BPE"}, '
                                                                          '"pre_tokenizer": {"type": "ByteLevel"}}'),
                              "tokenizer.json: not a readable tokenizer.json"),
}


@pytest.mark.parametrize("case", sorted(IMPORT_CASES))
def test_import_hf_refuses_hostile_folder_in_one_line(tmp_path, hf_folder, capsys, case):
    damage, message = IMPORT_CASES[case]
    folder = tmp_path / "model"
    shutil.copytree(hf_folder, folder)
    damage(folder)
    before = _snapshot(tmp_path)
    assert main(["import", "hf", "--model", str(folder), "--out", str(tmp_path / "run")]) == 1
    err = _one_line_error(capsys, "import")
    assert message in err, err
    if case == "tied_head_differs":
        assert "model.embed_tokens.weight" in err
    assert _snapshot(tmp_path) == before and not (tmp_path / "run").exists()


def test_import_hf_accepts_tied_head_equal_to_embedding(tmp_path, hf_folder):
    """The benign twin of the tied-head case: a separate lm_head that equals the embedding is not a loss."""
    folder = tmp_path / "model"
    shutil.copytree(hf_folder, folder)
    _edit_config(folder, tie_word_embeddings=True)
    _edit_tensors(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    assert main(["import", "hf", "--model", str(folder), "--out", str(tmp_path / "run")]) == 0


def test_import_hf_max_gib_flag_lifts_the_limit(tmp_path, hf_folder, capsys):
    """The cap is a limit, not a wall: a tiny --max-gib refuses the small model, and the error says which flag."""
    folder = tmp_path / "model"
    shutil.copytree(hf_folder, folder)
    assert main(["import", "hf", "--model", str(folder), "--out", str(tmp_path / "a"), "--max-gib", "1e-6"]) == 1
    assert "--max-gib" in _one_line_error(capsys, "import")
    assert main(["import", "hf", "--model", str(folder), "--out", str(tmp_path / "b"), "--max-gib", "1"]) == 0


def test_safetensors_header_reader_agrees_with_the_library(hf_folder):
    """Oracle: our header parser and the safetensors library see the same names, dtypes and shapes."""
    from safetensors import safe_open

    from scratchlm.compat.safetensors_header import read_safetensors_header

    ours = read_safetensors_header(hf_folder / "model.safetensors")
    with safe_open(hf_folder / "model.safetensors", "pt") as handle:
        theirs = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118 (safe_open is no dict)
    assert {name: entry.shape for name, entry in ours.items()} == theirs


# ---------------------------------------------------------------------------------------- full disk, closed pipe

def _disk_full(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_during_tokenizer_save_names_the_file_and_leaves_no_folder(tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("low lower lowest newer newest wider " * 50, encoding="utf-8")
    before = _snapshot(tmp_path)
    monkeypatch.setattr(os, "fsync", _disk_full)  # every durable write ends in fsync: the disk fills there
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "270", "--out",
                 str(tmp_path / "new" / "tok"), "--quiet"]) == 1
    err = _one_line_error(capsys, "tokenizer")
    assert f"{tmp_path / 'new' / 'tok' / 'scratchlm-tokenizer.json'}: No space left on device (writing " in err, err
    assert "bytes free on that filesystem" in err
    assert _snapshot(tmp_path) == before and not (tmp_path / "new").exists()


def test_full_disk_during_encode_names_the_output(tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world " * 100, encoding="utf-8")
    Tokenizer({i: bytes([i]) for i in range(256)}, [], []).save(tmp_path / "tok")
    before = _snapshot(tmp_path)
    monkeypatch.setattr(os, "fsync", _disk_full)
    assert main(["data", "encode", "--tokenizer", str(tmp_path / "tok"), "--input", str(corpus), "--out",
                 str(tmp_path / "corpus.tok"), "--workers", "1", "--quiet", "--no-eot"]) == 1
    assert f"{tmp_path / 'corpus.tok'}: No space left on device" in _one_line_error(capsys, "data")
    assert _snapshot(tmp_path) == before


def test_full_disk_while_appending_metrics_names_metrics_jsonl(tmp_path):
    from scratchlm.train.metrics import MetricsLogger
    from scratchlm.write_errors import describe_os_error

    logger = MetricsLogger(tmp_path, total_steps=1, quiet=True)
    logger._file.write = _disk_full
    with pytest.raises(OSError) as caught:
        logger.log({"kind": "eval", "step": 1, "val_loss": 1.0, "val_ppl": 2.7})
    assert describe_os_error(caught.value).startswith(f"{tmp_path / 'metrics.jsonl'}: No space left on device")


def test_generate_into_a_closed_pipe_exits_quietly(tmp_path, hf_folder):
    """`scratchlm generate | head -c 1`: the reader leaves early; generate ends with status 0 and no traceback."""
    assert main(["import", "hf", "--model", str(hf_folder), "--out", str(tmp_path / "run")]) == 0
    command = [sys.executable, "-m", "scratchlm.cli", "generate", "--checkpoint", str(tmp_path / "run"),
               "--num-samples", "50", "--temperature", "1.0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=os.environ | {"OMP_NUM_THREADS": "1"})
    process.stdout.read(1)
    process.stdout.close()  # like head after its first byte
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0, stderr
    assert "Broken pipe" not in stderr and "Traceback" not in stderr, stderr


# ------------------------------------------------------------------------------------------------ report

@pytest.mark.parametrize("garbage", [b"\xff\xfe\x00binary\x80\n", b"\x00\x01\x02\x03\n"])
def test_report_on_a_binary_metrics_line_names_the_file_and_line(tmp_path, capsys, garbage):
    run = tmp_path / "run"
    run.mkdir()
    good = json.dumps({"kind": "train", "step": 1, "loss": 3.0}).encode() + b"\n"
    (run / "metrics.jsonl").write_bytes(good + garbage + good)
    before = _snapshot(tmp_path)
    assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 1
    assert f"{run / 'metrics.jsonl'}:2: " in _one_line_error(capsys, "report")
    assert _snapshot(tmp_path) == before


# ------------------------------------------------------------------------------------------------ killed encode

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGKILL and /proc children: Linux")
def test_sigkilled_encode_takes_its_workers_along_and_the_next_run_removes_its_leftovers(tmp_path):
    psutil = pytest.importorskip("psutil")
    corpus = tmp_path / "corpus.txt"  # lines of words: the encode cuts ranges at line breaks, one per task
    corpus.write_text("".join(f"word{(i * 7919) % 500} word{i % 37}.\n" for i in range(300_000)), encoding="utf-8")
    Tokenizer({i: bytes([i]) for i in range(256)}, [], []).save(tmp_path / "tok")
    out = tmp_path / "corpus.tok"
    command = [sys.executable, "-m", "scratchlm.cli", "data", "encode", "--tokenizer", str(tmp_path / "tok"),
               "--out", str(out), "--workers", "2", "--quiet", "--no-eot", "--input", str(corpus)]
    parent = subprocess.Popen(command, env=os.environ | {"OMP_NUM_THREADS": "1"})
    for _ in range(600):  # until both workers run and a part file exists
        workers = psutil.Process(parent.pid).children()
        if len(workers) >= 2 and list(tmp_path.glob(".corpus.tok.parts.*/*")):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the encode never started its workers")
    parent.kill()
    parent.wait()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"workers outlived their killed parent: {alive}"
    assert list(tmp_path.glob(".corpus.tok*"))  # the kill left parts behind (no clean-up runs on SIGKILL)
    (tmp_path / "small.txt").write_text("a small text\n")
    assert main(["data", "encode", "--tokenizer", str(tmp_path / "tok"), "--input", str(tmp_path / "small.txt"),
                 "--out", str(out), "--quiet", "--no-eot"]) == 0
    assert not list(tmp_path.glob(".corpus.tok*")) and out.is_file()
