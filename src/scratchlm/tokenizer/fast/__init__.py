"""The encoder's speed paths, switched on by ``Tokenizer(..., fast=True)`` (the default).

``CachedBPE`` is the one entry point, a ``bpe.PieceEncoder`` tested equal to ``bpe.ReadableBPE`` on random,
adversarial and whole-file text. Inside: word and pre-token caches and the ``str.split`` hot loop
(``cached_bpe.py``), a C-level scan and a heap for single pieces (``merge.py``), numpy merging of a cold block's new
pre-tokens (``batch_merge.py``) and bounded-memory rank rounds for pieces of a megabyte or more (``long_merge.py``).
They need only CPython and numpy (docs/tokenizer-encoding.md has the speeds).

``tiktoken_engine.py`` is the optional native path (``data encode --engine tiktoken``, the ``[fast]`` extra):
``TiktokenTokenizer``, a ``Tokenizer`` whose ordinary text goes through tiktoken with the same ids.
"""

from scratchlm.tokenizer.fast.cached_bpe import CachedBPE

__all__ = ["CachedBPE"]
