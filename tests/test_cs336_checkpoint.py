"""`scratchlm eval` / `generate` with `--cs336-checkpoint`: a course-style torch.save file of our model's state dict
gives the same loss and the same text as the run directory holding the same weights; bad files are one line."""

from __future__ import annotations

import argparse

import pytest
import torch

from scratchlm.cli import main
from scratchlm.compat import cs336
from scratchlm.compat.cs336_checkpoint import load_cs336_model, read_cs336_checkpoint
from scratchlm.model import ModelConfig, TransformerLM

SHAPE = ["--preset", "tiny", "--set", "model.vocab_size=257"]  # 256 bytes + <|endoftext|>


@pytest.fixture(scope="module")
def course_files(tmp_path_factory):
    """A run directory and, beside it, the same weights as the course's run_save_checkpoint writes them."""
    from scratchlm.compat.commands import write_run
    from scratchlm.data.token_file import write_token_file
    from scratchlm.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("cs336")
    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size))
    optimizer = cs336.get_adamw_cls()(model.parameters(), lr=1e-3)
    model(torch.randint(0, 257, (2, 16))).sum().backward()
    optimizer.step()  # a trained step, so the optimizer state is not empty
    model.eval()
    write_run(model, tokenizer, folder / "run")
    cs336.run_save_checkpoint(model, optimizer, 123, folder / "ckpt.pt")
    text = "Once upon a time there was a tiny model. " * 20
    write_token_file(folder / "valid.tok", tokenizer.encode(text), vocab_size=257)
    return folder, model


def _saved_with(folder, name, edit):
    """A copy of ckpt.pt whose model state dict went through `edit`."""
    saved = torch.load(folder / "ckpt.pt", weights_only=True)
    saved["model"] = edit(dict(saved["model"]))
    torch.save(saved, folder / name)
    return folder / name


def test_reader_returns_the_state_dict_and_iteration(course_files):
    folder, model = course_files
    state, iteration = read_cs336_checkpoint(folder / "ckpt.pt")
    assert iteration == 123 and state.keys() == model.state_dict().keys()
    compiled = _saved_with(folder, "compiled.pt", lambda sd: {f"_orig_mod.{k}": v for k, v in sd.items()})
    loaded, _ = load_cs336_model(compiled, model.config)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_generate_from_a_cs336_checkpoint_equals_the_run(course_files, capsys):
    folder, _ = course_files
    argv = ["generate", "--prompt", "Once", "--max-new-tokens", "24", "--temperature", "0.9", "--seed", "3"]
    assert main([*argv, "--checkpoint", str(folder / "run")]) == 0
    from_run = capsys.readouterr().out
    assert main([*argv, "--cs336-checkpoint", str(folder / "ckpt.pt"), *SHAPE,
                 "--tokenizer", str(folder / "run" / "tokenizer")]) == 0
    assert capsys.readouterr().out == from_run
    # the shape from a run config; its data.tokenizer comes along, so no --tokenizer
    assert main([*argv, "--cs336-checkpoint", str(folder / "ckpt.pt"),
                 "--model-config", str(folder / "run" / "config.toml")]) == 0
    assert capsys.readouterr().out == from_run


def test_eval_of_a_cs336_checkpoint_equals_the_run(course_files, capsys):
    folder, model = course_files
    argv = ["eval", "--data", str(folder / "valid.tok"), "--batch-size", "4", "--batches", "3", "--device", "cpu"]
    assert main([*argv, "--checkpoint", str(folder / "run")]) == 0
    from_run = capsys.readouterr().out
    # the run's own tokenizer, for bits per byte (a bare course checkpoint names none)
    assert main([*argv, "--cs336-checkpoint", str(folder / "ckpt.pt"), *SHAPE, "--tokenizer",
                 str(folder / "run" / "tokenizer")]) == 0
    assert capsys.readouterr().out == from_run
    # and a different model gives a different loss: the file's weights are really the ones evaluated
    other = _saved_with(folder, "scaled.pt", lambda sd: {k: v * 1.5 for k, v in sd.items()})
    assert main([*argv, "--cs336-checkpoint", str(other), *SHAPE]) == 0
    assert capsys.readouterr().out != from_run


def _bad_files(folder):
    (folder / "garbage.pt").write_bytes(b"not a checkpoint at all")
    torch.save({"model": {}, "args": argparse.Namespace(lr=1)}, folder / "code.pt")  # a global outside weights_only
    torch.save({"weights": {}}, folder / "nomodel.pt")
    _saved_with(folder, "missing.pt", lambda sd: {k: v for k, v in sd.items() if k != "ln_final.weight"})
    _saved_with(folder, "renamed.pt", lambda sd: {k.replace("output_proj", "o_proj"): v for k, v in sd.items()})


@pytest.mark.parametrize("argv, message", [
    (["--cs336-checkpoint", "{f}/ckpt.pt"], "holds no model shape"),
    (["--cs336-checkpoint", "{f}/ckpt.pt", "--checkpoint", "{f}/run", *SHAPE], "either --checkpoint"),
    ([], "either --checkpoint"),
    (["--checkpoint", "{f}/run", "--preset", "tiny"], "records its own shape"),
    (["--cs336-checkpoint", "{f}/absent.pt", *SHAPE], "no CS336 checkpoint file"),
    (["--cs336-checkpoint", "{f}/garbage.pt", *SHAPE], "weights_only=True"),
    (["--cs336-checkpoint", "{f}/code.pt", *SHAPE], "weights_only=True"),
    (["--cs336-checkpoint", "{f}/nomodel.pt", *SHAPE], "found ['weights']"),
    (["--cs336-checkpoint", "{f}/missing.pt", *SHAPE], "missing tensors ['ln_final.weight']"),
    (["--cs336-checkpoint", "{f}/renamed.pt", *SHAPE], "'layers.0.attn.o_proj.weight'"),
    (["--cs336-checkpoint", "{f}/ckpt.pt", *SHAPE, "--set", "model.d_ff=96"], "'layers.0.ffn.w1.weight' has shape"),
    (["--cs336-checkpoint", "{f}/ckpt.pt", *SHAPE, "--set", "optim.lr=1"], "only takes model.* overrides"),
])
@pytest.mark.parametrize("command", ["eval", "generate"])
def test_bad_checkpoints_are_one_line_errors(course_files, capsys, command, argv, message):
    folder, _ = course_files
    _bad_files(folder)
    extra = ["--data", str(folder / "valid.tok")] if command == "eval" else ["--tokenizer", str(folder / "run")]
    assert main([command, *extra, *(a.format(f=folder) for a in argv)]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
