"""`scratchlm data ACTION`: prepare training data.

Each action is one small ``_register_<action>(actions)`` + handler pair, here (``encode``) or in the action's
own module (``download``); adding an action means writing one more pair and listing it in ``ACTIONS``.
"""

from __future__ import annotations

import argparse
import sys

from scratchlm.data.download import register_download
from scratchlm.workers import default_workers


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", description="Prepare training data.",
                                   help="prepare training data: download a corpus, encode text into token files")
    actions = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    for register_action in ACTIONS:
        register_action(actions)


def _register_encode(actions) -> None:
    parser = actions.add_parser(
        "encode", help="encode text files into a memory-mappable token file",
        description="Encode text files with a trained tokenizer into one token file (uint16 ids when the vocab "
                    "fits, else uint32) that records the vocab size and the tokenizer's hash. Files are encoded "
                    "in order, in parallel processes and constant memory; the output appears only when complete.")
    parser.add_argument("--tokenizer", required=True, metavar="DIR",
                        help="tokenizer directory (from `scratchlm tokenizer train`, or GPT-2 vocab.json+merges.txt)")
    parser.add_argument("--input", required=True, nargs="+", metavar="FILE", help="UTF-8 text file(s)")
    parser.add_argument("--out", required=True, metavar="FILE", help="token file to write")
    parser.add_argument("--workers", type=_positive_int, default=default_workers(), metavar="N",
                        help="processes (default: usable CPUs, at most 8)")
    parser.add_argument("--errors", choices=["strict", "replace"], default="strict",
                        help="invalid UTF-8: stop naming file and byte offset (strict, default), "
                             "or substitute U+FFFD (replace)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    parser.add_argument("--force", action="store_true", help="replace an existing --out that is not a token file")
    parser.set_defaults(func=run_encode)


def run_encode(args: argparse.Namespace) -> int:
    from scratchlm.data.encode import encode_corpus

    _check_encode_output(args)
    progress = not args.quiet and sys.stderr.isatty()
    stats = encode_corpus(args.tokenizer, args.input, args.out, workers=args.workers, errors=args.errors,
                          progress=progress)
    if not args.quiet:
        print(f"encoded {len(args.input)} file{'s' if len(args.input) != 1 else ''}: {stats.summary()} -> {args.out}")
    return 0


def _check_encode_output(args: argparse.Namespace) -> None:
    """--out is never an input (a text file or a tokenizer file), and replaces only an earlier token file."""
    from pathlib import Path

    from scratchlm.data.token_file import open_token_file
    from scratchlm.errors import UserError
    from scratchlm.output_paths import refuse_inputs

    out, tokenizer = Path(args.out), Path(args.tokenizer)
    if out.is_dir():
        return  # the token file writer names that problem
    tokenizer_files = list(tokenizer.iterdir()) if tokenizer.is_dir() else []
    refuse_inputs(out, [*map(Path, args.input), *tokenizer_files], inside_ok=True)
    if out.is_file() and not args.force:
        try:
            open_token_file(out)
        except ValueError:
            raise UserError(f"--out {out} exists and is not a token file; choose another --out, or pass --force "
                            f"to replace it") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


ACTIONS = [_register_encode, register_download]
