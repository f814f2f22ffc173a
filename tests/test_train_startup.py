"""Starting a run reads each of its inputs once: the tokenizer is loaded once and each token file opened once,
for the vocabulary, the tokenizer's identity, the budget's probe step and the training itself (train/resolve.py)."""

from __future__ import annotations

import builtins
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from scratchlm.config import load_config
from scratchlm.data import token_file
from scratchlm.data.token_file import write_token_file
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.train.trainer import train

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"


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


def test_a_budgeted_run_reads_its_tokenizer_and_each_token_file_once(tmp_path, reads, capsys):
    tokenizer = Tokenizer({byte: bytes([byte]) for byte in range(256)}, [], [])
    tokenizer.save(tmp_path / "tok")
    rng = np.random.default_rng(0)
    for name, size in (("train", 20_000), ("valid", 2_000)):
        write_token_file(tmp_path / f"{name}.tok", rng.integers(0, 256, size), vocab_size=256,
                         tokenizer_hash=tokenizer.hash)
    config = load_config(TINY, [f"data.train_path={tmp_path / 'train.tok'}", f"data.val_path={tmp_path / 'valid.tok'}",
                                f"data.tokenizer={tmp_path / 'tok'}", "model.vocab_size=none", "data.batch_size=4",
                                "train.eval_batches=1", f"train.run_dir={tmp_path / 'run'}",
                                "train.budget_seconds=2"])  # the probe steps, then about 2 s of training
    result = train(config)  # not quiet: the plan's line counts the training tokens too
    assert result.status == "finished" and "s/step measured" in capsys.readouterr().err
    assert load_config(tmp_path / "run" / "config.toml").data.tokenizer_hash == tokenizer.hash
    assert reads == {(tmp_path / "tok").resolve(): 1, (tmp_path / "train.tok").resolve(): 1,
                     (tmp_path / "valid.tok").resolve(): 1}
