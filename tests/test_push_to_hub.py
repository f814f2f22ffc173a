"""`scratchlm export hf --push-to-hub`: huggingface_hub's create_repo + upload_folder against a local fake Hub
(tests/fake_hub.py; no internet). The Hub's copy must be the export folder, byte for byte."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from fake_hub import COMMIT, serve
from scratchlm.cli import main
from scratchlm.hub import HubError, push_folder

pytest.importorskip("huggingface_hub")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with serve(tmp_path, monkeypatch) as fake:
        yield fake


def _folder(tmp_path: Path) -> Path:
    """A folder like an export: JSON, UTF-8 text and binary weights (every byte value, an empty-looking tail)."""
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}\n')
    (folder / "tokenizer.json").write_text('{"added_tokens": ["<|endoftext|>", "naïve 🐱 日本"]}', encoding="utf-8")
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 200 + random.Random(0).randbytes(5000) + b"\0" * 100)
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir()}


def test_push_creates_the_repository_and_commits_every_file(hub, tmp_path):
    folder = _folder(tmp_path)
    assert push_folder(folder, "me/tiny") == f"{hub.url}/me/tiny/commit/{COMMIT}"
    assert hub.repos[("model", "me/tiny")] == _files(folder)
    assert hub.visibility[("model", "me/tiny")] is None  # the Hub's default
    assert hub.commit_messages == ["Upload export (scratchlm export hf)"]


def test_push_private(hub, tmp_path):
    push_folder(_folder(tmp_path), "me/secret", private=True)
    assert hub.visibility[("model", "me/secret")] == "private"


def test_push_to_an_existing_repository_adds_a_commit(hub, tmp_path):
    hub.add("me/tiny", {"README.md": b"# mine\n"}, repo_type="model")
    folder = _folder(tmp_path)
    push_folder(folder, "me/tiny")
    assert hub.repos[("model", "me/tiny")] == {"README.md": b"# mine\n", **_files(folder)}
    assert ("model", "me/tiny") not in hub.visibility  # not created again


def test_push_without_a_token_says_how_to_log_in(hub, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    folder = _folder(tmp_path)
    with pytest.raises(HubError) as caught:
        push_folder(folder, "me/tiny")
    message = str(caught.value)
    assert message.startswith(f"pushing {folder} to me/tiny: ") and "hf auth login" in message and "\n" not in message
    assert ("model", "me/tiny") not in hub.repos


# ------------------------------------------------------------------------------------------ the command

@pytest.fixture
def run(tmp_path) -> Path:
    """A tiny trained-tokenizer run directory that `export hf` accepts."""
    pytest.importorskip("transformers")
    from scratchlm.compat.commands import write_run
    from scratchlm.model import ModelConfig, TransformerLM
    from scratchlm.tokenizer import Tokenizer
    from scratchlm.tokenizer.train_bpe import train_bpe

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Once upon a time there was a cat. The cat sat on a mat. <|endoftext|>" * 20, encoding="utf-8")
    tokenizer = Tokenizer(*train_bpe(corpus, 280, ["<|endoftext|>"]), ["<|endoftext|>"])
    write_run(TransformerLM(ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size)), tokenizer, tmp_path / "run")
    return tmp_path / "run"


def test_export_then_push(hub, run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", "hf", "--checkpoint", str(run), "--out", str(out), "--push-to-hub", "me/tiny",
                 "--private"]) == 0
    assert hub.repos[("model", "me/tiny")] == _files(out)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(_files(out))
    assert hub.visibility[("model", "me/tiny")] == "private"
    assert capsys.readouterr().out.splitlines()[-1] == f"pushed {out}/ to {hub.url}/me/tiny/commit/{COMMIT}"


def test_a_failed_push_keeps_the_export_and_says_so_in_one_line(hub, run, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    out = tmp_path / "hf"
    assert main(["export", "hf", "--checkpoint", str(run), "--out", str(out), "--push-to-hub", "me/tiny"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: pushing {out} to me/tiny: " in err and "hf auth login" in err, err
    assert "model.safetensors" in _files(out)


def test_private_without_push_is_refused(run, tmp_path, capsys):
    assert main(["export", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "hf"), "--private"]) == 1
    assert "--private is for --push-to-hub" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_push_without_the_hub_extra_names_it_before_exporting(run, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # as if not installed (transformers is loaded)
    assert main(["export", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "hf"), "--push-to-hub",
                 "me/tiny"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs the huggingface_hub package" in err and "scratchlm[hub]" in err, err
    assert not (tmp_path / "hf").exists()
