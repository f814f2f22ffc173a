"""How Hugging Face sees one of our special tokens beyond its text and id: its ``special`` and ``normalized`` flags.

Our encoder treats every added token alike (matched on the raw text, never merged), but a Hugging Face
tokenizer.json marks each one: ``special`` false is a plain added token ("big dog" added with ``add_tokens``), which
``decode(skip_special_tokens=True)`` keeps and transformers does not list among its special tokens; ``normalized``
says which of HF's two matching passes finds it (hf.py refuses the files where the passes differ from our
one). Neither changes our ids, so neither enters ``Tokenizer.hash``; both are kept so that a tokenizer.json read and
saved again gives HF the tokenizer it gave before. (lstrip, rstrip and single_word change the ids and are refused on
reading, so they are always false.)

A tokenizer holds flags only for the tokens whose flags differ from ``OURS``, what we write for a special token of
our own: tokenizers trained by scratchlm have none, and their files are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AddedTokenFlags:
    """A tokenizer.json added token's flags that our ids do not depend on."""

    special: bool = True
    normalized: bool = False


OURS = AddedTokenFlags()
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
