"""The input flags of ``data encode`` and ``tokenizer train``: what to read and how, defined once.

Both commands read their inputs through ``data/sources.py``, so they take the same inputs spelled the same way:
``--input`` (files, folders, globs, ``hf:`` datasets), ``--text-field`` and ``--errors``.
"""

from __future__ import annotations

import argparse


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --input, --text-field and --errors to a command that reads documents."""
    parser.add_argument("--input", required=True, nargs="+", metavar="INPUT",
                        help="files (.txt, .jsonl/.json, .parquet; .gz/.zst compressed), folders, globs, or "
                             "hf:NAME[:CONFIG][:SPLIT] datasets")
    parser.add_argument("--text-field", default="text", metavar="NAME",
                        help="the JSON field / parquet or dataset column holding the text (default: text)")
    parser.add_argument("--errors", choices=["strict", "replace"], default="strict",
                        help="invalid UTF-8: stop naming the file and byte offset or line (strict, default), "
                             "or substitute U+FFFD (replace)")
