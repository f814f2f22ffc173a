"""`scratchlm demo`: the whole pipeline on the TinyStories fixture in seconds, plus its corpus handling.

The end-to-end test shrinks the model with --set (as a user can) so that it fits a few seconds of training;
the default settings are measured by hand (docs/experiments.md) because they take minutes by design.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchlm.cli import main
from scratchlm.demo import read_prefix, resolve_corpus, split_holdout
from scratchlm.train import resolve as resolve_module
from scratchlm.train import trainer as trainer_module
from scratchlm.train.budget import BudgetClock, plan_steps

TINY_MODEL = ["model.context_length=32", "data.batch_size=8", "model.d_model=32", "model.num_layers=1",
              "model.num_heads=2", "model.d_ff=64"]


@pytest.fixture
def fixed_plan(monkeypatch):
    """The budget's plan from a fixed step time and a clock that never runs out: the test trains the same steps
    on a fast machine and on a busy one (the real probe and clock are tested in test_budget.py)."""
    monkeypatch.setattr(resolve_module, "plan_budget",
                        lambda config, train_tokens, started=None: plan_steps(config, step_seconds=0.05, threads=1))
    monkeypatch.setattr(trainer_module, "BudgetClock",
                        lambda config, used=0.0, started=None: BudgetClock(config, used=used, clock=lambda: 0.0))


def test_demo_end_to_end_writes_every_artifact_and_prints_a_story(tinystories_sample, tmp_path, capsys, fixed_plan):
    out = tmp_path / "demo"
    args = ["demo", "--data", str(tinystories_sample), "--out", str(out), "--minutes", "0.1", "--vocab-size", "400",
            "--quiet"]
    assert main(args + [arg for item in TINY_MODEL for arg in ("--set", item)]) == 0
    printed = capsys.readouterr().out
    story = (out / "sample.txt").read_text()
    assert story.startswith("Once upon a time") and len(story) > len("Once upon a time") + 20
    assert story.strip() in printed
    for artifact in ("tokenizer/scratchlm-tokenizer.json", "data/train.tok", "data/valid.tok", "run/config.toml",
                     "run/curves.png", "run/report/report.html", "run/report/report.md"):
        assert (out / artifact).is_file(), artifact
        assert str(out / artifact.split("/")[0]) in printed
    assert any((out / "run" / "checkpoints").iterdir())
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["kind"] == "end" and records[-1]["status"] == "finished"
    assert sum(r["kind"] == "eval" for r in records) >= 2
    assert "d_model = 32" in (out / "run" / "config.toml").read_text()
    # The model leaves in a standard architecture (the recipe's SwiGLU + QK-norm: Qwen3) that transformers loads
    # without custom code, with our logits.
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and "auto_map" not in config
    hf_dir = out / "hf"
    assert f'AutoModelForCausalLM.from_pretrained("{hf_dir}")' in printed
    transformers = pytest.importorskip("transformers")
    from scratchlm.train.checkpoint import load_for_inference

    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    ours, _ = load_for_inference(out / "run")
    ids = torch.randint(0, 400, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)
    # A second demo into the same folder must not overwrite the first one's run.
    assert main(args) == 1
    assert "already holds a run" in capsys.readouterr().err


def test_missing_default_corpus_says_what_to_do(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("scratchlm.paths.shared_data_dir", lambda: None)
    monkeypatch.chdir(tmp_path)  # no downloaded TinyStories here either
    assert main(["demo", "--out", str(tmp_path / "demo")]) == 1
    err = capsys.readouterr().err
    assert "pass --data FILE" in err and "scratchlm data download tinystories" in err
    assert main(["demo", "--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "demo")]) == 1
    assert "nope.txt: no such file" in capsys.readouterr().err


def test_default_corpus_is_found_where_data_download_puts_it(monkeypatch, tmp_path):
    monkeypatch.setattr("scratchlm.paths.shared_data_dir", lambda: None)
    monkeypatch.chdir(tmp_path)
    downloaded = tmp_path / "data" / "tinystories"  # `scratchlm data download tinystories` with its defaults
    downloaded.mkdir(parents=True)
    (downloaded / "TinyStoriesV2-GPT4-train.txt").write_text("Once upon a time.\n<|endoftext|>\n")
    assert resolve_corpus(None) == (Path("data/tinystories/TinyStoriesV2-GPT4-train.txt"), None)
    (downloaded / "TinyStoriesV2-GPT4-valid.txt").write_text("The end.\n<|endoftext|>\n")
    assert resolve_corpus(None)[1] == Path("data/tinystories/TinyStoriesV2-GPT4-valid.txt")


@pytest.mark.parametrize("minutes", ["inf", "nan", "0", "-1"])
def test_minutes_must_be_positive_and_finite(tmp_path, capsys, minutes):
    assert main(["demo", "--minutes", minutes, "--out", str(tmp_path / "demo")]) == 1
    assert "--minutes must be a positive finite number" in capsys.readouterr().err


def test_holdout_keeps_whole_documents_and_at_least_the_fraction():
    docs = [f"story {i} " * (i + 3) + "\n<|endoftext|>\n" for i in range(40)]
    text = "".join(docs)
    train, valid = split_holdout(text, 0.05)
    assert train + valid == text
    assert len(valid) >= 0.05 * len(text) and valid.startswith("story") and train.endswith("<|endoftext|>\n")


def test_holdout_ignores_a_document_boundary_far_before_the_cut():
    text = "doc one\n" * 50 + "<|endoftext|>\n" + "doc two\n" * 950  # one early document end
    train, valid = split_holdout(text, 0.05)
    assert train + valid == text
    assert 0.05 * len(text) <= len(valid) <= 0.1 * len(text) and valid.startswith("doc two")


@settings(deadline=None)  # no per-example deadline: CI machines can be slow and busy
@given(st.text(alphabet="ab \n<|endoftext|>", max_size=300), st.floats(0.01, 0.5))
def test_holdout_never_loses_text_and_keeps_validation_near_the_fraction(text, fraction):
    train, valid = split_holdout(text, fraction)
    assert train + valid == text
    assert fraction * len(text) <= len(valid) < 2 * fraction * len(text) + 1


def test_read_prefix_cuts_at_a_line_end_never_inside_a_character(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("héllo wörld\n" * 10, encoding="utf-8")
    assert read_prefix(path, 1000) == "héllo wörld\n" * 10
    assert read_prefix(path, 30) == "héllo wörld\n" * 2
    path.write_text("é" * 10, encoding="utf-8")  # no line end at all: cut between characters
    assert read_prefix(path, 5) == "éé"
    path.write_bytes(b"ok\n\xff\n")
    with pytest.raises(ValueError, match="not UTF-8 text"):
        read_prefix(path, 100)


