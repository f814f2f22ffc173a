"""`scratchlm data ACTION`: prepare training data.

Each action is one small ``_register_<action>(actions)`` + handler pair, here (``encode``) or in the action's
own module (``download``); adding an action means writing one more pair and listing it in ``ACTIONS``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scratchlm.data.download import register_download
from scratchlm.data.input_arguments import add_input_arguments
from scratchlm.errors import UserError
from scratchlm.finetune.commands import register_conversations
from scratchlm.output_paths import refuse_inputs
from scratchlm.workers import default_workers


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", description="Prepare training data.",
                                   help="prepare training data: download a corpus, encode text into token files")
    actions = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    for register_action in ACTIONS:
        register_action(actions)


def _register_encode(actions) -> None:
    parser = actions.add_parser(
        "encode", help="encode text, JSON lines, parquet or a Hugging Face dataset into a token file",
        description="Encode documents with a trained tokenizer into one token file (uint16 ids when the vocab "
                    "fits, else uint32) that records the vocab size and the tokenizer's hash. Inputs: .txt, "
                    ".jsonl/.json, .parquet (optionally .gz/.zst), folders and globs of those, and hf:NAME[:CONFIG]"
                    "[:SPLIT] datasets. Each document ends with <|endoftext|>. Encoded in order, in parallel "
                    "processes and constant memory; the output appears only when complete. See "
                    "docs/tokenizer-encoding.md.")
    parser.add_argument("--tokenizer", required=True, metavar="DIR",
                        help="tokenizer directory (from `scratchlm tokenizer train`, a Hugging Face tokenizer.json "
                             "folder, or GPT-2 vocab.json+merges.txt)")
    add_input_arguments(parser)
    parser.add_argument("--out", required=True, metavar="FILE", help="token file to write")
    parser.add_argument("--no-eot", dest="end_of_text", action="store_false",
                        help="do not end each document with <|endoftext|> (default: do)")
    split = parser.add_mutually_exclusive_group()
    split.add_argument("--val-fraction", type=float, metavar="F",
                       help="put an evenly spaced fraction F of the documents into a validation file")
    split.add_argument("--val-docs", type=_positive_int, metavar="N",
                       help="put the first N documents into a validation file")
    parser.add_argument("--val-out", metavar="FILE",
                        help="validation token file (default: beside --out, NAME.val.tok for NAME.tok)")
    parser.add_argument("--workers", type=_positive_int, default=default_workers(), metavar="N",
                        help="processes (default: usable CPUs, at most 8)")
    parser.add_argument("--engine", choices=["scratchlm", "tiktoken"], default="scratchlm",
                        help="the encoder: scratchlm's own (default), or tiktoken (native code, needs "
                             "pip install 'scratchlm[fast]'), built from this tokenizer's merges and used only once it "
                             "gives the same ids on the input's first megabyte; it wins on large varied corpora "
                             "(web text), while on small or repetitive ones the default is as fast")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    parser.add_argument("--force", action="store_true", help="replace an existing --out that is not a token file")
    parser.set_defaults(func=run_encode)


def run_encode(args: argparse.Namespace) -> int:
    from scratchlm.data.encode import encode_corpus

    val_out = _val_out(args)
    _check_encode_output(args, args.out, "--out")
    if val_out:
        _check_encode_output(args, val_out, "--val-out")
    progress = not args.quiet and sys.stderr.isatty()
    stats = encode_corpus(args.tokenizer, args.input, args.out, workers=args.workers, errors=args.errors,
                          progress=progress, text_field=args.text_field, end_of_text=args.end_of_text,
                          val_out=val_out, val_fraction=args.val_fraction, val_docs=args.val_docs,
                          engine=args.engine)
    if not args.quiet:
        written = f"{args.out} and {val_out}" if val_out else args.out
        print(f"encoded {len(args.input)} input{'s' if len(args.input) != 1 else ''}: {stats.summary()} -> {written}")
    return 0


def _val_out(args: argparse.Namespace) -> str | None:
    """--val-out, or NAME.val.SUFFIX beside --out when a split is asked for; None without a split."""
    if args.val_fraction is None and args.val_docs is None:
        if args.val_out:
            raise UserError("--val-out needs --val-fraction or --val-docs")
        return None
    if args.val_out:
        return args.val_out
    out = Path(args.out)
    return str(out.with_name(f"{out.stem}.val{out.suffix or '.tok'}"))


def _check_encode_output(args: argparse.Namespace, out: str, flag: str) -> None:
    """An output is never an input (a text file or a tokenizer file), and replaces only an earlier token file."""
    from scratchlm.data.token_file import open_token_file

    out, tokenizer = Path(out), Path(args.tokenizer)
    if out.is_dir():
        return  # the token file writer names that problem
    tokenizer_files = list(tokenizer.iterdir()) if tokenizer.is_dir() else []
    inputs = [Path(spec) for spec in args.input if not spec.startswith("hf:")]
    refuse_inputs(out, [*inputs, *tokenizer_files], inside_ok=True)
    if out.is_file() and not args.force:
        try:
            open_token_file(out)
        except ValueError:
            raise UserError(f"{flag} {out} exists and is not a token file; choose another {flag}, or pass "
                            f"--force to replace it") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


ACTIONS = [_register_encode, register_download, register_conversations]
