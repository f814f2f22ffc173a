"""Bits per byte: a language model's loss in units that do not depend on its tokenizer.

Nats per token cannot compare models with different tokenizers; the total loss in bits over the UTF-8 bytes the
scored tokens stand for can (it is the cost of compressing the text). The text is scored in the consecutive
non-overlapping windows of the model's context that ``validation_batches`` makes (a shorter last one, so exactly
the first ``max_targets`` targets count), through any ``logits_fn(inputs (B, T)) -> logits (B, T, V)``, so
scratchlm's model and a Hugging Face one share the code. A special token such as ``<|endoftext|>`` counts as ONE
byte: it stands for a document boundary, not the 13 characters of its spelling.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from scratchlm.tokenizer.tokenizer import Tokenizer

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class BitsPerByte:
    nats_per_token: float
    bits_per_byte: float
    targets: int  # tokens scored
    bytes: int  # UTF-8 bytes those tokens stand for (special tokens: 1 each)


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """(vocab_size,) int64: the UTF-8 bytes each id decodes to, special tokens 1 (ids the vocab lacks: 0)."""
    lengths = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for token_id, token in tokenizer.vocab.items():
        lengths[token_id] = len(token)
    for special in tokenizer.special_tokens:
        lengths[tokenizer.special_id(special)] = 1
    return lengths


def _token_nats(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed negative log-likelihood (float64, 0-d) of targets (B, T) under logits (B, T, V)."""
    logits = logits.float()
    target_logits = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return (torch.logsumexp(logits, dim=-1) - target_logits).double().sum()


def _check_arguments(tokens: np.ndarray, context: int, max_targets: int | None, batch_size: int) -> None:
    if context < 1 or batch_size < 1:
        raise ValueError(f"bits_per_byte: context and batch_size must be >= 1, got {context} and {batch_size}")
    if max_targets is not None and max_targets < 1:
        raise ValueError(f"bits_per_byte: max_targets must be >= 1 or None, got {max_targets}")
    if len(tokens) < 2:
        raise ValueError(f"bits_per_byte: need at least 2 tokens (one input, one target), got {len(tokens)}")


def _check_ids(used: np.ndarray, byte_lengths: np.ndarray) -> None:
    """Every id scored must have a byte length (a token file from another tokenizer would not)."""
    unknown = (used < 0) | (used >= len(byte_lengths))
    if unknown.any():
        position = int(np.argmax(unknown))
        raise ValueError(f"bits_per_byte: token id {int(used[position])} at position {position} has no byte length "
                         f"(byte_lengths covers ids 0..{len(byte_lengths) - 1})")


@torch.no_grad()
def bits_per_byte(logits_fn: LogitsFn, tokens: np.ndarray, byte_lengths: np.ndarray, context: int,
                  max_targets: int | None = None, *, batch_size: int = 8,
                  device: str | torch.device = "cpu") -> BitsPerByte:
    """Score the first ``max_targets`` targets of ``tokens`` (all when None) in windows of ``context``.

    tokens: 1-D ids (a token file's memmap is fine); byte_lengths: ``token_byte_lengths`` of the tokenizer.
    """
    tokens = np.asarray(tokens)
    byte_lengths = np.asarray(byte_lengths)
    _check_arguments(tokens, context, max_targets, batch_size)
    targets = len(tokens) - 1 if max_targets is None else min(max_targets, len(tokens) - 1)
    used_ids = tokens[:targets + 1].astype(np.int64)
    _check_ids(used_ids, byte_lengths)
    used = torch.from_numpy(used_ids)
    full_windows, remainder = divmod(targets, context)
    total = torch.zeros((), dtype=torch.float64)
    for first in range(0, full_windows, batch_size):
        rows = min(batch_size, full_windows - first)
        chunk = used[first * context:(first + rows) * context + 1].to(device)
        inputs, window_targets = chunk[:-1].view(rows, context), chunk[1:].view(rows, context)
        total += _token_nats(_checked_logits(logits_fn, inputs), window_targets).cpu()
    if remainder:
        chunk = used[full_windows * context:].to(device)
        total += _token_nats(_checked_logits(logits_fn, chunk[:-1][None]), chunk[1:][None]).cpu()
    nats = total.item()
    num_bytes = int(byte_lengths[used_ids[1:]].sum())
    return BitsPerByte(nats_per_token=nats / targets, bits_per_byte=nats / math.log(2) / num_bytes,
                       targets=targets, bytes=num_bytes)


def _checked_logits(logits_fn: LogitsFn, inputs: torch.Tensor) -> torch.Tensor:
    logits = logits_fn(inputs)
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(inputs.shape):
        raise ValueError(f"bits_per_byte: logits_fn must return (B, T, V) logits for inputs {tuple(inputs.shape)}, "
                         f"got shape {tuple(logits.shape)}")
    return logits
