"""A tokenizer folder: which files ``Tokenizer.save`` writes and the order ``Tokenizer.load`` reads them in.

``save`` writes one tokenizer in three formats::

    scratchlm-tokenizer.json   scratchlm's own format (io.py): exact for any vocab; load reads it first
    tokenizer.json             Hugging Face's (hf.py), + tokenizer_config.json: for `tokenizers` and
                               `transformers.AutoTokenizer`
    vocab.json + merges.txt    GPT-2's (io.py): no special tokens, and only for GPT-2's pipeline

A format that cannot hold the tokenizer exactly (say two ids with the same bytes) is left out with a warning, and
its stale files are removed. ``load`` reads the first of: scratchlm-tokenizer.json; tokenizer.json, which is
scratchlm's format (the name it had before) or a Hugging Face byte-level BPE tokenizer, whose chat template is read
from tokenizer_config.json or chat_template.jinja beside it; the GPT-2 pair. File names never enter
``Tokenizer.hash``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from scratchlm.tokenizer.formats.hf import (
    HF_CONFIG_FILE,
    HF_TOKENIZER_FILE,
    is_hf_document,
    parse_hf_tokenizer,
    read_hf_chat,
    write_hf_tokenizer,
)
from scratchlm.tokenizer.formats.io import (
    GPT2_MERGES_FILE,
    GPT2_VOCAB_FILE,
    NO_CHAT,
    SCRATCHLM_FILE,
    ChatParts,
    FlagsByToken,
    FormatCannotHold,
    Merges,
    Vocab,
    is_scratchlm_document,
    parse_scratchlm,
    read_gpt2_files,
    read_json,
    write_gpt2_files,
    write_scratchlm_file,
)
from scratchlm.tokenizer.pipeline import GPT2_PIPELINE, Pipeline
from scratchlm.write_errors import made_folder

if TYPE_CHECKING:
    from scratchlm.tokenizer.tokenizer import Tokenizer

# what every reader returns: vocab, merges, special tokens, pipeline, added-token flags, (chat template, end of turn)
TokenizerParts = tuple[Vocab, Merges, list[str], Pipeline, FlagsByToken, ChatParts]


# ---------------------------------------------------------------------------------------------- reading
def read_tokenizer_dir(directory: str | Path) -> TokenizerParts:
    """TokenizerParts from a tokenizer folder, its files tried in the order the module describes."""
    directory = Path(directory)
    if directory.is_file():
        raise ValueError(f"tokenizer {directory} is a file; expected the directory written by `scratchlm tokenizer "
                         f"train` (or one holding a Hugging Face {HF_TOKENIZER_FILE}, or GPT-2 vocab.json + "
                         "merges.txt)")
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer directory {directory} does not exist")
    if (directory / SCRATCHLM_FILE).exists():
        return parse_scratchlm(read_json(directory / SCRATCHLM_FILE), directory / SCRATCHLM_FILE)
    if (directory / HF_TOKENIZER_FILE).exists():
        document = read_json(directory / HF_TOKENIZER_FILE)
        if is_hf_document(document):  # its chat template is in the files beside it
            parts = parse_hf_tokenizer(document, directory / HF_TOKENIZER_FILE)
            return *parts, read_hf_chat(directory, parts[0])
        return _parse_single_file(document, directory / HF_TOKENIZER_FILE)
    if (directory / GPT2_VOCAB_FILE).exists() and (directory / GPT2_MERGES_FILE).exists():
        vocab, merges = read_gpt2_files(directory / GPT2_VOCAB_FILE, directory / GPT2_MERGES_FILE)
        return vocab, merges, [], GPT2_PIPELINE, {}, NO_CHAT
    raise FileNotFoundError(f"{directory} holds no tokenizer: expected {SCRATCHLM_FILE}, a Hugging Face "
                            f"{HF_TOKENIZER_FILE}, or {GPT2_VOCAB_FILE} + {GPT2_MERGES_FILE} (write one with "
                            "`scratchlm tokenizer train`)")


def read_tokenizer_files(vocab_path: str | Path, merges_path: str | Path | None) -> TokenizerParts:
    """GPT-2 ``vocab.json`` + ``merges.txt``, or one file that holds its own merges (scratchlm's or Hugging Face's
    tokenizer file) passed as vocab_path alone."""
    vocab_path = Path(vocab_path)
    document = read_json(vocab_path)
    if merges_path is None:
        return _parse_single_file(document, vocab_path)
    if is_scratchlm_document(document) or is_hf_document(document):
        raise ValueError(f"{vocab_path} is a tokenizer file that holds its own merges; pass no merges file "
                         f"(got {merges_path})")
    vocab, merges = read_gpt2_files(vocab_path, merges_path)
    return vocab, merges, [], GPT2_PIPELINE, {}, NO_CHAT


def _parse_single_file(document: object, path: Path) -> TokenizerParts:
    if is_scratchlm_document(document):
        return parse_scratchlm(document, path)
    if is_hf_document(document):
        return *parse_hf_tokenizer(document, path), NO_CHAT
    raise ValueError(f"{path}: expected a scratchlm tokenizer (a JSON object with format_version) or a Hugging Face "
                     "tokenizer.json (a JSON object with a model); a GPT-2 vocab.json is read with its merges.txt")


# ---------------------------------------------------------------------------------------------- writing
def write_tokenizer_dir(directory: str | Path, tokenizer: Tokenizer) -> Path:
    """Write the three formats of `tokenizer` into directory (created if needed); returns it.

    scratchlm-tokenizer.json is written first: it is what ``load`` reads first, so a failure while writing the
    others never leaves a folder that loads as another tokenizer (the GPT-2 pair alone has no special tokens).
    """
    with made_folder(directory) as directory:
        write_scratchlm_file(directory / SCRATCHLM_FILE, tokenizer)
        _write_unless_it_cannot_hold(directory, (HF_TOKENIZER_FILE, HF_CONFIG_FILE),
                                     lambda: write_hf_tokenizer(directory, tokenizer))
        if tokenizer.pipeline == GPT2_PIPELINE:
            _write_unless_it_cannot_hold(directory, (GPT2_VOCAB_FILE, GPT2_MERGES_FILE),
                                         lambda: write_gpt2_files(directory, tokenizer.vocab, tokenizer.merges))
        else:
            for name in (GPT2_VOCAB_FILE, GPT2_MERGES_FILE):
                (directory / name).unlink(missing_ok=True)
        return directory


def _write_unless_it_cannot_hold(directory: Path, names: tuple[str, ...], write: Callable[[], None]) -> None:
    """Run write; when its format cannot hold the tokenizer, warn and remove that format's stale files instead."""
    try:
        write()
    except FormatCannotHold as reason:
        for name in names:
            (directory / name).unlink(missing_ok=True)
        warnings.warn(f"{directory}: no {' + '.join(names)} written: {reason} ({SCRATCHLM_FILE} holds the whole "
                      "tokenizer)", stacklevel=4)
