"""The fused decoding step (model/kernels/decode_step.py) equals the model's forward with a KV cache: logits and the
cache it leaves, over many steps, for every switch it supports, with left padding and merged caches, with packed
and unpacked weights; and everything it does not support goes to the forward."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.testing import assert_close

from scratchlm.generate import batch_cache
from scratchlm.model import KVCache, ModelConfig, TransformerLM, kernels
from scratchlm.model.kernels import decode_step, packed_linear
from scratchlm.model.kernels.decode_step import DecodeStep
from scratchlm.model.kernels.packed_linear import packed_weights

TOLERANCE = {torch.float64: dict(rtol=1e-9, atol=1e-9), torch.float32: dict(rtol=2e-5, atol=2e-5),
             torch.bfloat16: dict(rtol=3e-2, atol=6e-2)}
SWITCHES = [{}, {"qk_norm": True}, {"position": "nope", "tie_embeddings": True}, {"ffn": "relu2"}, {"ffn": "silu"},
            {"norm": "layernorm"}, {"norm": "none", "ffn": "relu2"},
            {"num_kv_heads": 1, "qkv_bias": True, "head_dim": 24}, {"logit_softcap": 3.0},
            {"num_kv_heads": 2, "qk_norm": True, "rope_scaling": "llama3", "rope_original_context": 32}]


def _model(dtype: torch.dtype = torch.float32, **overrides) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.preset("tiny", **overrides), dtype=dtype).eval()
    with torch.no_grad():  # biases and gains away from their init, where a step that dropped them would agree
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln" in name or name.startswith("ln"):
                parameter.normal_()
    return model


def _prefilled(model: TransformerLM, prompt_lengths: list[int], seed: int = 1) -> tuple[KVCache, torch.Tensor]:
    """A cache holding left-padded random prompts of these lengths, and the ids to decode after them."""
    generator = torch.Generator().manual_seed(seed)
    width, rows = max(prompt_lengths), len(prompt_lengths)
    ids = torch.randint(0, model.config.vocab_size, (rows, width + 40), generator=generator)
    mask = torch.ones(rows, width, dtype=torch.bool)
    for row, length in enumerate(prompt_lengths):
        mask[row, :width - length] = False
    cache = KVCache.for_model(model, rows)
    with torch.inference_mode():
        model(ids[:, :width], kv_cache=cache, attention_mask=mask if min(prompt_lengths) < width else None)
    return cache, ids[:, width:]


def _decode_both(model: TransformerLM, prompt_lengths: list[int], steps: int, packed: bool = True):
    """The logits of `steps` tokens decoded by the forward and by the step (its weights packed as decoding packs
    them, or not), and the two caches they leave."""
    forward_cache, ids = _prefilled(model, prompt_lengths)
    step_cache = copy.deepcopy(forward_cache)
    step = DecodeStep(model)
    packing = packed_weights(step.linears) if packed else contextlib.nullcontext()
    with torch.inference_mode(), packing:
        want = [model(ids[:, t:t + 1], kv_cache=forward_cache, last_only=True) for t in range(steps)]
        got = [step(ids[:, t:t + 1], step_cache) for t in range(steps)]
    return torch.cat(got, 1), torch.cat(want, 1), step_cache, forward_cache


def _assert_same_cache(got: KVCache, want: KVCache, tolerance: dict) -> None:
    assert (got.length, got.has_padding) == (want.length, want.has_padding)
    assert torch.equal(got.next_position, want.next_position) and torch.equal(got.key_padding, want.key_padding)
    for buffers_got, buffers_want in ((got.keys, want.keys), (got.values, want.values)):
        for layer_got, layer_want in zip(buffers_got, buffers_want):
            assert_close(layer_got[:, :, :got.length], layer_want[:, :, :want.length], **tolerance)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overrides", SWITCHES)
def test_the_step_equals_the_forward_logits_and_cache_with_left_padding(dtype, overrides):
    model = _model(dtype, **overrides)
    got, want, step_cache, forward_cache = _decode_both(model, [5, 1, 9], steps=12)
    assert got.shape == want.shape == (3, 12, model.config.vocab_size) and got.dtype == want.dtype
    assert_close(got, want, **TOLERANCE[dtype])
    _assert_same_cache(step_cache, forward_cache, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overrides", SWITCHES)
def test_a_prefill_through_the_step_equals_the_forward_in_chunks_up_to_the_context(dtype, overrides):
    """Several new tokens a row (a prompt, then a second chunk of it): each token attends to the cache and to the
    tokens before it, at its own position, until the context is full."""
    model = _model(dtype, **overrides)
    context = model.config.context_length
    ids = torch.randint(0, model.config.vocab_size, (2, context), generator=torch.Generator().manual_seed(3))
    forward_cache, step_cache = KVCache.for_model(model, 2), KVCache.for_model(model, 2)
    step = DecodeStep(model)
    with torch.inference_mode(), packed_weights(step.linears):
        for start, end in ((0, 7), (7, 12), (12, 13), (13, context)):
            want = model(ids[:, start:end], kv_cache=forward_cache, last_only=True)
            got = step(ids[:, start:end], step_cache)
            assert got.shape == want.shape == (2, 1, model.config.vocab_size)
            assert_close(got, want, **TOLERANCE[dtype])
    _assert_same_cache(step_cache, forward_cache, TOLERANCE[dtype])
    assert step_cache.length == context


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.skipif(
    not packed_linear.available(), reason="this torch has no oneDNN packed-linear ops"))])
def test_packed_and_unpacked_weights_give_the_forwards_greedy_tokens(packed):
    model = _model(**SWITCHES[-1])
    got, want, _, _ = _decode_both(model, [9, 9, 9, 9], steps=20, packed=packed)  # no padding: shared positions
    assert_close(got, want, **TOLERANCE[torch.float32])
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_merged_cache_of_rows_at_different_positions_decodes_as_each_row_alone():
    """The server's batch: rows that joined at different times (BatchCache.add), each at its own position."""
    model = _model(num_kv_heads=2)
    alone = [_prefilled(model, [length], seed) for length, seed in ((3, 1), (11, 2))]
    batch = batch_cache.BatchCache(model, capacity=3)
    for cache, _ in alone:
        batch.add(copy.deepcopy(cache))
    merged = batch.cache
    step = DecodeStep(model)
    with torch.inference_mode():
        for t in range(10):
            together = step(torch.stack([alone[0][1][0, t:t + 1], alone[1][1][0, t:t + 1]]), merged)
            for row, (cache, ids) in enumerate(alone):
                assert_close(together[row], model(ids[:, t:t + 1], kv_cache=cache, last_only=True)[0],
                             **TOLERANCE[torch.float32])


