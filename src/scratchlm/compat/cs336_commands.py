"""`scratchlm cs336 adapters`: write a drop-in `tests/adapters.py` for the CS336 assignment-1 repository.

The course's tests import every adapter from `tests/adapters.py`; the written module defines each one with the
course's name and parameters as a one-line call into `scratchlm.compat.cs336`. The text is generated from that
module's signatures, so the two can never drift apart; `tests/test_cs336_compat.py` checks both against the
course file's signatures. From a fresh clone of stanford-cs336/assignment1-basics:

    uv pip install /path/to/scratchlm          # into the course environment
    uv run scratchlm cs336 adapters > tests/adapters.py
    uv run pytest

It also holds the options that let `scratchlm eval` and `scratchlm generate` read a CS336-style checkpoint
(`--cs336-checkpoint FILE` with the model's shape from `--model-config TOML`, `--preset` and `--set model.*`).
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

LINE_LENGTH = 120  # the course repository's ruff setting

EPILOG = """examples:
  scratchlm cs336 adapters > tests/adapters.py       # in a clone of stanford-cs336/assignment1-basics
  scratchlm cs336 adapters --out tests/adapters.py"""

HEADER = '''"""CS336 assignment-1 adapters backed by scratchlm (written by `scratchlm cs336 adapters`).

Each adapter has the course's name and parameters and calls the function of the same name in
`scratchlm.compat.cs336`. Replace any body with a call into your own code to test your implementation of that
piece while scratchlm provides the rest.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import IO, Any, BinaryIO

import numpy as np
import torch
from torch import Tensor, nn

from scratchlm.compat import cs336
from scratchlm.tokenizer import Tokenizer
'''


def register(subparsers: argparse._SubParsersAction) -> None:
    cs336 = subparsers.add_parser("cs336", help="Stanford CS336 assignment 1: adapters for its tests",
                                  description="Tools for the Stanford CS336 assignment-1 repository.")
    tools = cs336.add_subparsers(dest="cs336_command", metavar="TOOL", required=True)
    adapters = tools.add_parser("adapters", help="print a drop-in tests/adapters.py that calls scratchlm",
                                description="Write the course's tests/adapters.py with every adapter calling "
                                            "scratchlm.compat.cs336 (to stdout, or to --out).",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    adapters.add_argument("--out", type=Path, help="file to write (default: standard output)")
    adapters.set_defaults(func=run_adapters)


def run_adapters(args: argparse.Namespace) -> int:
    source = adapters_source()
    if args.out is None:
        sys.stdout.write(source)
    else:
        args.out.write_text(source, encoding="utf-8")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def adapters_source() -> str:
    """The text of `tests/adapters.py`: one forwarding function per public function of `scratchlm.compat.cs336`."""
    from scratchlm.compat import cs336

    functions = [function for name, function in inspect.getmembers(cs336, inspect.isfunction)
                 if not name.startswith("_") and function.__module__ == cs336.__name__]
    functions.sort(key=lambda function: function.__code__.co_firstlineno)  # the course file's order
    return HEADER + "".join(_forwarder(function) for function in functions)


def _forwarder(function) -> str:
    """`def name(<the same parameters>) -> <same return>: return cs336.name(<each parameter>)`."""
    signature = inspect.signature(function)  # annotations stay strings: cs336.py uses `from __future__`
    parameters, arguments = [], []
    for parameter in signature.parameters.values():
        text = parameter.name if parameter.annotation is inspect.Parameter.empty \
            else f"{parameter.name}: {parameter.annotation}"
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            parameters.append(f"**{text}")
            arguments.append(f"**{parameter.name}")
            continue
        if parameter.default is not inspect.Parameter.empty:
            text += f" = {parameter.default!r}"
        parameters.append(text)
        arguments.append(parameter.name)
    returns = "" if signature.return_annotation is inspect.Signature.empty else f" -> {signature.return_annotation}"
    head = f"def {function.__name__}({', '.join(parameters)}){returns}:"
    call = f"    return cs336.{function.__name__}({', '.join(arguments)})"
    if len(head) > LINE_LENGTH:  # the course file's layout: one parameter a line
        head = f"def {function.__name__}(\n" + "".join(f"    {text},\n" for text in parameters) + f"){returns}:"
    if len(call) > LINE_LENGTH:
        listed = "".join(f"        {name},\n" for name in arguments)
        call = f"    return cs336.{function.__name__}(\n{listed}    )"
    return f"\n\n{head}\n{call}\n"


# ---------------------------------------------------------------------------------- --cs336-checkpoint option

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
