"""bits_per_byte against a direct F.cross_entropy computation, and token byte lengths against decode_bytes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import gpt2_tokenizer
from scratchlm.model import TransformerLM
from scratchlm.model.config import ModelConfig
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.train.bits_per_byte import bits_per_byte, token_byte_lengths

EOT = "<|endoftext|>"


def oracle_nats(model: torch.nn.Module, tokens: np.ndarray, context: int, targets: int) -> float:
    """Total NLL of the first ``targets`` targets, window by window, with F.cross_entropy."""
    ids = torch.from_numpy(tokens.astype(np.int64))
    total = 0.0
    for start in range(0, targets, context):
        length = min(context, targets - start)
        inputs, window_targets = ids[start:start + length], ids[start + 1:start + length + 1]
        logits = model(inputs[None])[0]
        total += F.cross_entropy(logits.double(), window_targets, reduction="sum").item()
    return total


@pytest.fixture
def tiny_model() -> TransformerLM:
    return TransformerLM(ModelConfig.preset("tiny")).eval()  # vocab 256, context 32


@pytest.mark.parametrize(("max_targets", "batch_size"), [(150, 3), (128, 8), (None, 2), (5, 1)])
def test_matches_cross_entropy_oracle(tiny_model, max_targets, batch_size):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=200).astype(np.uint16)
    byte_lengths = rng.integers(1, 6, size=256)
    result = bits_per_byte(tiny_model, tokens, byte_lengths, context=32, max_targets=max_targets,
                           batch_size=batch_size)
    targets = 199 if max_targets is None else max_targets
    with torch.no_grad():
        nats = oracle_nats(tiny_model, tokens, 32, targets)
    num_bytes = int(byte_lengths[tokens[1:targets + 1]].sum())
    assert (result.targets, result.bytes) == (targets, num_bytes)
    assert result.nats_per_token == pytest.approx(nats / targets, rel=1e-5)
    assert result.bits_per_byte == pytest.approx(nats / math.log(2) / num_bytes, rel=1e-5)


def test_uniform_logits_cost_log_vocab_per_token():
    tokens = np.arange(100) % 7
    result = bits_per_byte(lambda x: torch.zeros(*x.shape, 7), tokens, np.full(7, 2), context=16)
    assert result.nats_per_token == pytest.approx(math.log(7), rel=1e-7)
    assert result.bits_per_byte == pytest.approx(math.log2(7) / 2, rel=1e-7)


@pytest.mark.parametrize("shift", [0, 2])
def test_windows_predict_the_next_token(shift):
    """tokens = 0, 1, 2, ...: a model that predicts input + 1 is perfect only if targets are the inputs shifted
    by exactly one; one that predicts input + 0 or + 2 pays ~1e4 nats on every token."""
    tokens = np.arange(90)

    def predicts(offset):
        return lambda x: 1e4 * F.one_hot((x + offset).clamp(max=99), 100).float()

    perfect = bits_per_byte(predicts(1), tokens, np.ones(100), context=16, max_targets=80, batch_size=3)
    assert perfect.nats_per_token < 1e-6
    assert bits_per_byte(predicts(shift), tokens, np.ones(100), context=16).nats_per_token > 1e3


def small_tokenizer() -> Tokenizer:
    vocab = {i: bytes([i]) for i in range(256)} | {256: b"he", 257: b"ll", 258: b"hell", 259: "é".encode()}
    merges = [(b"h", b"e"), (b"l", b"l"), (b"he", b"ll"), (b"\xc3", b"\xa9")]
    return Tokenizer(vocab, merges, [EOT, "<pad>"])


def test_byte_lengths_are_decoded_lengths_and_specials_one_byte():
    tokenizer = small_tokenizer()
    lengths = token_byte_lengths(tokenizer)
    assert len(lengths) == tokenizer.vocab_size
    specials = {tokenizer.special_id(token) for token in tokenizer.special_tokens}
    for token_id in range(tokenizer.vocab_size):
        expected = 1 if token_id in specials else len(tokenizer.decode_bytes([token_id]))
        assert lengths[token_id] == expected, token_id
    ids = tokenizer.encode(f"hello é{EOT}he said<pad>")
    assert int(lengths[ids].sum()) == len("hello é".encode()) + 1 + len(b"he said") + 1


def test_byte_lengths_of_gpt2_on_random_ids():
    tokenizer = gpt2_tokenizer()
    lengths = token_byte_lengths(tokenizer)
    eot = tokenizer.special_id(EOT)
    ids = np.random.default_rng(1).integers(0, tokenizer.vocab_size, size=5000).tolist() + [eot, eot]
    assert int(lengths[ids].sum()) == len(tokenizer.decode_bytes(ids)) - ids.count(eot) * (len(EOT) - 1)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(context=0), "context and batch_size must be >= 1"),
    (dict(batch_size=0), "context and batch_size must be >= 1"),
    (dict(max_targets=0), "max_targets must be >= 1"),
    (dict(tokens=np.array([3])), "need at least 2 tokens"),
    (dict(tokens=np.array([1, 2, 9, 3])), "token id 9 at position 2 has no byte length"),
    (dict(logits_fn=lambda x: torch.zeros(x.shape[0], 8)), r"must return \(B, T, V\) logits"),
])
def test_bad_arguments_are_named(kwargs, message):
    arguments = dict(logits_fn=lambda x: torch.zeros(*x.shape, 8), tokens=np.array([1, 2, 3, 4]),
                     byte_lengths=np.ones(8), context=2) | kwargs
    with pytest.raises(ValueError, match=message):
        bits_per_byte(**arguments)
