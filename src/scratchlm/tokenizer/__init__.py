"""tokenizer stage of scratchlm: byte-level BPE training, encoding and tokenizer files."""

from scratchlm.tokenizer.pretokenize import GPT2_SPLIT_PATTERN
from scratchlm.tokenizer.tokenizer import Tokenizer

__all__ = ["GPT2_SPLIT_PATTERN", "Tokenizer", "train_bpe"]


def __getattr__(name: str):
    # The trainer is imported on first use: it is heavier than the encoder and not needed to encode.
    if name == "train_bpe":
        from scratchlm.tokenizer.train_bpe import train_bpe

        return train_bpe
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
