"""Pre-tokenization: split text on special tokens, then into GPT-2 pre-tokens.

BPE never merges across a pre-token boundary, and special tokens are cut out before the regex runs, so they
never take part in merges and no pre-token crosses them. Both the trainer and the encoder use this module.

The encoder also cuts text at spaces (``str.split(" ")`` is far cheaper than the regex): a space that follows a
non-whitespace character always starts a pre-token, so " " + word is pre-tokenized on its own when the word is
*complete* (ends in a non-whitespace character). The word helpers at the end state those facts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import regex

# GPT-2's pattern (the one tiktoken calls "r50k_base"/"gpt2").
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_SPLIT_REGEX = regex.compile(GPT2_SPLIT_PATTERN)
_WHITESPACE = regex.compile(r"\s")
_ASCII_WHITESPACE = frozenset(" \t\n\x0b\x0c\r")  # the ASCII characters that regex's ``\s`` matches
# The same pattern for ASCII-only text, where \p{L} is [A-Za-z], \p{N} is [0-9] and \s is _ASCII_WHITESPACE
# (spelled out: the standard library's \s also takes \x1c-\x1f). ``re`` runs it 2-3x faster per call than
# ``regex`` runs the Unicode pattern, and the encoder's cold path makes one call per new word.
_S = re.escape("".join(sorted(_ASCII_WHITESPACE)))  # inside the character classes below
GPT2_ASCII_SPLIT_REGEX = re.compile(
    rf"""'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]+| ?[^{_S}A-Za-z0-9]+|[{_S}]+(?![^{_S}])|[{_S}]+""")


def validate_special_tokens(special_tokens: Iterable[str] | None) -> list[str]:
    """Reject empty and duplicate special tokens; return them as a list (order kept)."""
    tokens = list(special_tokens or [])
    seen: set[str] = set()
    for position, token in enumerate(tokens):
        if not isinstance(token, str) or token == "":
            raise ValueError(f"special token #{position} is empty or not a string: {token!r}")
        if token in seen:
            raise ValueError(f"special token {token!r} is given more than once")
        seen.add(token)
    return tokens


def special_token_regex(special_tokens: Iterable[str]) -> regex.Pattern | None:
    """A regex that matches any special token, longest first (so overlapping specials match the longest)."""
    tokens = sorted(set(special_tokens), key=len, reverse=True)
    if not tokens:
        return None
    return regex.compile("|".join(regex.escape(token) for token in tokens))


def split_on_special_tokens(text: str, special_regex: regex.Pattern | None) -> Iterator[tuple[str, bool]]:
    """Yield (piece, is_special) in order; ordinary pieces may be empty strings and are skipped."""
    if special_regex is None:
        if text:
            yield text, False
        return
    position = 0
    for match in special_regex.finditer(text):
        if match.start() > position:
            yield text[position:match.start()], False
        yield match.group(), True
        position = match.end()
    if position < len(text):
        yield text[position:], False


def pretokens(text: str) -> list[str]:
    """GPT-2 pre-tokens of text that holds no special tokens, by the Unicode pattern alone (the reference)."""
    return GPT2_SPLIT_REGEX.findall(text)


def split_pretokens(text: str) -> list[str]:
    """``pretokens(text)``, through the faster ASCII pattern when text is ASCII (an O(1) check in CPython)."""
    return (GPT2_ASCII_SPLIT_REGEX if text.isascii() else GPT2_SPLIT_REGEX).findall(text)


def spaced_word_pieces(word: str) -> list[str]:
    """The GPT-2 pre-tokens of " " + word, for a complete word."""
    return [" " + word] if is_one_pretoken(word) else split_pretokens(" " + word)


def is_one_pretoken(word: str) -> bool:
    """Whether " " + word is one GPT-2 pre-token (`` ?\\p{L}+`` or `` ?\\p{N}+``), for the common ASCII case."""
    return word.isascii() and (word.isalpha() or word.isdigit())


def ends_in_whitespace(word: str) -> bool:
    """Whether word's last character is whitespace in the GPT-2 pattern's sense (regex ``\\s``)."""
    last = word[-1]
    if last.isascii():  # nearly always; a set lookup is cheaper than a regex call
        return last in _ASCII_WHITESPACE
    return _WHITESPACE.match(last) is not None


def last_space_boundary(text: str) -> int:
    """Index of the last space in text that follows a non-whitespace character, or 0 if there is none."""
    space = text.rfind(" ")
    while space > 0 and _WHITESPACE.match(text, space - 1):
        space = text.rfind(" ", 0, space)
    return max(space, 0)
