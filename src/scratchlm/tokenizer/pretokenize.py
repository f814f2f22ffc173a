"""Pre-tokenization: split text on special tokens, then into pre-tokens with a split pattern.

BPE never merges across a pre-token boundary, and special tokens are cut out before the regex runs, so no
pre-token crosses one. The trainer and the encoder both split here. The pattern is the tokenizer's
(``pipeline.py``): GPT-2's by default, a named one below, or any regex. As Hugging Face's ``Split`` pre-tokenizer
with behavior "Isolated" does, each match is a pre-token and so is each stretch of text between two matches.
The named patterns, each copied character for character from its source:

    gpt2    GPT-2's encoder.py (openai/gpt-2), which tiktoken calls r50k_base
    gpt4    tiktoken's cl100k_base ``pat_str`` (tiktoken_ext/openai_public.py), spelled for every regex engine
    llama3  the ``Split`` regex of Meta Llama 3's tokenizer.json: gpt4's without its end-of-text clause
    qwen2   the ``Split`` regex of Qwen2's (and Qwen3's) tokenizer.json: Llama 3's with single digits (``\\p{N}``)

The fast paths rely on two facts of the named patterns (``has_known_boundaries``; docs/tokenizer-encoding.md gives
the argument, tests check it): a space after a non-whitespace character always starts a pre-token, and so does a
character right after ``X"\\n"`` where X and it are printable ASCII; and no pre-token left of either position
depends on what follows it (gpt4's end-of-text clause matches there just what ``\\s*[\\r\\n]+`` matches when text
follows). A custom pattern is taken on no such trust: its text is split only at special tokens.
For GPT-2's pattern the encoder also cuts text with ``str.split(" ")`` and runs an ASCII spelling of the pattern
through ``re``; the word helpers at the end state those facts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from functools import cache

import regex

# GPT-2's pattern (the one tiktoken calls "r50k_base"/"gpt2").
GPT2_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Llama 3's: case-blind contractions, an optional non-letter before a word, digits in groups of up to three,
# punctuation that keeps its line ends, and line ends apart from other whitespace (tiktoken's cl100k_base as
# tiktoken spelled it before 0.7).
LLAMA3_SPLIT_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
                        r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# GPT-4's (tiktoken's cl100k_base now): Llama 3's, and whitespace that ends the text is one pre-token ("a\n " ->
# "a", "\n "; Llama 3: "a", "\n", " "). tiktoken spells that clause ``\s++$`` and the rest possessively
# (``\p{N}{1,3}+``...), which splits the same (tested); but Hugging Face's regex engine reads ``{1,3}+`` as a
# repeat and its ``$`` as the end of any line, so the end of the text is spelled ``(?![\s\S])`` (no character
# follows), after an atomic ``(?>\s+)``: a whitespace run not at the end is given up at once, not retried one
# character shorter each time.
GPT4_SPLIT_PATTERN = LLAMA3_SPLIT_PATTERN.replace(r"|\s*[\r\n]+", r"|(?>\s+)(?![\s\S])|\s*[\r\n]+")
# Qwen2's (and Qwen3's): Llama 3's with single digits.
QWEN2_SPLIT_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                       r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
NAMED_PATTERNS = {"gpt2": GPT2_SPLIT_PATTERN, "gpt4": GPT4_SPLIT_PATTERN, "llama3": LLAMA3_SPLIT_PATTERN,
                  "qwen2": QWEN2_SPLIT_PATTERN}
_KNOWN_BOUNDARY_PATTERNS = frozenset(NAMED_PATTERNS.values())

GPT2_SPLIT_REGEX = regex.compile(GPT2_SPLIT_PATTERN)
_WHITESPACE = regex.compile(r"\s")
_ASCII_WHITESPACE = frozenset(" \t\n\x0b\x0c\r")  # the ASCII characters that regex's ``\s`` matches
# The same pattern for ASCII-only text, where \p{L} is [A-Za-z], \p{N} is [0-9] and \s is _ASCII_WHITESPACE
# (spelled out: the standard library's \s also takes \x1c-\x1f). ``re`` runs it 2-3x faster per call than
# ``regex`` runs the Unicode pattern, and the encoder's cold path makes one call per new word.
_S = re.escape("".join(sorted(_ASCII_WHITESPACE)))  # inside the character classes below
GPT2_ASCII_SPLIT_REGEX = re.compile(
    rf"""'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]+| ?[^{_S}A-Za-z0-9]+|[{_S}]+(?![^{_S}])|[{_S}]+""")


