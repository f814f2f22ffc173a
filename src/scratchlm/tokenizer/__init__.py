"""tokenizer stage of scratchlm: byte-level BPE training, encoding and tokenizer files."""

from scratchlm.tokenizer.pretokenize import GPT2_SPLIT_PATTERN
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.tokenizer.train_bpe import train_bpe

__all__ = ["GPT2_SPLIT_PATTERN", "Tokenizer", "train_bpe"]
