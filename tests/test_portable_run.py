"""A run directory is self-contained, and its model's vocabulary follows its tokenizer.

A tiny run is trained with a BPE tokenizer of 300 ids, copied elsewhere with shutil.copytree, and the original
(run, tokenizer and token files) renamed away. The copy then evaluates, generates and exports byte for byte as the
original did, and resumed with the token files' new place continues bitwise as the original run went on. Neither
its config.toml nor a checkpoint's config.json names an absolute path.

model.vocab_size: left out, it is the tokenizer's (300), rounded up to model.pad_vocab_to (64: 320); set, it may
be larger than the tokenizer's but not smaller.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from scratchlm.cli import main
from scratchlm.config import load_config
from scratchlm.data.token_file import write_token_file
from scratchlm.errors import UserError
from scratchlm.model.config import ModelConfig
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.tokenizer.train_bpe import train_bpe
from scratchlm.train.tokenizer_identity import bind_vocab_size

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.toml"
EOT = "<|endoftext|>"
HAS_HF = all(importlib.util.find_spec(name) for name in ("transformers", "tokenizers"))
SHORT_RUN = ["--set", "train.max_steps=12", "--set", "train.checkpoint_every=6", "--set", "train.eval_every=6",
             "--set", "train.eval_batches=2", "--set", "train.log_every=1", "--set", "data.batch_size=4", "--quiet"]
GREEDY = ["generate", "--prompt", "the cat", "--max-new-tokens", "20", "--temperature", "0", "--device", "cpu"]
SAMPLED = ["generate", "--max-new-tokens", "20", "--num-samples", "2", "--seed", "3", "--device", "cpu"]
EVAL = ["eval", "--batch-size", "4", "--batches", "2", "--device", "cpu"]


def cli(*argv: str) -> str:
    """stdout of a `scratchlm` command that must succeed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(argv)) == 0, argv
    return out.getvalue()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def data_args(folder: Path) -> list[str]:
    return ["--set", f"data.train_path={folder / 'train.tok'}", "--set", f"data.val_path={folder / 'valid.tok'}"]


def records(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in r.items() if "time" not in k and k != "tokens_per_s"}  # the clock differs
            for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """The original run's outputs, recorded; then its copy, with the original project renamed away."""
    root = tmp_path_factory.mktemp("portable")
    project, data = root / "project", root / "project" / "data"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "ran", "away", "home", "dog", "big", "red", "sun",
             "little", "garden", "happy", "friend", "played", "jumped", "under", "tree", "butterfly", "yesterday"]
    stories = [" ".join(rng.choice(words, size=int(rng.integers(8, 30)))) + "." for _ in range(700)]
    text = EOT.join(stories)
    (data / "corpus.txt").write_text(text, encoding="utf-8")
    tokenizer = Tokenizer(*train_bpe(str(data / "corpus.txt"), 300, [EOT]), [EOT])
    assert tokenizer.vocab_size == 300
    tokenizer.save(project / "tok")
    split = len(text) * 9 // 10
    for name, part in (("train", text[:split]), ("valid", text[split:])):
        write_token_file(data / f"{name}.tok", tokenizer.encode(part), vocab_size=tokenizer.vocab_size,
                         tokenizer_hash=tokenizer.hash)
    run = project / "runs" / "tiny"
    cli("train", "--config", str(TINY), "--run-dir", str(run), *data_args(data), *SHORT_RUN, "--set",
        f"data.tokenizer={project / 'tok'}", "--set", "model.vocab_size=none", "--set", "model.pad_vocab_to=64")
    before = {"greedy": cli(*GREEDY, "--checkpoint", str(run)), "sampled": cli(*SAMPLED, "--checkpoint", str(run)),
              "eval": cli(*EVAL, "--checkpoint", str(run), "--data", str(data / "valid.tok")),
              "train": records(run, "train"), "evals": records(run, "eval"),
              "step_12": sha256(run / "checkpoints" / "step_0000012" / "model.safetensors")}
    if HAS_HF:
        cli("export", "hf", "--checkpoint", str(run), "--out", str(root / "export-before"))
    copy = root / "elsewhere" / "copied-run"
    shutil.copytree(run, copy)
    (root / "new-data").mkdir()
    for name in ("train.tok", "valid.tok"):
        shutil.copy(data / name, root / "new-data" / name)
    project.rename(root / "gone")  # the original run, its tokenizer and its token files are no longer there
    return {"root": root, "copy": copy, "data": root / "new-data", "before": before, "tokenizer": tokenizer}


