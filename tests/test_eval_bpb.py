"""`scratchlm eval` reports bits per byte beside loss and perplexity: its loss is the trainer's `evaluate` on the
same windows, and its bits per byte is that loss in bits over the UTF-8 bytes the scored tokens decode to,
computed here independently; with no tokenizer known it says so on stderr and reports loss alone."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from scratchlm.cli import main as cli_main
from scratchlm.data.token_file import open_token_file
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.train.checkpoint import load_for_inference
from scratchlm.train.step import evaluate
from tiny_runs import text_tokenizer, train_tiny_run

TEXT = "the cat sat on the mat. a dog ran to the park! we like red apples.<|endoftext|>" * 40


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("bpb")
    run_dir = train_tiny_run(folder, text_tokenizer(folder, TEXT), TEXT, steps=6, batch_size=4)
    return {"run": run_dir, "tokens": folder / "t.tok", "tokenizer": folder / "tok"}


def eval_line(run: dict[str, Path], capsys, *extra: str) -> tuple[str, str]:
    assert cli_main(["eval", "--checkpoint", str(run["run"]), "--data", str(run["tokens"]), "--batch-size", "2",
                     "--batches", "3", "--device", "cpu", *extra]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_eval_bits_per_byte_matches_an_independent_count(run, capsys):
    out, _ = eval_line(run, capsys)
    loss, bits = (float(x) for x in re.fullmatch(r"loss (\S+)  perplexity \S+  bits/byte (\S+)  \(.*\)\n",
                                                   out).groups())
    model, config = load_for_inference(run["run"], device="cpu")
    context = config.model.context_length
    config = config.with_overrides(["data.batch_size=2", "train.grad_accum_steps=1"])
    tokens = open_token_file(run["tokens"]).tokens
    expected_loss = evaluate(model, tokens, config, torch.device("cpu"), max_batches=3)
    assert loss == pytest.approx(expected_loss, abs=1e-4)
    tokenizer = Tokenizer.load(run["tokenizer"])
    targets = [int(t) for t in tokens[1:3 * 2 * context + 1]]  # 3 batches of 2 windows
    eot = tokenizer.special_id("<|endoftext|>")
    assert eot in targets  # the special token counts as one byte, not its 13 characters
    num_bytes = sum(1 if t == eot else len(tokenizer.decode_bytes([t])) for t in targets)
    assert num_bytes > len(targets)  # merges make tokens longer than a byte: bpb differs from loss / ln 2
    assert bits == pytest.approx(expected_loss * len(targets) / math.log(2) / num_bytes, abs=2e-4)


def test_eval_without_a_known_tokenizer_reports_loss_and_says_why(run, capsys, tmp_path):
    moved = tmp_path / "run"
    shutil.copytree(run["run"], moved)
    shutil.rmtree(moved / "tokenizer")  # no run copy (which data.tokenizer names); the original hidden too
    original = run["tokenizer"].rename(run["tokenizer"].with_name("tok-away"))
    try:
        out, err = eval_line({**run, "run": moved}, capsys)
    finally:
        original.rename(run["tokenizer"])
    assert "bits/byte" not in out and out.startswith("loss ")
    assert err.startswith("scratchlm eval: note: no bits per byte (") and err.count("\n") == 1


def test_eval_refuses_a_given_tokenizer_of_another_run(run, capsys, tmp_path):
    other = Tokenizer({i: bytes([i]) for i in range(256)}, [])
    other.save(tmp_path / "other")
    assert cli_main(["eval", "--checkpoint", str(run["run"]), "--data", str(run["tokens"]), "--device", "cpu",
                     "--tokenizer", str(tmp_path / "other")]) == 1
    assert "was trained with tokenizer" in capsys.readouterr().err
