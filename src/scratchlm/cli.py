"""The ``scratchlm`` command: one subcommand per stage of the pipeline.

Each stage owns its subcommand in a small ``commands`` module that exposes ``register(subparsers)``; this
file only lists them in pipeline order. Heavy imports (torch) happen inside the handlers so that
``scratchlm --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from scratchlm.errors import UserError
from scratchlm.write_errors import describe_os_error

# Pipeline order: what `scratchlm --help` lists, top to bottom.
COMMAND_MODULES = [
    "scratchlm.demo",
    "scratchlm.tokenizer.commands",
    "scratchlm.data.commands",
    "scratchlm.train.commands",
    "scratchlm.finetune.commands",
    "scratchlm.generate.commands",
    "scratchlm.serve.commands",
    "scratchlm.experiments.commands",
    "scratchlm.accounting.commands",
    "scratchlm.compat.commands",
    "scratchlm.compat.cs336_commands",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scratchlm",
        description="Build and train Transformer language models from scratch: "
        "tokenizer -> data -> model -> train -> generate.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)  # a failing import is a bug: let it show
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader left (`generate | head`): stop quietly, as head's other writers do
        _silence_stdout()
        return 0
    except OSError as error:  # missing file, a folder given for a file, full disk: named by the library
        print(f"scratchlm {args.command}: error: {describe_os_error(error)}", file=sys.stderr)
        return 1
    except (UserError, ValueError) as error:
        print(f"scratchlm {args.command}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"scratchlm {args.command}: interrupted", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not hit the closed pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    raise SystemExit(main())
