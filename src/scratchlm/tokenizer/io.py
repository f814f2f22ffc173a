"""Tokenizer files: the versioned scratchlm ``tokenizer.json`` and GPT-2's ``vocab.json`` + ``merges.txt``.

scratchlm format (``tokenizer.json``), exact and byte-safe::

    {"format_version": 1, "vocab": {"<id>": "<hex bytes>", ...},
     "merges": [["<hex left>", "<hex right>"], ...], "special_tokens": ["<|endoftext|>", ...]}

GPT-2 format: ``vocab.json`` maps *printable* strings to ids and ``merges.txt`` lists ``left right`` per line
after a ``#version`` header; bytes become printable characters through GPT-2's byte <-> unicode table
(``gpt2_bytes_to_unicode``), so no token contains a space or a newline. GPT-2 files have no special-token list.

Every reader names the file and line (or key) of a malformed entry; unknown format versions are refused.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

FORMAT_VERSION = 1
TOKENIZER_FILE = "tokenizer.json"
GPT2_VOCAB_FILE = "vocab.json"
GPT2_MERGES_FILE = "merges.txt"

Vocab = dict[int, bytes]
Merges = list[tuple[bytes, bytes]]


@cache
def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: printable Latin-1 bytes map to themselves, the other 68 bytes to chr(256 + n) in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


@cache
def gpt2_unicode_to_bytes() -> dict[str, int]:
    return {char: byte for byte, char in gpt2_bytes_to_unicode().items()}


def _to_gpt2_string(token: bytes) -> str:
    table = gpt2_bytes_to_unicode()
    return "".join(table[byte] for byte in token)


@cache
def _gpt2_translation() -> dict[int, str]:
    """str.translate table: GPT-2 characters -> the Latin-1 character of their byte; other Latin-1 -> U+FFFF."""
    table = {code: "\uffff" for code in range(256)}
    table.update({ord(char): chr(byte) for char, byte in gpt2_unicode_to_bytes().items()})
    return table


def _from_gpt2_string(text: str, where: str) -> bytes:
    try:  # fast path: one C-level translate + encode per token
        return text.translate(_gpt2_translation()).encode("latin-1")
    except UnicodeEncodeError:
        bad = next(char for char in text if char not in gpt2_unicode_to_bytes())
        raise ValueError(f"{where}: character {bad!r} in {text!r} is not in GPT-2's byte table") from None


# ---------------------------------------------------------------------------------------------- reading
def read_tokenizer_dir(directory: str | Path) -> tuple[Vocab, Merges, list[str]]:
    """(vocab, merges, special tokens) from a tokenizer directory: ``tokenizer.json`` first, else GPT-2 files."""
    directory = Path(directory)
    if directory.is_file():
        raise ValueError(f"tokenizer {directory} is a file; expected the directory written by `scratchlm tokenizer "
                         "train` (or one holding GPT-2 vocab.json + merges.txt)")
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer directory {directory} does not exist")
    if (directory / TOKENIZER_FILE).exists():
        return read_scratchlm_file(directory / TOKENIZER_FILE)
    if (directory / GPT2_VOCAB_FILE).exists() and (directory / GPT2_MERGES_FILE).exists():
        vocab, merges = read_gpt2_files(directory / GPT2_VOCAB_FILE, directory / GPT2_MERGES_FILE)
        return vocab, merges, []
    raise FileNotFoundError(f"{directory} holds no tokenizer: expected {TOKENIZER_FILE} or "
                            f"{GPT2_VOCAB_FILE} + {GPT2_MERGES_FILE} (write one with `scratchlm tokenizer train`)")


def read_tokenizer_files(vocab_path: str | Path, merges_path: str | Path | None) -> tuple[Vocab, Merges, list[str]]:
    """GPT-2 ``vocab.json`` + ``merges.txt``, or a scratchlm ``tokenizer.json`` passed as vocab_path alone."""
    document = _read_json(Path(vocab_path))
    if isinstance(document, dict) and "format_version" in document:
        if merges_path is not None:
            raise ValueError(f"{vocab_path} is a scratchlm tokenizer file that holds its own merges; "
                             f"pass no merges file (got {merges_path})")
        return _parse_scratchlm(document, Path(vocab_path))
    if merges_path is None:
        raise ValueError(f"{vocab_path} is a GPT-2 vocab.json; its merges.txt is needed too")
    vocab, merges = read_gpt2_files(vocab_path, merges_path)
    return vocab, merges, []


def read_scratchlm_file(path: str | Path) -> tuple[Vocab, Merges, list[str]]:
    path = Path(path)
    return _parse_scratchlm(_read_json(path), path)


def _parse_scratchlm(document: object, path: Path) -> tuple[Vocab, Merges, list[str]]:
    if not isinstance(document, dict):
        raise ValueError(f"{path}: expected a JSON object with format_version, vocab, merges, special_tokens")
    version = document.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported tokenizer format_version {version!r} "
                         f"(this scratchlm reads version {FORMAT_VERSION})")
    for key, kind in (("vocab", dict), ("merges", list), ("special_tokens", list)):
        if not isinstance(document.get(key), kind):
            raise ValueError(f"{path}: key {key!r} is missing or not a JSON {kind.__name__}")
    try:
        vocab = {int(key): bytes.fromhex(value) for key, value in document["vocab"].items()}
    except (ValueError, TypeError):
        key, value = next((k, v) for k, v in document["vocab"].items() if not _is_hex_entry(k, v))
        raise ValueError(f"{path}: vocab entry {key!r}: {value!r} is not <integer id>: <hex bytes>") from None
    try:
        merges = [(bytes.fromhex(left), bytes.fromhex(right)) for left, right in document["merges"]]
    except (ValueError, TypeError):
        index, pair = next((i, p) for i, p in enumerate(document["merges"]) if not _is_hex_pair(p))
        raise ValueError(f"{path}: merge #{index} {pair!r} is not a pair of hex byte strings") from None
    specials = document["special_tokens"]
    if not all(isinstance(token, str) for token in specials):
        raise ValueError(f"{path}: special_tokens must be a list of strings, got {specials!r}")
    return vocab, merges, list(specials)


def _is_hex_entry(key: object, value: object) -> bool:
    try:
        int(key)
        bytes.fromhex(value)
    except (ValueError, TypeError):
        return False
    return True


def _is_hex_pair(pair: object) -> bool:
    try:
        left, right = pair
        bytes.fromhex(left), bytes.fromhex(right)
    except (ValueError, TypeError):
        return False
    return True


def read_gpt2_files(vocab_path: str | Path, merges_path: str | Path) -> tuple[Vocab, Merges]:
    """Parse GPT-2 ``vocab.json`` (string -> id) and ``merges.txt`` into bytes."""
    vocab_path, merges_path = Path(vocab_path), Path(merges_path)
    document = _read_json(vocab_path)
    if not isinstance(document, dict):
        raise ValueError(f"{vocab_path}: expected a JSON object mapping token strings to ids")
    vocab: Vocab = {}
    for text, token_id in document.items():
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(f"{vocab_path}: token {text!r} has id {token_id!r}, expected a non-negative integer")
        if token_id in vocab:
            raise ValueError(f"{vocab_path}: id {token_id} is given to both {_to_gpt2_string(vocab[token_id])!r} "
                             f"and {text!r}")
        vocab[token_id] = _from_gpt2_string(text, f"{vocab_path}: token")
    return vocab, _read_gpt2_merges(merges_path)


def _read_gpt2_merges(path: Path) -> Merges:
    merges = []
    for line_number, line in enumerate(_read_text(path).split("\n"), start=1):
        line = line.rstrip("\r")
        if not line or (line_number == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"{path}:{line_number}: expected two tokens separated by one space, got {line!r}")
        where = f"{path}:{line_number}"
        merges.append((_from_gpt2_string(parts[0], where), _from_gpt2_string(parts[1], where)))
    return merges


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer file {path} does not exist") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 (invalid byte at offset {error.start})") from None


def _read_json(path: Path) -> object:
    text = _read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{error.lineno}: malformed JSON ({error.msg}, column {error.colno})") from None


# ---------------------------------------------------------------------------------------------- writing
def write_tokenizer_dir(directory: str | Path, vocab: Vocab, merges: Merges, special_tokens: list[str]) -> Path:
    """Write tokenizer.json, vocab.json and merges.txt into directory (created if needed); returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    scratchlm = {
        "format_version": FORMAT_VERSION,
        "vocab": {str(token_id): vocab[token_id].hex() for token_id in sorted(vocab)},
        "merges": [[left.hex(), right.hex()] for left, right in merges],
        "special_tokens": list(special_tokens),
    }
    gpt2_vocab = {_to_gpt2_string(vocab[token_id]): token_id for token_id in sorted(vocab)}
    gpt2_merges = "".join(f"{_to_gpt2_string(a)} {_to_gpt2_string(b)}\n" for a, b in merges)
    _write_atomic(directory / GPT2_VOCAB_FILE, json.dumps(gpt2_vocab, ensure_ascii=False))
    _write_atomic(directory / GPT2_MERGES_FILE, "#version: 0.2\n" + gpt2_merges)
    _write_atomic(directory / TOKENIZER_FILE, json.dumps(scratchlm, indent=0))
    return directory


def _write_atomic(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
