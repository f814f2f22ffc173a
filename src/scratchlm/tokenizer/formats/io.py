"""Tokenizer files, one format each: scratchlm's own ``scratchlm-tokenizer.json`` and GPT-2's ``vocab.json`` +
``merges.txt``; and what every format shares (the added-token flags of Hugging Face files, ``FormatCannotHold``).

scratchlm format, exact and byte-safe, one vocab entry and one merge per line::

    {"format_version": 2,
     "vocab": ["<hex bytes of id 0>", "<hex bytes of id 1>", ..., null where an id is unused],
     "merges": [<left id>, <right id>,  (a merge per line, in creation order)
                ...],
     "special_tokens": ["<|endoftext|>", ...]}

Version 3 is written only for a pipeline (``pipeline.py``) other than GPT-2's, and adds ``"pattern"``,
``"normalizer"`` (null or "NFC") and ``"ignore_merges"``: an older scratchlm refuses it rather than split with the
wrong pattern. Version 1 (still read) spelled the vocab ``{"<id>": "<hex bytes>"}`` and each merge as two hex
strings. Three optional keys change no id, so they need no new version: ``"chat_template"`` (``{"source":
"<Jinja2>", "bos_token": ...}``), ``"end_of_turn"`` (ids) and ``"added_token_flags"`` (below). Folders saved before
Hugging Face's file took the name hold this format as ``tokenizer.json`` (``folder.py`` tells the two apart).

GPT-2 format: ``vocab.json`` maps printable strings to ids and ``merges.txt`` lists ``left right`` per line after a
``#version`` header, bytes spelled through GPT-2's byte <-> unicode table; it has no special tokens.

Readers name the file and line (or key) of a malformed entry; a writer whose format cannot hold a tokenizer exactly
raises ``FormatCannotHold`` before writing anything.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from scratchlm.tokenizer.chat_template import NAMED_TOKENS, ChatTemplate
from scratchlm.tokenizer.pipeline import GPT2_PIPELINE, Pipeline
from scratchlm.write_errors import naming

if TYPE_CHECKING:  # the writers take a Tokenizer, which is built from what the readers return
    from scratchlm.tokenizer.tokenizer import Tokenizer

FORMAT_VERSION = 2  # for GPT-2's pipeline; PIPELINE_FORMAT_VERSION for any other
PIPELINE_FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
SCRATCHLM_FILE = "scratchlm-tokenizer.json"
GPT2_VOCAB_FILE = "vocab.json"
GPT2_MERGES_FILE = "merges.txt"

Vocab = dict[int, bytes]
Merges = list[tuple[bytes, bytes]]
ChatParts = tuple[ChatTemplate | None, tuple[int, ...]]  # a tokenizer's chat template and end-of-turn ids
NO_CHAT: ChatParts = (None, ())


class FormatCannotHold(ValueError):
    """A file format that cannot hold this tokenizer exactly (say two ids with the same bytes in GPT-2's vocab.json,
    which maps each token string to one id): the writer refuses rather than write a different tokenizer."""


@dataclass(frozen=True)
class AddedTokenFlags:
    """How a Hugging Face tokenizer.json marks an added token beyond its text and id. ``special`` false is a plain
    added token (``decode(skip_special_tokens=True)`` keeps it); ``normalized`` says which of HF's two matching
    passes finds it (hf.py refuses files where that differs from our one pass). Neither changes our ids, so neither
    enters ``Tokenizer.hash``; both are kept so that a file read and saved again gives HF the tokenizer it gave.
    (lstrip, rstrip and single_word change ids and are refused on reading.)"""

    special: bool = True
    normalized: bool = False


OURS = AddedTokenFlags()  # what we write for a special token of our own
FlagsByToken = dict[str, AddedTokenFlags]  # only the tokens whose flags are not OURS


def checked_flags(flags: FlagsByToken | None, special_tokens: list[str]) -> FlagsByToken:
    """flags without the entries equal to OURS; a ValueError for flags of a token that is not a special token."""
    flags = dict(flags or {})
    stray = next((token for token in flags if token not in special_tokens), None)
    if stray is not None:
        raise ValueError(f"added-token flags given for {stray!r}, which is not a special token "
                         f"(special tokens: {special_tokens})")
    bad = next((token for token, flag in flags.items() if not isinstance(flag, AddedTokenFlags)), None)
    if bad is not None:
        raise TypeError(f"the flags of {bad!r} must be an AddedTokenFlags, got {type(flags[bad]).__name__}")
    return {token: flag for token, flag in flags.items() if flag != OURS}


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


def to_gpt2_string(token: bytes) -> str:
    """token's bytes spelled in GPT-2's printable alphabet (a space is "Ġ")."""
    table = gpt2_bytes_to_unicode()
    return "".join(table[byte] for byte in token)


@cache
def _gpt2_translation() -> dict[int, str]:
    """str.translate table: GPT-2 characters -> the Latin-1 character of their byte; other Latin-1 -> U+FFFF."""
    table = {code: "\uffff" for code in range(256)}
    table.update({ord(char): chr(byte) for byte, char in gpt2_bytes_to_unicode().items()})
    return table


def from_gpt2_string(text: str, where: str) -> bytes:
    """The bytes a GPT-2-alphabet string spells; a character outside the alphabet is an error naming `where`."""
    try:  # fast path: one C-level translate + encode per token
        return text.translate(_gpt2_translation()).encode("latin-1")
    except UnicodeEncodeError:
        bad = next(char for char in text if char not in gpt2_bytes_to_unicode().values())
        raise ValueError(f"{where}: character {bad!r} in {text!r} is not in GPT-2's byte table") from None


def from_gpt2_merge(merge: str, where: str) -> tuple[bytes, bytes]:
    """The (left, right) bytes of a merge spelled ``"left right"`` in GPT-2's alphabet; an error names `where`."""
    parts = merge.split(" ")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"{where}: expected two tokens separated by one space, got {merge[:80]!r}")
    return from_gpt2_string(parts[0], where), from_gpt2_string(parts[1], where)


