"""A plain install (no extras): a missing optional package is one line naming the pip extra, and training runs
without matplotlib (one warning, no curves.png). Packages are made "missing" with ``sys.modules[name] = None``,
which makes ``import name`` raise ModuleNotFoundError as if it were not installed. scripts/check_wheel.sh does
the same with a real wheel in a fresh virtualenv."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import torch_threads
from scratchlm.cli import main as cli_main
from scratchlm.config import load_config
from scratchlm.data.token_file import write_token_file
from scratchlm.extras import MissingExtra, optional_import, require
from scratchlm.train.trainer import train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def hide(monkeypatch, *names: str) -> None:
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def test_require_returns_an_installed_module():
    assert require("json", "none", "a test") is sys.modules["json"]


def test_require_names_the_extra_of_a_missing_package(monkeypatch):
    hide(monkeypatch, "transformers")
    with pytest.raises(MissingExtra) as caught:
        require("transformers", "hf", "scratchlm export hf")
    assert str(caught.value) == ("scratchlm export hf needs the transformers package, which is not installed: "
                                 "pip install 'scratchlm[hf]'")
    assert optional_import("transformers") is None


def test_a_broken_install_is_not_reported_as_a_missing_extra(tmp_path, monkeypatch):
    """The package is there but one of ITS imports fails: that error must surface, not "install the extra"."""
    (tmp_path / "halfinstalled").mkdir()
    (tmp_path / "halfinstalled" / "__init__.py").write_text("import a_dependency_that_is_not_there\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="a_dependency_that_is_not_there"):
        optional_import("halfinstalled")


@pytest.mark.parametrize("argv, extra_line", [
    (["export", "hf", "--checkpoint", "nowhere", "--out", "out"], "scratchlm export hf needs the transformers"),
    (["import", "hf", "--model", "nowhere", "--out", "out"], "scratchlm import hf needs the transformers"),
])
def test_hf_commands_without_the_hf_extra_say_so_in_one_line(argv, extra_line, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    hide(monkeypatch, "transformers")
    assert cli_main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and extra_line in err and "pip install 'scratchlm[hf]'" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["export", "gguf", "--checkpoint", "nowhere", "--out", "out.gguf"],
                                  ["import", "gguf", "nowhere.gguf", "--out", "out"]])
def test_gguf_commands_without_the_gguf_extra_say_so_in_one_line(argv, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    hide(monkeypatch, "gguf")
    assert cli_main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"scratchlm {argv[0]} gguf needs the gguf package" in err
    assert "pip install 'scratchlm[gguf]'" in err and not list(tmp_path.iterdir())


def test_hf_export_needs_tokenizers_too(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    hide(monkeypatch, "tokenizers")
    assert cli_main(["export", "hf", "--checkpoint", "nowhere", "--out", "out"]) == 1
    assert "needs the tokenizers package" in capsys.readouterr().err


def test_report_without_matplotlib_names_the_plot_extra(monkeypatch, capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 1.0, "wall_time": 1.0}\n')
    hide(monkeypatch, "matplotlib")
    code = cli_main(["report", str(run), "--out", str(tmp_path / "report")])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert "pip install 'scratchlm[plot]'" in err


def test_training_without_matplotlib_warns_once_and_draws_nothing(tmp_path, monkeypatch, capsys):
    tokens = np.frombuffer(b"the cat sat on the mat. a dog ran to the park. " * 60, dtype=np.uint8)
    write_token_file(tmp_path / "t.tok", tokens, vocab_size=256)
    config = load_config(CONFIGS / "tiny.toml", [
        f"data.train_path={tmp_path / 't.tok'}", f"data.val_path={tmp_path / 't.tok'}", "data.batch_size=2",
        f"train.run_dir={tmp_path / 'run'}", "train.max_steps=4", "train.log_every=2", "train.eval_every=2",
        "train.eval_batches=1", "train.checkpoint_every=4", "optim.warmup_iters=1"])
    hide(monkeypatch, "matplotlib", "matplotlib.pyplot")
    with torch_threads(1):
        result = train(config, quiet=True)
    assert result.status == "finished" and result.final_step == 4
    warnings = [line for line in capsys.readouterr().err.splitlines() if "matplotlib" in line]
    assert warnings == ["scratchlm: warning: matplotlib is not installed, so no curves.png is drawn "
                        "(pip install 'scratchlm[plot]')"]
    assert not (tmp_path / "run" / "curves.png").exists()
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count('"kind": "eval"') == 2
