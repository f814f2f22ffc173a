"""Hugging Face's ``tokenizer.json`` (+ ``tokenizer_config.json``): writing ours, reading byte-level BPE ones.

A tokenizer.json describes a pipeline. Ours is written as plain JSON (no ``tokenizers`` needed), from the
tokenizer's ``pipeline.Pipeline``::

    added_tokens   our special tokens, matched on the raw text first, with their ids and flags (io.AddedTokenFlags)
    normalizer     null, or NFC
    pre_tokenizer  GPT-2's pattern: ByteLevel with use_regex and no prefix space. Any other: a Sequence of Split
                   (the pattern as a Regex, behavior Isolated) then ByteLevel without regex, as Llama 3 and Qwen2
    model          BPE: "vocab" {token: id} and "merges" ["left right", ...] in rank order, spelled in GPT-2's byte
                   alphabet (a special token under its own text); ignore_merges as the pipeline says
    decoder        ByteLevel

HF loads added tokens by their text, not by the ids beside them, so every id needs a string of its own in the
vocab: two ids with the same bytes have no exact tokenizer.json (``FormatCannotHold``). ``tokenizer_config.json``
names the class AutoTokenizer builds, the end-of-text token and the chat template with its named tokens; a stale
``chat_template.jinja`` (which transformers 5 reads first) is removed when we write.

Reading accepts the files our encoder matches id for id (those two pre-tokenizers without prefix space, no
normalizer or NFC, added tokens matched as ours are); anything else is ``UnsupportedHFTokenizer`` naming the
setting, and a malformed file a ValueError naming the file. Our ids are those of HF's ``encode(text,
add_special_tokens=False)``: a post-processor is not ours to run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from scratchlm.tokenizer.chat_template import NAMED_TOKENS, ChatTemplate
from scratchlm.tokenizer.formats.io import (
    NO_CHAT,
    OURS,
    AddedTokenFlags,
    ChatParts,
    FlagsByToken,
    FormatCannotHold,
    Merges,
    Vocab,
    check_token_ids,
    from_gpt2_string,
    invert_vocab,
    read_json,
    to_gpt2_string,
    write_atomic,
)
from scratchlm.tokenizer.pipeline import Pipeline
from scratchlm.tokenizer.pretokenize import GPT2_SPLIT_PATTERN

if TYPE_CHECKING:
    from scratchlm.tokenizer.tokenizer import Tokenizer

HF_TOKENIZER_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
HF_TEMPLATE_FILE = "chat_template.jinja"
EOS_TOKEN = "<|endoftext|>"  # named as transformers' eos_token when the tokenizer has it
_POSSESSIVE_INTERVAL = re.compile(r"(?<!\\)\{\d+(?:,\d*)?\}\+")  # Python's {1,3}+ is Oniguruma's ({1,3})+


class UnsupportedHFTokenizer(ValueError):
    """A Hugging Face tokenizer.json whose ids our encoder would not reproduce (another model, a normalizer...)."""


# ---------------------------------------------------------------------------------------------- writing
def write_hf_tokenizer(directory: Path, tokenizer: Tokenizer) -> None:
    """tokenizer.json + tokenizer_config.json in directory; FormatCannotHold (before writing) when no tokenizer.json
    encodes exactly as this tokenizer does."""
    document = hf_tokenizer_document(tokenizer)
    config = hf_tokenizer_config(tokenizer)
    write_atomic(directory / HF_TOKENIZER_FILE, json.dumps(document, ensure_ascii=False, indent=2) + "\n")
    write_atomic(directory / HF_CONFIG_FILE, json.dumps(config, ensure_ascii=False, indent=2) + "\n")
    (directory / HF_TEMPLATE_FILE).unlink(missing_ok=True)


def hf_tokenizer_document(tokenizer: Tokenizer) -> dict:
    """The tokenizer.json of a byte-level BPE tokenizer, its special tokens as added tokens with their flags."""
    vocab, merges, pipeline = tokenizer.vocab, tokenizer.merges, tokenizer.pipeline
    if len(invert_vocab(vocab)) < len(vocab):
        raise FormatCannotHold("Hugging Face's tokenizer.json cannot hold two ids with the same bytes")
    special_ids = {token: tokenizer.special_id(token) for token in tokenizer.special_tokens}
    _check_no_merge_spells_a_special(vocab, merges, special_ids)
    flags = tokenizer.added_token_flags
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": token_id, "content": token, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": flags.get(token, OURS).normalized,
                          "special": flags.get(token, OURS).special} for token, token_id in special_ids.items()],
        "normalizer": {"type": "NFC"} if pipeline.nfc else None,
        "pre_tokenizer": _hf_pre_tokenizer(pipeline.pattern),
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": pipeline.ignore_merges,
                  "vocab": _hf_vocab(vocab, special_ids),
                  "merges": [f"{to_gpt2_string(left)} {to_gpt2_string(right)}" for left, right in merges]},
    }


def _hf_pre_tokenizer(pattern: str) -> dict:
    """GPT-2's ByteLevel-with-regex for GPT-2's pattern, else Split(pattern, Isolated) then a bare ByteLevel."""
    if pattern == GPT2_SPLIT_PATTERN:
        return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if _POSSESSIVE_INTERVAL.search(pattern):
        raise FormatCannotHold(f"Hugging Face's regex engine (Oniguruma) reads the possessive '{{m,n}}+' of split "
                               f"pattern {pattern!r} as a repeated interval; spell it without the '+'")
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}


def hf_tokenizer_config(tokenizer: Tokenizer) -> dict:
    """tokenizer_config.json: the class AutoTokenizer builds (4.x and 5.x know this name), the end-of-text token,
    and no clean-up of spaces in decode (which would change the text: ``" ."`` -> ``"."``). With a chat template:
    the template and its named tokens (which then give the end-of-text token), so that transformers renders the
    template with the tokens we render it with."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if tokenizer.chat_template is not None:
        config.update(tokenizer.chat_template.named_tokens)
        config["chat_template"] = tokenizer.chat_template.source
    elif EOS_TOKEN in tokenizer.special_tokens:
        config["eos_token"] = EOS_TOKEN
    return config


