"""The encoder's speed paths, switched on by ``Tokenizer(..., fast=True)`` (the default).

``CachedBPE`` is the one entry point, a ``bpe.PieceEncoder`` like ``bpe.ReadableBPE`` and equal to it (tested on
random, adversarial and whole-file text). Inside: word and pre-token caches and the ``str.split`` hot loop
(``cached_bpe.py``), a C-level scan and a heap for single pieces (``merge.py``), numpy batch merging of a cold
block's new pre-tokens (``batch_merge.py``) and rank rounds in bounded memory for pieces of a megabyte or more
(``long_merge.py``). They need only CPython and numpy and win on any CPU (on a 2-core x86 machine, ~12x the readable
path's speed on natural text with cold caches; see docs/tokenizer-encoding.md), so they are on by default everywhere.

``tiktoken_engine.py`` is the optional native path: ``TiktokenTokenizer``, a ``Tokenizer`` whose ordinary text goes
through tiktoken (Rust) with the same ids, for huge varied corpora (``scratchlm data encode --engine tiktoken``).
It needs the ``[fast]`` extra, so it is imported only when asked for.
"""

from scratchlm.tokenizer.fast.cached_bpe import CachedBPE

__all__ = ["CachedBPE"]