def invert_vocab(vocab: dict[int, bytes]) -> dict[bytes, int]:
    """bytes -> id; where two ids share bytes the smaller id wins (a deterministic choice)."""
    if not all(type(token_id) is int and token_id >= 0 for token_id in vocab):
        bad = next(i for i in vocab if type(i) is not int or i < 0)
        raise ValueError(f"vocab ids must be non-negative integers, got {bad!r}")
    inverse: dict[bytes, int] = {}
    for token_id in sorted(vocab, reverse=True):
        token = vocab[token_id]
        if not isinstance(token, bytes):
            raise ValueError(f"vocab entries must be int -> bytes, got {token_id!r} -> {token!r}")
        inverse[token] = token_id
    return inverse


# ---------------------------------------------------------------------------------------------- reading
def is_scratchlm_document(document: object) -> bool:
    """Whether a parsed JSON file is (meant to be) scratchlm's format: an object with format_version."""
    return isinstance(document, dict) and "format_version" in document


def parse_scratchlm(document: object,
                    path: Path) -> tuple[Vocab, Merges, list[str], Pipeline, FlagsByToken, ChatParts]:
    """The tokenizer in a parsed scratchlm-tokenizer.json (read from path), with its chat template and end-of-turn
    ids."""
    if not isinstance(document, dict):
        raise ValueError(f"{path}: expected a JSON object with format_version, vocab, merges, special_tokens")
    version = document.get("format_version")
    if type(version) is not int or version not in READABLE_VERSIONS:  # not true (== 1) or 2.0
        raise ValueError(f"{path}: unsupported tokenizer format_version {version!r} "
                         f"(this scratchlm reads versions {', '.join(map(str, READABLE_VERSIONS))})")
    vocab_kind = dict if version == 1 else list
    for key, kind in (("vocab", vocab_kind), ("merges", list), ("special_tokens", list)):
        if not isinstance(document.get(key), kind):
            raise ValueError(f"{path}: key {key!r} is missing or not a JSON {kind.__name__}")
    if version == 1:
        vocab, merges = _parse_v1_vocab(document["vocab"], path), _parse_v1_merges(document["merges"], path)
    else:
        vocab = _parse_v2_vocab(document["vocab"], path)
        merges = _parse_v2_merges(document["merges"], vocab, path)
    specials = document["special_tokens"]
    if not all(isinstance(token, str) for token in specials):
        raise ValueError(f"{path}: special_tokens must be a list of strings, got {specials!r}")
    pipeline = _parse_pipeline(document, path) if version == PIPELINE_FORMAT_VERSION else GPT2_PIPELINE
    flags = _parse_added_token_flags(document, path)
    return vocab, merges, list(specials), pipeline, flags, _parse_chat(document, path)


def _parse_chat(document: dict, path: Path) -> ChatParts:
    """The ``chat_template`` and ``end_of_turn`` keys of a scratchlm document (NO_CHAT when it has neither)."""
    template, end_of_turn = document.get("chat_template"), document.get("end_of_turn", [])
    if template is not None:
        if not (isinstance(template, dict) and isinstance(template.get("source"), str)
                and set(template) <= {"source", *NAMED_TOKENS}):
            raise ValueError(f"{path}: key 'chat_template' is not an object with a string source and named tokens "
                             f"({', '.join(NAMED_TOKENS)})")
        try:
            template = ChatTemplate(**template)
        except ValueError as error:
            raise ValueError(f"{path}: chat_template: {error}") from None
    if not (isinstance(end_of_turn, list) and all(type(token_id) is int for token_id in end_of_turn)):
        raise ValueError(f"{path}: key 'end_of_turn' is not a list of token ids, got {end_of_turn!r}")
    return template, tuple(end_of_turn)