def _check_no_merge_spells_a_special(vocab: Vocab, merges: Merges, special_ids: dict[str, int]) -> None:
    """HF finds a merge's parts and result in the vocab by their GPT-2 spelling; a special token sits there under
    its own text. Where the two differ (" the" is spelled "Ġthe"), a merge that uses or makes the special's bytes
    (as when the special is also an ordinary token) would find nothing."""
    respelled = {vocab[token_id]: token for token, token_id in special_ids.items()
                 if token != to_gpt2_string(vocab[token_id])}
    if not respelled:
        return
    for rank, (left, right) in enumerate(merges):
        clash = next((part for part in (left, right, left + right) if part in respelled), None)
        if clash is not None:
            raise FormatCannotHold(f"Hugging Face's tokenizer.json cannot hold special token {respelled[clash]!r}: "
                                   f"merge #{rank} uses or makes its bytes, which HF looks up as "
                                   f"{to_gpt2_string(clash)!r}")


def _hf_vocab(vocab: Vocab, special_ids: dict[str, int]) -> dict[str, int]:
    """{GPT-2 string: id}, with each special token under its own text."""
    text_of_special = {token_id: token for token, token_id in special_ids.items()}
    hf_vocab: dict[str, int] = {}
    for token_id in sorted(vocab):
        text = text_of_special[token_id] if token_id in text_of_special else to_gpt2_string(vocab[token_id])
        if text in hf_vocab:
            raise FormatCannotHold(f"Hugging Face's tokenizer.json cannot hold ids {hf_vocab[text]} and {token_id}: "
                                   f"both are spelled {text!r} there (one a special token's text)")
        hf_vocab[text] = token_id
    return hf_vocab


# ---------------------------------------------------------------------------------------------- reading
def is_hf_document(document: object) -> bool:
    """Whether a parsed JSON file is (meant to be) a Hugging Face tokenizer.json: an object with a model."""
    return isinstance(document, dict) and isinstance(document.get("model"), dict)


def parse_hf_tokenizer(document: dict, path: Path) -> tuple[Vocab, Merges, list[str], Pipeline, FlagsByToken]:
    """(vocab, merges, special tokens, pipeline, added-token flags) of a Hugging Face byte-level BPE tokenizer.json
    (``is_hf_document``).

    The added tokens become our special tokens, in the file's order (so a file we wrote reads back with the same
    ``Tokenizer.hash``), their special and normalized flags kept (io.AddedTokenFlags); their bytes are their text,
    every other token's bytes its GPT-2 spelling."""
    pipeline = read_pipeline(document, path)
    model = document["model"]
    hf_vocab = _read_vocab(model, path)
    added, flags = _read_added_tokens(document, hf_vocab, pipeline, path)
    vocab = {token_id: from_gpt2_string(text, f"{path}: vocab token") for text, token_id in hf_vocab.items()
             if token_id not in added}
    id_of_bytes = {data: token_id for token_id, data in vocab.items()}  # one id each: the spelling is one-to-one
    for token_id, token in added.items():
        data = token.encode("utf-8")
        if data in id_of_bytes:
            raise UnsupportedHFTokenizer(f"{path}: added token {token!r} (id {token_id}) has the bytes of token id "
                                         f"{id_of_bytes[data]}; scratchlm gives the bytes of a special token one id")
        vocab[token_id] = data
    merges = [(from_gpt2_string(left, f"{path}: merge #{rank}"), from_gpt2_string(right, f"{path}: merge #{rank}"))
              for rank, (left, right) in enumerate(_read_merges(model, path))]
    return vocab, merges, list(added.values()), pipeline, {token: flag for token, flag in flags.items() if flag != OURS}


