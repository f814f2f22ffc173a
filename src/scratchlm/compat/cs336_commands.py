"""`scratchlm cs336 adapters`: write a drop-in `tests/adapters.py` for the CS336 assignment-1 repository.

The course's tests import every adapter from `tests/adapters.py`; the written module defines each one with the
course's name and parameters as a one-line call into `scratchlm.compat.cs336`. The text is generated from that
module's signatures, so the two can never drift apart; `tests/test_cs336_compat.py` checks both against the
course file's signatures. From a fresh clone of stanford-cs336/assignment1-basics:

    uv pip install /path/to/scratchlm          # into the course environment
    uv run scratchlm cs336 adapters > tests/adapters.py
    uv run pytest
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