def _parse_added_token_flags(document: dict, path: Path) -> FlagsByToken:
    entries = document.get("added_token_flags", {})
    if not isinstance(entries, dict):
        raise ValueError(f"{path}: key 'added_token_flags' is not a JSON object")
    flags = {}
    for token, entry in entries.items():
        if not (isinstance(entry, dict) and set(entry) == {"special", "normalized"}
                and all(isinstance(value, bool) for value in entry.values())):
            raise ValueError(f"{path}: added_token_flags of {token!r} is {entry!r}, not "
                             '{"special": true/false, "normalized": true/false}')
        flags[token] = AddedTokenFlags(**entry)
    return flags


def _parse_pipeline(document: dict, path: Path) -> Pipeline:
    pattern, normalizer, ignore_merges = (document.get(key) for key in ("pattern", "normalizer", "ignore_merges"))
    if not isinstance(pattern, str):
        raise ValueError(f"{path}: key 'pattern' is missing or not a JSON string")
    if normalizer not in (None, "NFC"):
        raise ValueError(f"{path}: normalizer {normalizer!r} is not null or \"NFC\"")
    if not isinstance(ignore_merges, bool):
        raise ValueError(f"{path}: key 'ignore_merges' is missing or not true/false")
    try:
        return Pipeline(pattern, nfc=normalizer == "NFC", ignore_merges=ignore_merges)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def _parse_v2_vocab(entries: list, path: Path) -> Vocab:
    try:
        if None not in entries:  # the usual dense vocab: no per-entry test
            return dict(enumerate(map(bytes.fromhex, entries)))
        return {token_id: bytes.fromhex(token) for token_id, token in enumerate(entries) if token is not None}
    except (ValueError, TypeError):
        token_id = next(i for i, token in enumerate(entries) if token is not None and not _is_hex(token))
        raise ValueError(f"{path}: vocab entry for id {token_id}: {entries[token_id]!r} is not hex bytes "
                         "(or null for an unused id)") from None


def _parse_v2_merges(ids: list, vocab: Vocab, path: Path) -> Merges:
    if len(ids) % 2:
        raise ValueError(f"{path}: merges must hold two ids per merge, got an odd count ({len(ids)})")
    lefts, rights = ids[0::2], ids[1::2]
    try:
        merges = list(zip(map(vocab.__getitem__, lefts), map(vocab.__getitem__, rights)))
    except (KeyError, TypeError):
        merges = None
    if merges is None or not set(map(type, ids)) <= {int}:  # ids, not 1.0 or true
        index = next(i for i, pair in enumerate(zip(lefts, rights)) if not all(_is_id(t, vocab) for t in pair))
        raise ValueError(f"{path}: merge #{index} [{lefts[index]!r}, {rights[index]!r}] is not a pair of ids in "
                         "the vocab") from None
    return merges


def _is_id(value: object, vocab: Vocab) -> bool:
    return type(value) is int and value in vocab


def _parse_v1_vocab(entries: dict, path: Path) -> Vocab:
    vocab = {}
    for key, value in entries.items():
        try:
            vocab[int(key)] = bytes.fromhex(value)
        except (ValueError, TypeError):
            raise ValueError(f"{path}: vocab entry {key!r}: {value!r} is not <integer id>: <hex bytes>") from None
    return vocab


def _parse_v1_merges(pairs: list, path: Path) -> Merges:
    merges = []
    for index, pair in enumerate(pairs):
        try:
            left, right = pair
            merges.append((bytes.fromhex(left), bytes.fromhex(right)))
        except (ValueError, TypeError):
            raise ValueError(f"{path}: merge #{index} {pair!r} is not a pair of hex byte strings") from None
    return merges


def _is_hex(value: object) -> bool:
    try:
        bytes.fromhex(value)
    except (ValueError, TypeError):
        return False
    return True


def read_gpt2_files(vocab_path: str | Path, merges_path: str | Path) -> tuple[Vocab, Merges]:
    """Parse GPT-2 ``vocab.json`` (string -> id) and ``merges.txt`` into bytes."""
    vocab_path, merges_path = Path(vocab_path), Path(merges_path)
    document = read_json(vocab_path)
    if not isinstance(document, dict):
        raise ValueError(f"{vocab_path}: expected a JSON object mapping token strings to ids")
    check_token_ids(document, vocab_path)
    vocab = {token_id: from_gpt2_string(text, f"{vocab_path}: token") for text, token_id in document.items()}
    return vocab, _read_gpt2_merges(merges_path)


