"""The text stages a tokenizer carries besides its vocab and merges: normalizer, split pattern, ignore_merges.

A Hugging Face tokenizer.json names them normalizer, pre_tokenizer and the BPE model's ``ignore_merges``; these
are the ones scratchlm encodes exactly (``formats/hf.py`` refuses the others by name)::

    nfc            the text between special tokens is put in Unicode NFC first (Qwen2's normalizer)
    pattern        the regex that splits it into pre-tokens (``pretokenize.py``: GPT-2's by default, or gpt4,
                   llama3, qwen2, or any regex)
    ignore_merges  a pre-token whose bytes are one vocab token is that token, unmerged (Llama 3's BPE model)

GPT-2's pipeline (GPT-2's pattern, nothing else) is the default, and adds nothing to a tokenizer's identity: its
``Tokenizer.hash`` is the one recorded before pipelines existed. Any other setting adds a line to the hash.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from scratchlm.tokenizer.pretokenize import GPT2_SPLIT_PATTERN, compile_pattern


@dataclass(frozen=True)
class Pipeline:
    """Normalizer, split pattern and ignore_merges of a byte-level BPE tokenizer (GPT-2's by default)."""

    pattern: str = GPT2_SPLIT_PATTERN
    nfc: bool = False
    ignore_merges: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise ValueError(f"split pattern must be a string, got {self.pattern!r}")
        compile_pattern(self.pattern)
        for name in ("nfc", "ignore_merges"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def splits_like_gpt2(self) -> bool:
        """Whether text is split exactly as GPT-2 splits it (its pattern, no normalizer): the encoder's GPT-2
        shortcuts apply to the raw text."""
        return self.pattern == GPT2_SPLIT_PATTERN and not self.nfc

    def normalize(self, text: str) -> str:
        """text as the pattern sees it (NFC when set; CPython returns normalized text as it is, after a quick
        check)."""
        return unicodedata.normalize("NFC", text) if self.nfc else text

    def identity_lines(self) -> list[str]:
        """The lines ``Tokenizer.hash`` adds for each setting that is not GPT-2's (none for GPT-2's pipeline)."""
        lines = [f"p{self.pattern.encode('utf-8').hex()}\n"] if self.pattern != GPT2_SPLIT_PATTERN else []
        if self.nfc:
            lines.append("nNFC\n")
        if self.ignore_merges:
            lines.append("i\n")
        return lines


GPT2_PIPELINE = Pipeline()