def test_what_the_step_does_not_compute_goes_to_the_forward(monkeypatch):
    model = _model()
    step = DecodeStep(model)
    calls = []
    monkeypatch.setattr(DecodeStep, "step", lambda self, ids, cache: calls.append(ids) or self.model.lm_head(
        self.model.token_embeddings(ids)))
    cache, ids = _prefilled(model, [4, 4])
    padded, _ = _prefilled(model, [4, 2])
    with torch.inference_mode():
        step(ids[:, :3], padded)  # several new tokens after padding
        step(ids[:, 3:4], padded, torch.ones(2, 1, dtype=torch.bool))  # an attention mask
        assert not calls
        step(ids[:, 4:5], cache)
        step(ids[:, 5:8], cache)  # several new tokens without padding: a prefill
        assert len(calls) == 2
    with torch.no_grad():
        model.lm_head.weight.mul_(2)  # changed in place since the step was built
    with torch.inference_mode():
        step(ids[:, 5:6], cache)
    assert len(calls) == 2
    fresh = _model()
    with torch.enable_grad():  # autograd on
        DecodeStep(fresh)(ids[:, :1], KVCache.for_model(fresh, 2))
    assert len(calls) == 2
    full = _model(context_length=8)
    full_cache, _ = _prefilled(full, [8])
    with torch.inference_mode(), pytest.raises(ValueError, match="exceeds context_length 8"):
        DecodeStep(full)(ids[:1, :1], full_cache)  # the forward's own error for a full context


def test_a_post_norm_model_decodes_through_its_forward():
    model = _model(norm_position="post")
    assert not decode_step.supports(model)
    with kernels.decoding(model) as step:
        assert not isinstance(step, DecodeStep)
        cache = KVCache.for_model(model, 2)
        ids = torch.randint(0, model.config.vocab_size, (2, 3))
        with torch.inference_mode():
            assert_close(step(ids, cache), model(ids, kv_cache=KVCache.for_model(model, 2), last_only=True))


def test_decoding_yields_the_step_and_large_models_keep_the_forward(monkeypatch):
    model = _model()
    with kernels.decoding(model) as step:
        assert isinstance(step, DecodeStep)
    monkeypatch.setattr(decode_step, "MAX_FUSED_BYTES", decode_step.fused_bytes(model) - 1)
    with kernels.decoding(model) as step:
        assert not isinstance(step, DecodeStep)