def check_token_ids(vocab: dict, path: Path) -> None:
    """Every id of a {token text: id} JSON object (vocab.json, a tokenizer.json's model.vocab) is a non-negative
    integer that no other text has."""
    holders: dict[int, str] = {}
    for text, token_id in vocab.items():
        if type(token_id) is not int or token_id < 0:
            raise ValueError(f"{path}: token {text!r} has id {token_id!r}, expected a non-negative integer")
        if token_id in holders:
            raise ValueError(f"{path}: id {token_id} is given to both {holders[token_id]!r} and {text!r}")
        holders[token_id] = text


def _read_gpt2_merges(path: Path) -> Merges:
    merges = []
    for line_number, line in enumerate(_read_text(path).split("\n"), start=1):
        line = line.rstrip("\r")
        if not line or (line_number == 1 and line.startswith("#version")):
            continue
        merges.append(from_gpt2_merge(line, f"{path}:{line_number}"))
    return merges


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer file {path} does not exist") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 (invalid byte at offset {error.start})") from None


def read_json(path: Path) -> object:
    """A UTF-8 JSON file; a missing, non-UTF-8 or malformed one is an error naming it (and the line)."""
    text = _read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{error.lineno}: malformed JSON ({error.msg}, column {error.colno})") from None


# ---------------------------------------------------------------------------------------------- writing
def write_scratchlm_file(path: Path, tokenizer: Tokenizer) -> None:
    """scratchlm-tokenizer.json (version 2, or 3 for a pipeline other than GPT-2's) with one vocab entry and one
    merge per line (json.dumps has no such layout); a merge's parts are written as their (smallest) ids; the chat
    template and end-of-turn ids as the module says."""
    vocab, pipeline = tokenizer.vocab, tokenizer.pipeline
    ids = invert_vocab(vocab)
    tokens = [vocab[i].hex() if i in vocab else None for i in range(max(vocab, default=-1) + 1)]
    vocab_lines = ",\n".join(map(json.dumps, tokens))
    merge_lines = ",\n".join(f"{ids[left]}, {ids[right]}" for left, right in tokenizer.merges)
    version = FORMAT_VERSION if pipeline == GPT2_PIPELINE else PIPELINE_FORMAT_VERSION
    keys: dict[str, object] = {"special_tokens": tokenizer.special_tokens}  # and the optional ones, a line each
    if pipeline != GPT2_PIPELINE:
        keys.update(pattern=pipeline.pattern, normalizer="NFC" if pipeline.nfc else None,
                    ignore_merges=pipeline.ignore_merges)
    if tokenizer.added_token_flags:
        keys["added_token_flags"] = {token: {"special": flag.special, "normalized": flag.normalized}
                                     for token, flag in tokenizer.added_token_flags.items()}
    if tokenizer.chat_template is not None:
        keys["chat_template"] = {"source": tokenizer.chat_template.source, **tokenizer.chat_template.named_tokens}
    if tokenizer.end_of_turn_ids:
        keys["end_of_turn"] = list(tokenizer.end_of_turn_ids)
    tail = "".join(f",\n{json.dumps(key)}: {json.dumps(value)}" for key, value in keys.items())
    write_atomic(path, f'{{"format_version": {version},\n"vocab": [\n{vocab_lines}\n],\n'
                       f'"merges": [\n{merge_lines}\n]{tail}}}\n')


def write_gpt2_files(directory: Path, vocab: Vocab, merges: Merges) -> None:
    """vocab.json + merges.txt in directory; FormatCannotHold when two ids hold the same bytes (say a
    one-character special token), since GPT-2's vocab.json maps each token string to one id."""
    if len(invert_vocab(vocab)) < len(vocab):
        raise FormatCannotHold("GPT-2's format cannot hold two ids with the same bytes")
    gpt2_vocab = {to_gpt2_string(vocab[token_id]): token_id for token_id in sorted(vocab)}
    gpt2_merges = "".join(f"{to_gpt2_string(a)} {to_gpt2_string(b)}\n" for a, b in merges)
    write_atomic(directory / GPT2_VOCAB_FILE, json.dumps(gpt2_vocab, ensure_ascii=False))
    write_atomic(directory / GPT2_MERGES_FILE, "#version: 0.2\n" + gpt2_merges)


def write_atomic(path: Path, text: str) -> None:
    """Write via PATH.tmp + rename; a failure (a full disk) removes the .tmp and names `path`."""
    temporary = path.with_name(path.name + ".tmp")
    data = text.encode("utf-8")
    with naming(path, len(data)):  # outside the clean-up: the free space it reports is without the .tmp
        try:
            with open(temporary, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