def pattern_from_name(spec: str) -> str:
    """The regex of a named pattern (gpt2, gpt4, llama3, qwen2), or spec itself when it names none."""
    return NAMED_PATTERNS.get(spec, spec)


@cache
def compile_pattern(pattern: str) -> regex.Pattern:
    """The compiled split pattern; a ValueError naming it when it does not compile or matches the empty text
    (an empty pre-token is no token, and libraries disagree on where such a regex matches next)."""
    try:
        compiled = regex.compile(pattern)
    except regex.error as error:
        raise ValueError(f"split pattern {pattern!r} is not a valid regex ({error})") from None
    if compiled.match("") is not None:
        raise ValueError(f"split pattern {pattern!r} matches the empty text; a pre-token holds at least one "
                         "character")
    return compiled


def has_known_boundaries(pattern: str) -> bool:
    """Whether pattern is a named one, whose pre-tokens always start at the positions the module docstring names
    (so text can be cut there into parts split on their own)."""
    return pattern in _KNOWN_BOUNDARY_PATTERNS


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


def pretokens(text: str, pattern: str = GPT2_SPLIT_PATTERN) -> list[str]:
    """The pre-tokens of text that holds no special tokens, by the Unicode pattern alone (the reference): its
    matches, and the text between two matches (as HF's Split "Isolated" keeps it)."""
    return _isolated(compile_pattern(pattern), text)


def split_pretokens(text: str, pattern: str = GPT2_SPLIT_PATTERN) -> list[str]:
    """``pretokens(text, pattern)``; GPT-2's pattern runs its faster ASCII spelling when text is ASCII (an O(1)
    check in CPython)."""
    if pattern == GPT2_SPLIT_PATTERN:
        return (GPT2_ASCII_SPLIT_REGEX if text.isascii() else GPT2_SPLIT_REGEX).findall(text)
    return pretokens(text, pattern)


def _isolated(compiled: regex.Pattern, text: str) -> list[str]:
    """The matches of compiled in text, and the non-empty stretches between them, in order."""
    if not compiled.groups:  # findall gives whole matches only for a pattern without groups
        pieces = compiled.findall(text)
        if sum(map(len, pieces)) == len(text):  # every character matched (always, for the named patterns)
            return pieces
    pieces, position = [], 0
    for match in compiled.finditer(text):
        if match.start() > position:
            pieces.append(text[position:match.start()])
        pieces.append(match.group())
        position = match.end()
    if position < len(text):
        pieces.append(text[position:])
    return pieces


def line_start_boundary(text: str) -> int:
    """Index just after the last ``"\\n"`` in text that has a printable ASCII character on each side, or 0."""
    newline = text.rfind("\n", 1, len(text) - 1)
    while newline > 0 and not ("!" <= text[newline - 1] <= "~" and "!" <= text[newline + 1] <= "~"):
        newline = text.rfind("\n", 1, newline)
    return newline + 1 if newline > 0 else 0


def spaced_word_pieces(word: str) -> list[str]:
    """The GPT-2 pre-tokens of " " + word, for a complete word (an ASCII word of letters or digits is one:
    `` ?\\p{L}+`` or `` ?\\p{N}+``)."""
    if word.isascii() and (word.isalpha() or word.isdigit()):
        return [" " + word]
    return split_pretokens(" " + word)


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
