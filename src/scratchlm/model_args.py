"""Which model a command loads: `--checkpoint RUN`, or a CS336-style checkpoint file and its shape.

`scratchlm eval` and `scratchlm generate` read a run directory (train/checkpoint.py `load_for_inference`), or a
file saved by the course's `run_save_checkpoint` (`--cs336-checkpoint FILE`), which holds no shape: that comes
from `--model-config TOML`, `--preset` and `--set model.*` (compat/cs336_checkpoint.py reads the file).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_cs336_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """Options for a command that otherwise takes `--checkpoint RUN`: a CS336 file and the model's shape."""
    group = parser.add_argument_group(
        "a CS336-style checkpoint instead of --checkpoint",
        "torch.save({'model': state_dict, 'optimizer': ..., 'iteration': int}) with the reference names; the "
        "file holds no shape, so give it with --model-config and/or --preset and --set model.KEY=VALUE")
    group.add_argument("--cs336-checkpoint", type=Path, metavar="FILE", help="checkpoint file (run_save_checkpoint)")
    group.add_argument("--model-config", type=Path, metavar="TOML",
                       help="run config whose [model] is the checkpoint's shape (its data.tokenizer is used too)")
    group.add_argument("--preset", help="model preset that is the checkpoint's shape, e.g. tinystories-17m")
    group.add_argument("--set", action="append", default=[], dest="model_overrides", metavar="model.KEY=VALUE",
                       help="override a model field of the shape, e.g. model.num_layers=4 (repeatable)")


def load_model_for_command(args: argparse.Namespace, device):
    """(model in eval mode, RunConfig) from `--checkpoint RUN` or from `--cs336-checkpoint FILE` + its shape."""
    from scratchlm.compat.cs336_checkpoint import load_cs336_model
    from scratchlm.errors import UserError
    from scratchlm.train.checkpoint import load_for_inference

    shape_given = args.model_config is not None or args.preset is not None or bool(args.model_overrides)
    if (args.checkpoint is None) == (args.cs336_checkpoint is None):
        raise UserError("give either --checkpoint RUN or --cs336-checkpoint FILE (with its model shape)")
    if args.checkpoint is not None:
        if shape_given:
            raise UserError("--model-config, --preset and --set describe a --cs336-checkpoint; a run directory "
                            "records its own shape")
        return load_for_inference(args.checkpoint, device=device)
    if not shape_given:
        raise UserError(f"{args.cs336_checkpoint} holds no model shape: give --model-config TOML or --preset NAME "
                        f"(and --set model.KEY=VALUE)")
    config = shape_run_config(args.model_config, args.preset, args.model_overrides, "--cs336-checkpoint")
    model, _ = load_cs336_model(args.cs336_checkpoint, config.model, device=device)
    return model, config


def shape_run_config(config_path: Path | None, preset: str | None, overrides: list[str], who: str):
    """RunConfig from a TOML file, or a preset, with `model.*` overrides; other sections keep their defaults."""
    from scratchlm.config import RunConfig, apply_overrides, load_config
    from scratchlm.errors import UserError

    foreign = [item for item in overrides if not item.strip().startswith("model.")]
    if foreign:
        raise UserError(f"{who} only takes model.* overrides, got {foreign}")
    if preset is not None:
        overrides = [f"model.preset={preset}", *overrides]  # a preset replaces the file's [model] (config.py)
    if config_path is not None:
        config = load_config(config_path, overrides)
    else:
        values: dict = {}
        apply_overrides(values, overrides)
        config = RunConfig.from_dict(values)
    if config.model.vocab_size is None:  # only train knows the tokenizer it would take the size from
        raise UserError("model.vocab_size is not set (only train takes it from a tokenizer): give it with --set "
                        "model.vocab_size=N")
    return config
