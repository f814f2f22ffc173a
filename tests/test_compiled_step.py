"""The compiled decoding step (model/kernels/compiled_step.py) equals the model's forward with a KV cache over many
steps, with left padding and the model switches it carries; it is used only where it applies (bf16 or float32 on a
CPU, one new token a row, weights unchanged since it was built). Each build takes seconds, so the cases are few
and each covers several switches."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

from scratchlm.generate.commands import say_if_not_compiled
from scratchlm.generate.decoding import generate
from scratchlm.model import KVCache, kernels
from scratchlm.model.kernels import compiled_step, cpu
from test_decode_step import TOLERANCE, _model, _prefilled

STEPS = 6
# One row and several (the two libraries, float32's one-row products summed by inductor's loop), checked to each
# dtype's tolerance, inductor's reordered sums included. (dtype, model switches, prompt lengths): the last decodes
# across a span boundary (64 columns of 160).
CASES = [(torch.float32, {}, [5]),
         (torch.float32, {"num_kv_heads": 2, "qk_norm": True, "qkv_bias": True, "logit_softcap": 3.0}, [7]),
         (torch.float32, {"num_kv_heads": 2, "qk_norm": True, "qkv_bias": True, "ffn": "silu"}, [5, 9, 2]),
         (torch.bfloat16, {}, [6]),
         (torch.bfloat16, {"num_kv_heads": 2, "qk_norm": True, "qkv_bias": True, "logit_softcap": 3.0,
                           "ffn": "silu"}, [5, 9, 2]),
         (torch.bfloat16, {"context_length": 160}, [58, 62, 60])]


@pytest.mark.parametrize(("dtype", "overrides", "prompt_lengths"), CASES)
def test_the_compiled_step_equals_the_forward_with_left_padding(dtype, overrides, prompt_lengths):
    model = _model(dtype, **overrides)
    forward_cache, ids = _prefilled(model, prompt_lengths)
    step_cache = copy.deepcopy(forward_cache)
    compiled = compiled_step.CompiledStep(model)
    with torch.inference_mode():
        want = [model(ids[:, t:t + 1], kv_cache=forward_cache, last_only=True) for t in range(STEPS)]
        got = []
        for t in range(STEPS):
            assert compiled.applies(ids[:, t:t + 1], step_cache, None)
            got.append(compiled(ids[:, t:t + 1], step_cache))
    tolerance = TOLERANCE[dtype] if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-4)
    assert_close(torch.cat(got, 1), torch.cat(want, 1), **tolerance)
    assert (step_cache.length, step_cache.has_padding) == (forward_cache.length, forward_cache.has_padding)
    assert torch.equal(step_cache.next_position, forward_cache.next_position)
    for got_layer, want_layer in zip(step_cache.keys + step_cache.values, forward_cache.keys + forward_cache.values):
        assert_close(got_layer[:, :, :step_cache.length], want_layer[:, :, :forward_cache.length], **tolerance)


@pytest.mark.parametrize("native", [True, False])
def test_several_bf16_rows_multiply_in_float32_only_without_bf16_arithmetic(monkeypatch, native):
    """The several-rows library's bf16 products: inductor's own where the CPU has bf16 arithmetic, float32 ones
    rounded back once where it has not (what packed_linear.py computes there; the equality test above runs both
    ways, natively and in scripts/test_isa.sh avx2). One row keeps the bf16 product either way."""
    monkeypatch.setattr(cpu, "has_native_bf16", lambda: native)
    step = compiled_step.CompiledStep(_model(torch.bfloat16))
    assert step.one_row_product is compiled_step.linear
    assert step.rows_product is (compiled_step.linear if native else compiled_step._in_float32)
    assert compiled_step.CompiledStep(_model(torch.float32)).rows_product is compiled_step.linear
    generator = torch.Generator().manual_seed(0)
    x, weight = (torch.randn(*shape, generator=generator).bfloat16() for shape in ((3, 40), (24, 40)))
    product = compiled_step._in_float32(x, weight)
    assert product.dtype == torch.bfloat16
    assert torch.equal(product, (x.double() @ weight.double().t()).float().bfloat16())  # exact sums: one rounding


def test_decoding_compiles_only_one_token_steps():
    model = _model(torch.bfloat16)
    assert compiled_step.supports(model)
    calls = []
    compiled = compiled_step.compiled_for(model)
    original = compiled.__class__.__call__
    compiled.__class__.__call__ = lambda self, ids, cache: calls.append(ids.shape) or original(self, ids, cache)
    try:
        with torch.inference_mode(), kernels.decoding(model, compile=True) as step:
            cache = KVCache.for_model(model, 2)
            step(torch.zeros(2, 4, dtype=torch.long), cache)  # a prefill: the eager step
            step(torch.zeros(2, 1, dtype=torch.long), cache)
        with torch.inference_mode(), kernels.decoding(model) as step:  # not asked: eager
            step(torch.zeros(2, 1, dtype=torch.long), KVCache.for_model(model, 2))
    finally:
        compiled.__class__.__call__ = original
    assert calls == [torch.Size([2, 1])]
    cache, ids = _prefilled(model, [3, 3])
    with torch.inference_mode():
        assert compiled.applies(ids[:, :1], cache, None)
        assert not compiled.applies(ids[:, :2], cache, None)  # two tokens a row: a prefill
        assert not compiled.applies(ids[:, :1], cache, torch.ones(2, 4, dtype=torch.bool))  # a mask: eager


def test_weights_changed_since_the_compile_are_never_decoded_stale():
    model = _model(torch.bfloat16)
    compiled = compiled_step.compiled_for(model)
    cache, ids = _prefilled(model, [3, 3])
    with torch.inference_mode():
        assert compiled.applies(ids[:, :1], cache, None)
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    with torch.inference_mode():
        assert not compiled.applies(ids[:, :1], cache, None)
    assert compiled_step.compiled_for(model) is not compiled


def test_generate_with_compile_decodes_the_same_tokens():
    # In float32 the compiled sums differ from the eager ones by round-off only, far below this model's gaps between
    # logits, so the greedy paths agree token for token (in bf16 a near tie may part them: the step tests above
    # compare bf16 logits to its tolerance instead).
    model = _model(torch.float32)
    prompts = [[1, 2, 3], [4, 5]]
    eager = generate(model, prompts, 8, temperature=0.0)
    assert generate(model, prompts, 8, temperature=0.0, compile=True) == eager


def test_a_failed_compile_decodes_eagerly_and_says_so_once(monkeypatch, caplog):
    model = _model(torch.bfloat16)
    compiled = compiled_step.compiled_for(model)
    calls = []

    def fails(self, ids, cache):
        calls.append(1)
        raise compiled_step.CompileFailed("no C++ compiler found\nmore detail")

    monkeypatch.setattr(compiled_step.CompiledStep, "__call__", fails)
    cache, ids = _prefilled(model, [4, 4])
    eager_cache = copy.deepcopy(cache)
    with torch.inference_mode():
        with kernels.decoding(model, compile=True) as step:
            got = [step(ids[:, t:t + 1], cache) for t in range(3)]
        with kernels.decoding(model) as step:
            want = [step(ids[:, t:t + 1], eager_cache) for t in range(3)]
    assert calls == [1] and compiled.failed
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    warnings = [r.getMessage() for r in caplog.records if r.name == "scratchlm.compile"]
    assert warnings == ["compiling the decoding step failed, decoding eagerly: no C++ compiler found"]


def test_the_commands_say_in_one_line_why_compile_is_ignored(capsys):
    say_if_not_compiled(True, _model(torch.float16), "scratchlm generate")
    assert capsys.readouterr().err == ("scratchlm generate: --compile ignored: the weights are float16: compiling "
                                       "wins only for bf16 and float32\n")
    say_if_not_compiled(True, _model(torch.bfloat16), "scratchlm serve")  # compiles: nothing to say
    say_if_not_compiled(False, _model(torch.float32), "scratchlm serve")  # not asked
    assert capsys.readouterr().err == ""


def test_a_failed_build_decodes_eagerly(monkeypatch, caplog):
    """When building the library fails (no C++ compiler), the eager step decodes, the same tokens, and the log
    says why once."""
    model = _model(torch.float32)

    def fails(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fails)
    compiled_step._compiled.pop(model, None)
    assert generate(model, [[1, 2, 3]], 6, temperature=0.0, compile=True) == \
        generate(model, [[1, 2, 3]], 6, temperature=0.0)
    assert compiled_step.compiled_for(model).failed
    warnings = [r.getMessage() for r in caplog.records if r.name == "scratchlm.compile"]
    assert warnings == ["compiling the decoding step failed, decoding eagerly: no C++ compiler found"]