def strings(value) -> list[str]:
    """Every string inside a JSON value."""
    if isinstance(value, dict):
        return [s for v in value.values() for s in strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return [value] if isinstance(value, str) else []


def test_the_run_names_no_absolute_path_and_keeps_its_tokenizer(world):
    copy = world["copy"]
    text = (copy / "config.toml").read_text()
    values = re.findall(r'^\w+ = "(.*)"$', text, flags=re.MULTILINE)
    assert 'tokenizer = "tokenizer"' in text.splitlines() and "run_dir =" not in text
    assert values and not [v for v in values if Path(v).is_absolute()]
    for config_json in copy.glob("checkpoints/step_*/config.json"):
        found = strings(json.loads(config_json.read_text()))
        assert found and not [s for s in found if Path(s).is_absolute()], config_json
    assert str(world["root"]) not in text
    assert Tokenizer.load(copy / "tokenizer").hash == world["tokenizer"].hash


def test_a_copied_run_evaluates_and_generates_exactly_as_the_original(world):
    copy, before = world["copy"], world["before"]
    assert cli(*GREEDY, "--checkpoint", str(copy)) == before["greedy"]
    assert cli(*SAMPLED, "--checkpoint", str(copy)) == before["sampled"]
    evaluated = cli(*EVAL, "--checkpoint", str(copy), "--data", str(world["data"] / "valid.tok"))
    assert "bits/byte" in evaluated  # the run's own tokenizer was found
    assert evaluated.rsplit("  (", 1)[0] == before["eval"].rsplit("  (", 1)[0]  # all but the token file's path


@pytest.mark.skipif(not HAS_HF, reason="export hf needs the [hf] extra (transformers, tokenizers)")
def test_a_copied_run_exports_the_same_hugging_face_folder(world, tmp_path):
    cli("export", "hf", "--checkpoint", str(world["copy"]), "--out", str(tmp_path / "hf"))
    exported_before = world["root"] / "export-before"
    names = sorted(p.name for p in exported_before.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "hf").iterdir())
    for name in names:
        assert (tmp_path / "hf" / name).read_bytes() == (exported_before / name).read_bytes(), name


