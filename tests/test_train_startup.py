"""Starting a run reads each of its inputs once: the tokenizer is loaded once and each token file opened once,
for the vocabulary, the tokenizer's identity, the budget's probe step and the training itself (train/resolve.py)."""

from __future__ import annotations

import builtins
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from scratchlm import config as config_module
from scratchlm.cli import main
from scratchlm.config import RunConfig, load_config
from scratchlm.data import token_file
from scratchlm.data.token_file import write_token_file
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.train.trainer import train

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
BYTES = Tokenizer({byte: bytes([byte]) for byte in range(256)}, [], [])


@pytest.fixture
def world(tmp_path) -> Path:
    """The byte tokenizer in tok/, and train.tok and valid.tok encoded with it."""
    BYTES.save(tmp_path / "tok")
    rng = np.random.default_rng(0)
    for name, size in (("train", 20_000), ("valid", 2_000)):
        write_token_file(tmp_path / f"{name}.tok", rng.integers(0, 256, size), vocab_size=256,
                         tokenizer_hash=BYTES.hash)
    return tmp_path


@pytest.fixture
def reads(monkeypatch) -> Counter:
    """Counts, by path, every Tokenizer.load and every token file opened (its header read: open_token_file)."""
    counted: Counter = Counter()
    real_load = Tokenizer.load

    def load(cls, directory, **kwargs):
        counted[Path(directory).resolve()] += 1
        return real_load(directory, **kwargs)

    def open_file(path, *args, **kwargs):
        counted[Path(path).resolve()] += 1
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "load", classmethod(load))
    monkeypatch.setattr(token_file, "open", open_file, raising=False)  # the module's one open: a file's header
    return counted


def tiny(world: Path, run: str, *overrides: str) -> RunConfig:
    return load_config(TINY, [f"data.train_path={world / 'train.tok'}", f"data.val_path={world / 'valid.tok'}",
                              "model.vocab_size=none", "data.batch_size=4", "train.eval_batches=1",
                              f"train.run_dir={world / run}", *overrides])


def once(*paths: Path) -> dict[Path, int]:
    return {path.resolve(): 1 for path in paths}


def test_a_budgeted_run_reads_its_tokenizer_and_each_token_file_once(world, reads, capsys):
    config = tiny(world, "run", f"data.tokenizer={world / 'tok'}",
                  "train.budget_seconds=2")  # the probe's steps, then about 2 s of training
    result = train(config)  # not quiet: the plan's line counts the training tokens too
    assert result.status == "finished" and "s/step measured" in capsys.readouterr().err
    assert reads == once(world / "tok", world / "train.tok", world / "valid.tok")
    saved = load_config(world / "run" / "config.toml")
    assert saved.data.tokenizer_hash == BYTES.hash and saved.model.vocab_size == 256


def test_a_resume_without_config_reads_the_runs_config_toml_once(world, reads, monkeypatch):
    """`scratchlm train --run-dir RUN --resume` continues from RUN/config.toml: the CLI reads it, and the run's
    resolution (its model, dtype and budget plan) takes it from there instead of reading it again."""
    run = world / "run"
    assert train(tiny(world, "run", f"data.tokenizer={world / 'tok'}", "train.max_steps=2",
                      "optim.warmup_iters=1"), quiet=True).status == "finished"
    toml_reads: Counter = Counter()
    real_read = config_module.read_toml_tree

    def read_toml_tree(path, *args):
        toml_reads[Path(path).resolve()] += 1
        return real_read(path, *args)

    monkeypatch.setattr(config_module, "read_toml_tree", read_toml_tree)
    reads.clear()
    assert main(["train", "--run-dir", str(run), "--resume", "--quiet", "--set", "train.max_steps=3"]) == 0
    assert toml_reads == once(run / "config.toml")
    assert reads == once(run / "tokenizer", world / "train.tok", world / "valid.tok")


def test_a_run_from_init_from_reads_the_sources_tokenizer_once(world, reads):
    short = ["train.max_steps=2", "optim.warmup_iters=1"]
    train(tiny(world, "source", f"data.tokenizer={world / 'tok'}", *short), quiet=True)
    reads.clear()
    result = train(tiny(world, "tuned", f"train.init_from={world / 'source'}", *short), quiet=True,
                   model_overrides={})  # the model is the source's
    assert result.status == "finished"
    # The source's copy, read (and checked against its recorded hash) by init_from and kept by the new run.
    assert reads == once(world / "source" / "tokenizer", world / "train.tok", world / "valid.tok")
    assert load_config(world / "tuned" / "config.toml").data.tokenizer_hash == BYTES.hash