def read_hf_chat(directory: Path, vocab: Vocab) -> ChatParts:
    """The chat template of a Hugging Face tokenizer folder (``chat_template.jinja``, else tokenizer_config.json's
    ``chat_template``) with the config's named tokens, and as end of turn the id of its ``eos_token``; NO_CHAT when
    the folder has no template. (A model's generation_config.json may name more ids that end a turn: hf_import.py
    adds them.)"""
    config_path = directory / HF_CONFIG_FILE
    config = read_json(config_path) if config_path.is_file() else {}
    if not isinstance(config, dict):
        raise _unreadable(config_path, "not a JSON object")
    source = config.get("chat_template")
    if isinstance(source, list):  # an older layout of several named templates: [{"name": ..., "template": ...}]
        source = next((entry.get("template") for entry in source
                       if isinstance(entry, dict) and entry.get("name") == "default"), None)
    where = config_path  # the file the template came from
    if (directory / HF_TEMPLATE_FILE).is_file():
        where = directory / HF_TEMPLATE_FILE
        source = where.read_text(encoding="utf-8")
    if source is None:
        return NO_CHAT
    if not isinstance(source, str):
        raise _unreadable(config_path, f"chat_template is {type(source).__name__}, not the template's text")
    tokens = {name: _named_token(config, name, config_path) for name in NAMED_TOKENS}
    try:
        template = ChatTemplate(source, **tokens)
    except ValueError as error:  # a template that does not compile
        raise ValueError(f"{where}: {error}") from None
    ids = invert_vocab(vocab)
    eos = tokens["eos_token"]
    end_of_turn = (ids[eos.encode("utf-8")],) if eos is not None and eos.encode("utf-8") in ids else ()
    return template, end_of_turn


def _named_token(config: dict, name: str, path: Path) -> str | None:
    """A named token of tokenizer_config.json: a string, or an AddedToken object ``{"content": ...}``, or null."""
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise _unreadable(path, f"{name} is {value!r}, not a token's text")
    return value


def _unreadable(path: Path, detail: str) -> ValueError:
    return ValueError(f"{path}: not a readable tokenizer.json ({detail})")


def read_pipeline(document: dict, path: Path) -> Pipeline:
    """The pipeline of a tokenizer.json; UnsupportedHFTokenizer for every setting that would make Hugging Face's
    ids differ from ours."""
    model = document["model"]
    if model.get("type") != "BPE":
        raise UnsupportedHFTokenizer(f"{path}: a Hugging Face tokenizer with model {model.get('type')!r}; scratchlm "
                                     "reads byte-level BPE (model 'BPE', pre-tokenizer 'ByteLevel')")
    pattern = _read_pre_tokenizer(document.get("pre_tokenizer"), path)
    nfc = _read_normalizer(document.get("normalizer"), path)
    changes = {
        "dropout": model.get("dropout") not in (None, 0),  # random merges skipped
        "continuing_subword_prefix": model.get("continuing_subword_prefix") not in (None, ""),
        "end_of_word_suffix": model.get("end_of_word_suffix") not in (None, ""),
        "byte_fallback": bool(model.get("byte_fallback")),  # unknown characters as <0xNN> tokens
    }
    changed = [f"{name} {model[name]!r}" for name, is_set in changes.items() if is_set]
    if changed:
        raise UnsupportedHFTokenizer(f"{path}: this byte-level BPE tokenizer's model sets {', '.join(changed)}, "
                                     "which scratchlm's encoder does not do")
    ignore_merges = model.get("ignore_merges", False)
    if not isinstance(ignore_merges, bool):
        raise _unreadable(path, f"model.ignore_merges is {ignore_merges!r}, not true/false")
    try:
        return Pipeline(pattern, nfc=nfc, ignore_merges=ignore_merges)
    except ValueError as error:  # a Split regex Python's regex module cannot compile
        raise UnsupportedHFTokenizer(f"{path}: {error}") from None