def test_a_copied_run_resumes_with_new_data_paths_as_the_original_went_on(world, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(world["copy"], run)
    shutil.rmtree(run / "checkpoints" / "step_0000012")  # back to step 6: resume continues from there
    # Without the token files' new place, the refusal names the key and how to give it.
    capsys.readouterr()
    assert main(["train", "--resume", "--run-dir", str(run), "--quiet"]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "data.train_path: token file" in error and "does not exist" in error
    assert "--set data.train_path=FILE" in error
    cli("train", "--resume", "--run-dir", str(run), *data_args(world["data"]), "--quiet")
    before = world["before"]
    assert records(run, "train") == before["train"] and records(run, "eval") == before["evals"]
    assert sha256(run / "checkpoints" / "step_0000012" / "model.safetensors") == before["step_12"]
    text = (run / "config.toml").read_text()
    assert f'train_path = "{os.path.relpath(world["data"] / "train.tok", run)}"' in text.splitlines()
    assert str(tmp_path) not in text and str(world["root"]) not in text
    resumed = load_config(run / "config.toml")
    assert resumed.data.train_path == str(world["data"] / "train.tok") and resumed.train.run_dir == str(run)


def test_a_resume_with_another_tokenizer_is_refused_even_with_new_paths(world, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(world["copy"], run)
    other = Tokenizer({i: bytes([i]) for i in range(256)}, [], [EOT])
    other.save(tmp_path / "other")
    text = "the cat sat on the mat. " * 200
    for name in ("train.tok", "valid.tok"):
        write_token_file(tmp_path / name, other.encode(text), vocab_size=other.vocab_size, tokenizer_hash=other.hash)
    capsys.readouterr()
    assert main(["train", "--resume", "--run-dir", str(run), "--set", f"data.tokenizer={tmp_path / 'other'}",
                 *data_args(tmp_path), "--set", "train.max_steps=18", "--quiet"]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "but this run was trained with tokenizer" in error


# ---- model.vocab_size -----------------------------------------------------------------------------------------

def test_the_trained_model_took_the_tokenizers_vocab_size_padded_to_64(world):
    config = load_config(world["copy"] / "config.toml")
    assert (config.model.vocab_size, config.model.pad_vocab_to) == (320, 64)
    assert 'vocab_size = 320' in (world["copy"] / "config.toml").read_text().splitlines()


def tiny_with(world, *overrides: str, tokenizer: bool = True):
    named = [f"data.tokenizer={world['copy'] / 'tokenizer'}"] if tokenizer else []
    return load_config(TINY, [f"data.train_path={world['data'] / 'train.tok'}", *named, *overrides])


@pytest.mark.parametrize("overrides, expected", [
    (["model.vocab_size=none"], 300),  # the tokenizer's
    (["model.vocab_size=none", "model.pad_vocab_to=64"], 320),
    (["model.vocab_size=none", "model.pad_vocab_to=100"], 300),  # already a multiple
    (["model.vocab_size=300"], 300),
    (["model.vocab_size=512"], 512),  # larger, set explicitly: padding no token uses
    (["model.vocab_size=290", "model.pad_vocab_to=64"], 320),  # padded past the tokenizer's: fine
])
def test_vocab_size_is_the_tokenizers_unless_set(world, overrides, expected):
    assert bind_vocab_size(tiny_with(world, *overrides)).model.vocab_size == expected
    # Without data.tokenizer, the size the train token file's header records (that of its tokenizer).
    assert bind_vocab_size(tiny_with(world, *overrides, tokenizer=False)).model.vocab_size == expected


@pytest.mark.parametrize("tokenizer", [True, False])
def test_a_vocab_size_below_the_tokenizers_is_refused_naming_both(world, tokenizer):
    source = f"tokenizer {world['copy'] / 'tokenizer'}" if tokenizer else \
        f"the tokenizer of data.train_path {world['data'] / 'train.tok'}"
    with pytest.raises(UserError, match=re.escape(f"model.vocab_size 256 is smaller than the 300 ids of {source}")):
        bind_vocab_size(tiny_with(world, tokenizer=tokenizer))  # the tiny preset's 256


def test_a_vocab_size_with_nothing_to_take_it_from_is_refused():
    with pytest.raises(UserError, match="model.vocab_size is not set, and neither data.tokenizer nor"):
        bind_vocab_size(load_config(TINY, ["model.vocab_size=none"]))


@given(st.integers(1, 200_000), st.integers(1, 4096))
def test_pad_vocab_to_rounds_up_to_the_next_multiple(vocab_size, multiple):
    padded = ModelConfig.preset("tiny", vocab_size=vocab_size, pad_vocab_to=multiple).vocab_size
    assert padded == math.ceil(vocab_size / multiple) * multiple
    assert ModelConfig.preset("tiny", vocab_size=padded, pad_vocab_to=multiple).vocab_size == padded  # stable


@pytest.mark.parametrize("overrides, message", [
    ({"pad_vocab_to": 0}, "model.pad_vocab_to must be a positive integer, got 0"),
    ({"vocab_size": 0}, "model.vocab_size must be a positive integer, got 0"),
])
def test_bad_vocab_settings_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.preset("tiny", **overrides)


def test_shipped_presets_keep_their_vocab_size():
    assert load_config(REPO / "configs" / "tinystories-17m.toml").model.vocab_size == 10_000
    assert load_config(TINY).model.vocab_size == 256


def test_a_model_shape_without_a_vocab_size_is_a_clear_error_outside_train(tmp_path, capsys):
    shape = tmp_path / "shape.toml"
    shape.write_text("[model]\nd_model = 64\nnum_layers = 2\nnum_heads = 4\n")
    assert main(["accounting", "--config", str(shape)]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "model.vocab_size is not set (only train takes it from a tokenizer)" in error


def test_a_finished_sweep_with_a_tokenizer_reruns_without_refusal(world, tmp_path):
    """Each point's config.toml names its own tokenizer copy, the sweep the original: not a changed setting."""
    sweep = ["sweep", "--config", str(TINY), "--grid", "optim.lr=1e-3", "--out", str(tmp_path / "sweep"),
             *data_args(world["data"]), "--set", f"data.tokenizer={world['copy'] / 'tokenizer'}",
             "--set", "model.vocab_size=none", "--set", "train.max_steps=2", "--set", "optim.warmup_iters=1",
             "--set", "train.eval_every=2", "--set", "train.eval_batches=1", "--set", "data.batch_size=2", "--quiet"]
    cli(*sweep)
    assert "already finished, skipped" in cli(*sweep)


def test_a_model_without_vocab_size_is_a_named_error():
    from scratchlm.model import ModelConfig, TransformerLM

    with pytest.raises(ValueError, match="model.vocab_size is not set"):
        TransformerLM(ModelConfig.preset("tiny", vocab_size=None))
