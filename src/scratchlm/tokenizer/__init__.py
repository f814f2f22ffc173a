"""tokenizer stage of scratchlm: byte-level BPE training, encoding and tokenizer files.

Reading order: ``bpe.py`` (training and encoding as the handout and minbpe write them: slow, obviously correct,
the oracle of everything else); ``pretokenize.py`` and ``pipeline.py`` (how text is split before BPE);
``tokenizer.py`` (the ``Tokenizer``: special tokens, decoding, streaming); then the speed paths, each tested equal
to ``bpe.py``: ``train_bpe.py`` (with ``counting.py``, ``training_inputs.py``, ``long_words.py``) and ``fast/``;
and ``formats/``, the files a tokenizer is saved in.

`Tokenizer` is imported on first use, so that training a tokenizer (a short-lived process) does not pay for the
encoder's imports.
"""

from scratchlm.tokenizer.pretokenize import GPT2_SPLIT_PATTERN
from scratchlm.tokenizer.train_bpe import train_bpe

__all__ = ["GPT2_SPLIT_PATTERN", "Tokenizer", "train_bpe"]


def __getattr__(name: str):
    if name == "Tokenizer":
        from scratchlm.tokenizer.tokenizer import Tokenizer

        return Tokenizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