def _read_pre_tokenizer(pre_tokenizer: object, path: Path) -> str:
    """The split pattern of GPT-2's ByteLevel pre-tokenizer, or of Split(Regex, Isolated) + ByteLevel."""
    kind = pre_tokenizer.get("type") if isinstance(pre_tokenizer, dict) else None
    if kind == "ByteLevel":
        _check_byte_level(pre_tokenizer, path, use_regex=True)
        return GPT2_SPLIT_PATTERN
    members = pre_tokenizer.get("pretokenizers") if kind == "Sequence" else None
    kinds = [member.get("type") if isinstance(member, dict) else None for member in members or []]
    if kinds != ["Split", "ByteLevel"]:
        shown = f"Sequence of {kinds}" if kind == "Sequence" else repr(kind)
        raise UnsupportedHFTokenizer(f"{path}: a Hugging Face tokenizer with pre-tokenizer {shown}; scratchlm reads "
                                     "'ByteLevel' (GPT-2's regex) or a Sequence of 'Split' (a regex) and 'ByteLevel'")
    split, byte_level = members
    _check_byte_level(byte_level, path, use_regex=False)
    pattern = split.get("pattern")
    if not (isinstance(pattern, dict) and list(pattern) == ["Regex"] and isinstance(pattern["Regex"], str)):
        raise UnsupportedHFTokenizer(f"{path}: the Split pre-tokenizer's pattern is {pattern!r}; scratchlm reads a "
                                     '{"Regex": ...} pattern')
    for name, wanted in (("behavior", "Isolated"), ("invert", False)):
        if split.get(name) != wanted:
            raise UnsupportedHFTokenizer(f"{path}: the Split pre-tokenizer sets {name} {split.get(name)!r}; "
                                         f"scratchlm's pre-tokens are the regex's matches ({name} {wanted!r})")
    return pattern["Regex"]


def _check_byte_level(byte_level: dict, path: Path, *, use_regex: bool) -> None:
    """A ByteLevel pre-tokenizer with no prefix space and use_regex as wanted (GPT-2's regex alone, or no regex
    after a Split)."""
    if not isinstance(byte_level.get("add_prefix_space"), bool):
        raise _unreadable(path, "the ByteLevel pre-tokenizer has no add_prefix_space true/false")
    changes = {
        "add_prefix_space": byte_level["add_prefix_space"],  # a space put before the text
        "use_regex": byte_level.get("use_regex", True) != use_regex,  # no split, or GPT-2's regex after a Split
    }
    changed = [f"{name} {byte_level.get(name, True)!r}" for name, is_set in changes.items() if is_set]
    if changed:
        raise UnsupportedHFTokenizer(f"{path}: this byte-level BPE tokenizer's ByteLevel pre-tokenizer sets "
                                     f"{', '.join(changed)}, which scratchlm's encoder does not do")


def _read_normalizer(normalizer: object, path: Path) -> bool:
    """Whether the normalizer is NFC (null, or an empty Sequence: none at all); any other is refused by name."""
    if normalizer is None:
        return False
    kind = normalizer.get("type") if isinstance(normalizer, dict) else None
    kinds: list | None = [kind]
    if kind == "Sequence":
        members = normalizer.get("normalizers")
        kinds = [m.get("type") if isinstance(m, dict) else None for m in members] if isinstance(members, list) else None
    if kinds in ([], ["NFC"]):
        return kinds == ["NFC"]
    shown = f"Sequence of {kinds}" if kind == "Sequence" else repr(kind)
    raise UnsupportedHFTokenizer(f"{path}: a Hugging Face tokenizer with normalizer {shown}; scratchlm reads none "
                                 "or 'NFC'")


def _read_vocab(model: dict, path: Path) -> dict[str, int]:
    hf_vocab = model.get("vocab")
    if not isinstance(hf_vocab, dict):
        raise _unreadable(path, "model.vocab is missing or not an object")
    check_token_ids(hf_vocab, path)
    return hf_vocab


def _read_merges(model: dict, path: Path) -> list[tuple[str, str]]:
    """model.merges as (left, right) strings: ``"left right"`` (all versions) or ``["left", "right"]`` (0.20+)."""
    merges = model.get("merges", [])
    if not isinstance(merges, list):
        raise _unreadable(path, "model.merges is not a list")
    pairs = []
    for rank, merge in enumerate(merges):
        pair = merge.split(" ") if isinstance(merge, str) else merge
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(part, str) and part for part in pair)):
            raise _unreadable(path, f"merge #{rank} {merge!r} is not two tokens")
        pairs.append((pair[0], pair[1]))
    return pairs


