"""RunConfig: TOML loading with extends/presets, typed dotted overrides, clear errors, exact round-trips."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchlm.config import RunConfig, load_config, parse_value, to_toml
from scratchlm.model.config import PRESETS, ModelConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return write(tmp_path / "base.toml", """
[model]
preset = "tiny"
[data]
train_path = "data/train.bin"
batch_size = 8
[optim]
warmup_iters = 2
[train]
max_steps = 20
""")


def test_preset_and_file_values(base: Path):
    config = load_config(base)
    assert config.model == ModelConfig.preset("tiny")
    assert config.data.batch_size == 8 and config.train.max_steps == 20
    assert config.data.train_path == str(base.parent / "data" / "train.bin")  # relative to the config's folder


def test_extends_merges_tables_child_wins(base: Path):
    (base.parent / "sub").mkdir()
    child = write(base.parent / "sub" / "child.toml", """
extends = "../base.toml"
[model]
d_model = 128
[optim]
lr = 3e-3
betas = [0.9, 0.99]
warmup_iters = 5
""")
    config = load_config(child)
    assert config.model.d_model == 128 and config.model.num_layers == PRESETS["tiny"]["num_layers"]
    assert config.optim.lr == 3e-3 and config.optim.betas == (0.9, 0.99)
    assert config.data.batch_size == 8  # inherited
    assert config.data.train_path == str(base.parent / "data" / "train.bin")  # relative to base.toml's folder


def test_overrides_are_parsed_to_field_types(base: Path):
    config = load_config(base, ["optim.lr=3e-3", "train.compile=true", "optim.betas=0.8,0.9", "model.d_model=32",
                                "optim.cosine_cycle_iters=none", "train.max_loss=12", "data.val_path=v.bin"])
    assert config.optim.lr == 3e-3 and isinstance(config.optim.lr, float)
    assert config.train.compile is True and config.optim.betas == (0.8, 0.9)
    assert config.model.d_model == 32 and config.optim.cosine_cycle_iters is None
    assert config.train.max_loss == 12.0 and config.data.val_path == str(Path.cwd() / "v.bin")  # --set: cwd


@pytest.mark.parametrize(("override", "message"), [
    ("optim.lrr=1", "valid keys: ['betas', 'cosine_cycle_iters', 'decay_fraction', 'decay_shape'"),
    ("foo.x=1", "valid keys: ['data', 'model', 'optim', 'train']"),
    ("train.max_steps=abc", "train.max_steps='abc': expected int"),
    ("train.max_steps=1.5", "expected int"),
    ("train.compile=maybe", "expected bool"),
    ("train.seed=-3", "train.seed must be >= 0, got -3"),
    ("optim.betas=0.9", "expected a list of float, float"),
    ("optim.lr", "must look like section.key=value"),
    ("lr=3", "must look like section.key=value"),
])
def test_bad_overrides(base: Path, override: str, message: str):
    with pytest.raises(ValueError) as info:
        load_config(base, [override])
    assert message in str(info.value)


@pytest.mark.parametrize(("text", "message"), [
    ("[optim]\nlearning_rate = 1.0", "unknown key(s) ['learning_rate'] in [optim]; valid keys: ['betas'"),
    ("[trian]\nseed = 1", "unknown key(s) ['trian'] in config"),
    ("[train]\nmax_steps = \"ten\"", "train.max_steps must be int, got 'ten' (str)"),
    ("[train]\ncompile = 1", "train.compile must be bool"),
    ("[optim]\nlr = true", "optim.lr must be float"),
    ("[optim]\nbetas = [0.9]", "optim.betas must be a list of float, float"),
    ("[model]\nd_model = 100\nnum_heads = 3", "d_model (100) must be divisible by model.num_heads (3)"),
    ("[optim]\nwarmup_iters = 50", "optim.warmup_iters (50) must not exceed train.max_steps (20)"),
    ("[train]\ngrad_accum_steps = 3", "data.batch_size (8) must be divisible by train.grad_accum_steps (3)"),
    ("[optim]\nmin_lr = 1.0\nlr = 0.1", "optim.min_lr must be in [0, optim.lr=0.1]"),
    ("[train]\ndtype = \"fp8\"", "train.dtype must be one of ('fp32', 'bf16', 'fp16', 'auto')"),
    ("[train]\ndevice = \"gpu\"", "train.device must be auto, cpu, mps, cuda or cuda:N"),
    ("[train]\ndevice = \"cpu\\n\"", "train.device must be auto, cpu, mps, cuda or cuda:N"),
    ("[model]\npreset = \"huge\"", "unknown model preset 'huge'"),
    ("[data]\nbatch_size = 0", "data.batch_size must be positive"),
    ("[train]\nseed = -1", "train.seed must be >= 0, got -1"),
    ("[optim]\nwarmup_iters = 0\ncosine_cycle_iters = 0", "optim.cosine_cycle_iters must be >= 1 (or none"),
    ("optim = 3", "config section [optim] must be a table"),
    ("[train\n", "invalid TOML"),
])
def test_bad_files_name_the_file_and_problem(base: Path, text: str, message: str):
    path = write(base.parent / "bad.toml", 'extends = "base.toml"\n' + text)
    with pytest.raises(ValueError) as info:
        load_config(path)
    assert message in str(info.value) and "bad.toml" in str(info.value)


def test_missing_file_and_extends_cycle(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="nope.toml"):
        load_config(tmp_path / "nope.toml")
    write(tmp_path / "a.toml", 'extends = "b.toml"')
    write(tmp_path / "b.toml", 'extends = "a.toml"')
    with pytest.raises(ValueError, match="extends itself"):
        load_config(tmp_path / "a.toml")


def test_save_toml_round_trip(base: Path, tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    config = load_config(base, ["optim.lr=0.1234567890123", "data.tokenizer=tok dir/\"q\"", f"train.run_dir={run}"])
    config.save_toml(run / "config.toml")
    assert load_config(run / "config.toml") == config
    assert RunConfig.from_dict(config.to_dict()) == config


def test_a_saved_config_holds_paths_relative_to_its_run_and_moves_with_it(base: Path, tmp_path: Path):
    run = tmp_path / "project" / "runs" / "a"
    run.mkdir(parents=True)
    config = load_config(base, [f"data.tokenizer={run / 'tokenizer'}", f"train.run_dir={run}",
                                f"data.val_path={tmp_path / 'elsewhere' / 'valid.tok'}"])
    config.save_toml(run / "config.toml")
    text = (run / "config.toml").read_text()
    assert "run_dir =" not in text  # the run directory is the folder the file is in
    for line in ('tokenizer = "tokenizer"', 'train_path = "../../../data/train.bin"',
                 'val_path = "../../../elsewhere/valid.tok"'):
        assert f"\n{line}\n" in text
    (tmp_path / "deeper").mkdir()
    shutil.move(tmp_path / "project", tmp_path / "deeper" / "moved")
    moved = tmp_path / "deeper" / "moved" / "runs" / "a"
    loaded = load_config(moved / "config.toml")
    assert loaded.train.run_dir == str(moved) and loaded.data.tokenizer == str(moved / "tokenizer")
    # A token file keeps its place relative to the run: one that did not move along is given anew to train on.
    assert loaded.data.train_path == str(tmp_path / "deeper" / "data" / "train.bin")
    assert (loaded.model, loaded.optim, loaded.train.max_steps) == (config.model, config.optim, config.train.max_steps)


def test_a_users_config_keeps_its_run_dir_relative_to_the_working_directory(tmp_path: Path):
    user = write(tmp_path / "user.toml", '[model]\npreset = "tiny"\n[train]\nrun_dir = "runs/x"\n')
    assert load_config(user).train.run_dir == "runs/x"


def test_with_overrides(base: Path):
    config = load_config(base).with_overrides(["train.seed=7"])
    assert config.train.seed == 7 and config.model == ModelConfig.preset("tiny")


@pytest.mark.parametrize("name", sorted(str(p.relative_to(CONFIGS)) for p in CONFIGS.rglob("*.toml")))
def test_shipped_configs_load(name: str):
    config = load_config(CONFIGS / name)
    assert config.train.max_steps >= config.optim.warmup_iters


def test_parse_value_types():
    assert parse_value("1_000", int, "x") == 1000
    assert parse_value("1e6", float, "x") == 1e6
    assert parse_value("(0.9, 0.95)", tuple[float, float], "x") == (0.9, 0.95)
    assert parse_value("null", int | None, "x") is None and parse_value("4", int | None, "x") == 4
    assert parse_value("No", bool, "x") is False


finite = st.floats(allow_nan=False, allow_infinity=False, min_value=1e-12, max_value=1e6)


@settings(max_examples=60, deadline=None)
@given(lr=finite, seed=st.integers(0, 2**62), run_dir=st.text(min_size=1, max_size=20), compile_=st.booleans(),
       beta=st.floats(min_value=0, max_value=0.999))
def test_toml_round_trip_property(lr: float, seed: int, run_dir: str, compile_: bool, beta: float):
    import tomllib

    config = RunConfig.from_dict({"optim": {"lr": lr, "min_lr": 0.0, "betas": [beta, beta]},
                                  "train": {"seed": seed, "run_dir": run_dir, "compile": compile_}})
    assert RunConfig.from_dict(tomllib.loads(to_toml(config.to_dict()))) == config


def test_preset_override_replaces_the_model(base: Path):
    config = load_config(base, ["model.preset=tinystories-17m", "model.num_layers=2"])
    assert config.model == ModelConfig.preset("tinystories-17m", num_layers=2)
    assert load_config(base).with_overrides(["model.preset=gpt2-small"]).model == ModelConfig.preset("gpt2-small")


def test_config_that_is_a_folder_is_a_clear_error(tmp_path: Path):
    with pytest.raises(ValueError, match="is a folder, not a TOML file"):
        load_config(tmp_path)


def test_tf32_is_a_train_switch_that_only_touches_cuda():
    import torch

    from scratchlm.train.setup import set_matmul_precision

    assert RunConfig().train.tf32 is True
    before = torch.backends.cuda.matmul.allow_tf32
    set_matmul_precision(torch.device("cpu"), not before)
    assert torch.backends.cuda.matmul.allow_tf32 == before  # CPU runs leave the CUDA flag alone