def _read_added_tokens(document: dict, hf_vocab: dict[str, int], pipeline: Pipeline,
                       path: Path) -> tuple[dict[int, str], dict[str, AddedTokenFlags]]:
    """{id: text} of the added tokens, in the file's order, each checked to get from HF the id the file gives it,
    and {text: flags} of each.

    HF loads an added token by its text: the id the model's vocab gives that text, else the next id after the
    vocab and after the added tokens before it. A file whose ids disagree loads in HF with other ids than it says.
    With a normalizer, HF matches an added token marked normalized=true on the normalized text, where ours are
    matched on the raw text: such a token is refused.
    """
    entries = document.get("added_tokens", [])
    if not isinstance(entries, list):
        raise _unreadable(path, "added_tokens is not a list")
    added: dict[int, str] = {}
    flags: dict[str, AddedTokenFlags] = {}
    vocab_ids = set(hf_vocab.values())
    for position, entry in enumerate(entries):
        token, token_id, flags[token] = _read_added_token(entry, position, path)
        expected = hf_vocab.get(token, max([len(hf_vocab), *(i + 1 for i in added)]))
        if token_id != expected:
            raise _unreadable(path, f"added token {token!r} has id {token_id}, but Hugging Face gives it {expected}")
        if token_id in added or (token not in hf_vocab and token_id in vocab_ids):
            raise _unreadable(path, f"added token {token!r} has id {token_id}, which another token holds")
        added[token_id] = token
        if pipeline.nfc and flags[token].normalized:
            raise UnsupportedHFTokenizer(f"{path}: added token {token!r} sets normalized true with the NFC "
                                         "normalizer; scratchlm matches added tokens on the raw text")
    _check_one_matching_pass({token: flag.normalized for token, flag in flags.items()}, path)
    return added, flags


def _read_added_token(entry: object, position: int, path: Path) -> tuple[str, int, AddedTokenFlags]:
    if not isinstance(entry, dict):
        raise _unreadable(path, f"added token #{position} is not an object")
    token, token_id = entry.get("content"), entry.get("id")
    if not isinstance(token, str) or not token or type(token_id) is not int or token_id < 0:
        raise _unreadable(path, f"added token #{position} needs a non-empty content and a non-negative id")
    if not token.isascii() and any("\ud800" <= char <= "\udfff" for char in token):  # JSON can spell them
        raise _unreadable(path, f"added token #{position} {token!r} holds a lone surrogate, which is not text")
    options = [option for option in ("single_word", "lstrip", "rstrip") if entry.get(option)]
    if options:
        raise UnsupportedHFTokenizer(f"{path}: added token {token!r} sets {', '.join(options)}; scratchlm matches a "
                                     "special token by its exact text")
    # tokenizers refuses an entry without the two; read leniently, as before: special as we write, normalized true
    special, normalized = entry.get("special", True), entry.get("normalized", True)
    if not (isinstance(special, bool) and isinstance(normalized, bool)):
        raise _unreadable(path, f"added token #{position} {token!r} has special {special!r} and normalized "
                                f"{normalized!r}, not true/false")
    return token, token_id, AddedTokenFlags(special=special, normalized=normalized)


def _check_one_matching_pass(normalized: dict[str, bool], path: Path) -> None:
    """HF cuts out the added tokens marked normalized=false first and the others afterwards, in what is left; we
    cut out all of them in one pass (leftmost, then longest). Both cut the same text unless a token of one group
    can overlap one of the other, as "ab" and "bc" overlap in "abc"."""
    raw = [token for token, is_normalized in normalized.items() if not is_normalized]
    cooked = [token for token, is_normalized in normalized.items() if is_normalized]
    for first in raw:
        clash = next((second for second in cooked if _can_overlap(first, second)), None)
        if clash is not None:
            raise UnsupportedHFTokenizer(f"{path}: added tokens {first!r} (normalized false) and {clash!r} "
                                         "(normalized true) can overlap in a text, and HF matches the two groups "
                                         "one after the other where scratchlm matches all at once")


def _can_overlap(a: str, b: str) -> bool:
    """Whether one text can hold an occurrence of a and one of b that share a character."""
    shorter = min(len(a), len(b))
    return a in b or b in a or any(a.endswith(b[:k]) or b.endswith(a[:k]) for k in range(1, shorter))
