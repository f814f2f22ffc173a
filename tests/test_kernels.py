"""Every speed path of model/kernels/ equals the readable path of model/: values AND gradients, on random and
adversarial inputs (fully masked rows, left padding, a KV cache, T=1, empty batches and sequences, bf16)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.testing import assert_close

from scratchlm.model import KVCache, ModelConfig, TransformerLM, kernels
from scratchlm.model.attention import causal_attention, rotate_pairs, scaled_dot_product_attention
from scratchlm.model.kernels import chunked_attention, cpu, packed_linear
from scratchlm.model.kernels.chunked_attention import chunked_causal_attention
from scratchlm.model.kernels.complex_rope import rotate_as_complex
from scratchlm.model.kernels.few_rows_linear import few_rows_linear
from scratchlm.model.kernels.fused_attention import fused_causal_attention
from scratchlm.model.kernels.fused_swiglu import fused_swiglu
from scratchlm.model.kernels.grouped_attention import grouped_causal_attention
from scratchlm.model.kernels.packed_linear import PackedLinear, packed_weights
from scratchlm.model.layers import Linear, linear
from scratchlm.model.transformer import SwiGLU

CORES = {"chunked": chunked_causal_attention, "fused": fused_causal_attention, "grouped": grouped_causal_attention}
TOLERANCE = {torch.float64: dict(rtol=1e-7, atol=1e-9), torch.float32: dict(rtol=1e-5, atol=1e-5),
             torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
needs_onednn = pytest.mark.skipif(not packed_linear.available(), reason="this torch has no oneDNN packed-linear ops")


def _values_and_grads(fn, inputs: list[torch.Tensor], seed: int = 0):
    """fn(*inputs) and the gradients of <fn(*inputs), g> for a fixed random g, w.r.t. every input."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    grads = torch.autograd.grad(out, leaves, grad, allow_unused=True) if out.numel() else [None] * len(leaves)
    return out, grads


def _assert_same(fast, readable, inputs: list[torch.Tensor], dtype: torch.dtype) -> None:
    got, got_grads = _values_and_grads(fast, inputs)
    want, want_grads = _values_and_grads(readable, inputs)
    assert torch.isfinite(got).all()
    assert_close(got, want, **TOLERANCE[dtype])
    for g, w in zip(got_grads, want_grads):
        if w is not None:
            assert torch.isfinite(g).all()
            assert_close(g, w, **TOLERANCE[dtype])


def _qkv(B: int, H: int, T_q: int, T_k: int, dtype: torch.dtype, seed: int = 0,
         kv_heads: int | None = None) -> list[torch.Tensor]:
    """q (B, H, T_q, 8), k and v (B, kv_heads, T_k, 8) (kv_heads None: H)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, t, 8, generator=generator).to(dtype)
            for h, t in ((H, T_q), (kv_heads or H, T_k), (kv_heads or H, T_k))]


def _left_padding(B: int, T_k: int, pads: list[int]) -> torch.Tensor:
    """(B, T_k) bool key padding, True = real token, row b starting with pads[b] padding positions."""
    return torch.arange(T_k)[None, :] >= torch.tensor(pads)[:, None]


# ---- the attention core ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, T_q, T_k, pads", [
    (2, 9, 9, None),  # training: the plain causal mask
    (3, 1, 12, None),  # a decoding step: one query, nothing masked
    (2, 4, 11, None),  # a prefill continuing a KV cache (past = 7)
    (3, 9, 9, [0, 4, 9]),  # left padding; the last row is all padding: every one of its queries is fully masked
    (2, 3, 10, [2, 8]),  # a cached batch with padding: row 1's first query sees only padding keys
    (2, 1, 6, [0, 6]),  # one query whose keys are all padding
    (0, 5, 5, None),  # an empty batch
    (2, 0, 4, None),  # no new queries
])
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 2), (4, 1)])  # multi-head, grouped-query, multi-query
def test_attention_cores_equal_the_readable_core(core, dtype, B, T_q, T_k, pads, heads, kv_heads):
    inputs = _qkv(B, heads, T_q, T_k, dtype, kv_heads=kv_heads)
    padding = None if pads is None else _left_padding(B, T_k, pads)
    _assert_same(lambda q, k, v: CORES[core](q, k, v, padding),
                 lambda q, k, v: causal_attention(q, k, v, padding), inputs, dtype)


def test_a_fully_masked_query_gives_zeros_and_zero_gradients_in_every_core():
    q, k, v = _qkv(2, 2, 6, 6, torch.float64)
    padding = _left_padding(2, 6, [0, 3])  # row 1, queries 0-2: only padding before them
    for core in (causal_attention, *CORES.values()):
        out, (grad_q, _, _) = _values_and_grads(lambda *t, c=core: c(*t, padding), [q, k, v])
        assert torch.equal(out[1, :, :3], torch.zeros_like(out[1, :, :3]))
        assert torch.equal(grad_q[1, :, :3], torch.zeros_like(grad_q[1, :, :3]))


@pytest.mark.parametrize("chunk_elements", [1, 3 * 6 * 9, 1 << 19])  # one slice per chunk, 3 slices, all at once
@pytest.mark.parametrize("masked", ["none", "causal", "random", "with fully masked rows"])
def test_chunked_sdpa_equals_the_readable_one_for_any_chunking_and_mask(monkeypatch, chunk_elements, masked):
    monkeypatch.setattr(chunked_attention, "CHUNK_ELEMENTS", chunk_elements)
    inputs = [torch.randn(7, 2, t, d, dtype=torch.float64) for t, d in ((6, 8), (9, 8), (9, 5))]
    mask = {"none": None, "causal": torch.ones(6, 9, dtype=torch.bool).tril(),
            "random": torch.rand(7, 2, 6, 9) > 0.4, "with fully masked rows": torch.rand(7, 2, 6, 9) > 0.8}[masked]
    if masked == "with fully masked rows":
        mask[:, :, 2] = False
    _assert_same(lambda q, k, v: chunked_attention.chunked_attention(q, k, v, mask),
                 lambda q, k, v: scaled_dot_product_attention(q, k, v, mask), inputs, torch.float64)


def test_chunked_inference_path_equals_its_autograd_path():
    q, k, v = _qkv(3, 4, 7, 7, torch.float32)
    padding = _left_padding(3, 7, [0, 2, 7])
    with torch.no_grad():
        inference = chunked_causal_attention(q, k, v, padding)
    trained = chunked_causal_attention(q.requires_grad_(), k, v, padding)
    assert torch.equal(inference, trained.detach())


def test_chunked_sdpa_refuses_a_mask_that_is_not_bool():
    Q = K = V = torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match="attention mask must be a bool tensor.*got dtype torch.float32"):
        chunked_attention.chunked_attention(Q, K, V, torch.ones(4, 4).tril())


# ---- RoPE ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(2, 3, 5, 16), (1, 1, 1, 2), (0, 4, 3, 8), (2, 4, 0, 8)])
def test_complex_rotation_equals_the_pairwise_rotation(dtype, shape):
    x = torch.randn(shape, dtype=dtype)
    angles = torch.randn(*shape[:-1], shape[-1] // 2, dtype=dtype) * 100  # large angles too
    _assert_same(lambda x: rotate_as_complex(x, angles.cos(), angles.sin()),
                 lambda x: rotate_pairs(x, angles.cos(), angles.sin()), [x], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_module_with_the_complex_kernel_equals_readable_with_gathered_and_default_positions(dtype):
    model = TransformerLM(ModelConfig.preset("tiny")).to(dtype)
    rope = model.layers[0].attn.rope
    fast = kernels.apply(copy.deepcopy(model)).layers[0].attn.rope
    x = torch.randn(2, 4, 7, rope.d_k).to(dtype)
    positions = torch.randint(0, rope.max_seq_len, (2, 1, 7))
    for args in ((positions,), (None, 5)):
        _assert_same(lambda x, args=args: fast(x, *args), lambda x, args=args: rope(x, *args), [x], dtype)


# ---- Linear ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [(0,), (1,), (1, 1), (2,), (3,), (2, 8), (16,), (17,), (4, 10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("d_in, d_out", [(24, 40), (40, 24)])
def test_few_rows_linear_equals_x_wt(rows, dtype, d_in, d_out):
    x, weight = torch.randn(*rows, d_in, dtype=dtype), torch.randn(d_out, d_in, dtype=dtype)
    _assert_same(few_rows_linear, linear, [x, weight], dtype)


def test_few_rows_linear_on_another_device_is_x_wt():
    x, weight = torch.randn(1, 8, device="meta"), torch.randn(4, 8, device="meta")
    assert few_rows_linear(x, weight).shape == (1, 4)


# ---- the SwiGLU hidden layer -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 24), (1, 1, 1), (0, 3, 8)])
def test_the_fused_swiglu_equals_the_readable_hidden_layer_with_gradients(dtype, shape):
    generator = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(shape, generator=generator) * 4).to(dtype), torch.randn(shape, generator=generator)
    gate.view(-1)[:3] = torch.tensor([-100.0, 0.0, 100.0], dtype=dtype)[:gate.numel()]  # saturated and zero gates
    _assert_same(fused_swiglu, SwiGLU.hidden, [gate, up.to(dtype)], dtype)


def test_the_fused_swiglu_differentiates_whichever_input_asks():
    gate, up = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    for wanted in (gate, up):
        leaf = wanted.clone().requires_grad_()
        inputs = (leaf, up) if wanted is gate else (gate, leaf)
        (got,) = torch.autograd.grad(fused_swiglu(*inputs).sum(), leaf)
        (want,) = torch.autograd.grad(SwiGLU.hidden(*inputs).sum(), leaf)
        assert_close(got, want)
    with torch.no_grad():
        assert_close(fused_swiglu(gate, up), SwiGLU.hidden(gate, up))


needs_native_bf16 = pytest.mark.skipif(not cpu.has_native_bf16(), reason="this CPU (or ATEN_CPU_CAPABILITY / "
                                       "ONEDNN_MAX_CPU_ISA) has no bf16 arithmetic: bf16 weights are packed as float32")
PACKINGS = [pytest.param(torch.float32, torch.float32, id="float32"),  # (the weight's dtype, the packed one)
            pytest.param(torch.bfloat16, torch.float32, id="bf16_as_float32"),
            pytest.param(torch.bfloat16, torch.bfloat16, id="bf16_native", marks=needs_native_bf16)]


@needs_onednn
@pytest.mark.parametrize("dtype, compute_dtype", PACKINGS)
@pytest.mark.parametrize("rows", [(3,), (8,), (2, 5), (4, 1, 16), (1,), (0,)])
@pytest.mark.parametrize("d_in, d_out", [(24, 40), (40, 24)])
def test_packed_linear_equals_x_wt_in_inference(dtype, compute_dtype, rows, d_in, d_out):
    """A packed weight computes x Wᵀ; bf16 weights packed as float32 round the float32 product once, as a bf16
    matmul does (packed natively, oneDNN's bf16 kernel sums in its own order)."""
    layer, x = Linear(d_in, d_out, dtype=dtype), torch.randn(*rows, d_in).to(dtype)
    packed = PackedLinear(layer.weight, linear, compute_dtype=compute_dtype)
    with torch.inference_mode():
        got = packed(x, layer.weight)
        assert got.dtype == dtype
        assert_close(got, linear(x, layer.weight), **TOLERANCE[dtype])
        if dtype == torch.bfloat16 and compute_dtype == torch.float32:  # the float32 product, rounded once
            assert_close(got, linear(x.float(), layer.weight.float()).to(dtype), rtol=0, atol=0)


@needs_onednn
def test_packed_weights_keep_the_bias():
    """The bias is added outside `matmul`, so a packed weight (which replaces `matmul`) cannot drop it."""
    layer, x = Linear(24, 40, bias=True), torch.randn(8, 24)
    layer.bias.data.normal_()
    with packed_weights(layer) as count, torch.inference_mode():
        assert count == 1 and isinstance(layer.matmul, PackedLinear)
        assert_close(layer(x), linear(x, layer.weight) + layer.bias)
    assert layer.matmul is linear


@needs_onednn
def test_a_packed_weight_is_used_only_without_autograd_for_its_dtype_and_while_current():
    """No autograd, the weight's dtype, the weight unchanged since packing, 2 float32 rows or more; otherwise the
    fallback, exactly."""
    layer = Linear(16, 24)
    fallback_rows = []

    def counting_fallback(x, weight):
        fallback_rows.append(x.shape[:-1])
        return linear(x, weight)

    layer.matmul = counting_fallback
    with packed_weights(layer):
        with torch.no_grad():
            for rows in (1, 2, 3):
                layer(torch.randn(rows, 16))
            layer.matmul(torch.randn(3, 16, dtype=torch.float64), layer.weight.double())  # another dtype
        assert fallback_rows == [(1,), (3,)]  # one float32 row multiplies unpacked (few_rows_linear)
        x = torch.randn(8, 16, requires_grad=True)
        layer(x).sum().backward()  # training: the fallback, with its gradients
        assert fallback_rows[-1] == (8,) and x.grad is not None
        with torch.no_grad():
            layer.weight.mul_(2)  # an in-place change makes the pack stale
            x = torch.randn(8, 16)
            assert torch.equal(layer(x), linear(x, layer.weight))
        assert fallback_rows[-1] == (8,) and len(fallback_rows) == 4
    assert layer.matmul is counting_fallback


@pytest.mark.parametrize("native", [True, False])
def test_the_packing_rule_asks_the_cpu_for_bf16(monkeypatch, native):
    """float32 weights: packed as float32 from 2 rows; bf16: in bf16 from 1 row only where the CPU has bf16
    arithmetic (an AVX2 CPU cannot even pack them: oneDNN's bf16 reorder needs AVX-512), else as float32 from 4
    rows; fp16 as float32 from 4 rows."""
    monkeypatch.setattr(cpu, "has_native_bf16", lambda: native)
    assert packed_linear.packing_for(torch.ones(2, 2)) == (torch.float32, 2)
    bf16 = (torch.bfloat16, 1) if native else (torch.float32, 4)
    assert packed_linear.packing_for(torch.ones(2, 2, dtype=torch.bfloat16)) == bf16
    assert packed_linear.packing_for(torch.ones(2, 2, dtype=torch.float16)) == (torch.float32, 4)


@needs_onednn
def test_packed_weights_nest_skip_other_dtypes_and_big_models(monkeypatch):
    layer, half, double = Linear(16, 24), Linear(16, 24, dtype=torch.bfloat16), Linear(16, 24, dtype=torch.float64)
    model = torch.nn.ModuleList([layer, half, double])
    with packed_weights(model) as count:
        assert count == 2 and isinstance(layer.matmul, PackedLinear) and isinstance(half.matmul, PackedLinear)
        assert double.matmul is linear  # a float32 copy would lose precision
        outer = layer.matmul
        with packed_weights(model) as inner:
            assert inner == 0 and layer.matmul is outer  # the inner block leaves the outer block's packs
        assert layer.matmul is outer
    assert layer.matmul is linear and half.matmul is linear
    monkeypatch.setattr(packed_linear, "MAX_PACKED_BYTES", layer.weight.nbytes)
    with packed_weights(model) as count:  # weights too large to copy
        assert count == 0 and layer.matmul is linear


@needs_onednn
@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native_bf16), False])
def test_weights_are_packed_only_where_the_steps_rows_use_the_packs(monkeypatch, native):
    """With steps of `step_rows` rows, a weight whose packed product needs more rows stays unpacked (only
    prefills would use it): float32 from 2 rows, bf16 from 1 with bf16 arithmetic, else from 4."""
    if not native:
        monkeypatch.setattr(cpu, "has_native_bf16", lambda: False)
    single, half = Linear(16, 24), Linear(16, 24, dtype=torch.bfloat16)
    model = torch.nn.ModuleList([single, half])
    for step_rows, packed in ((1, [False, native]), (2, [True, native]), (4, [True, True]), (None, [True, True])):
        with packed_weights(model, step_rows) as count:
            got = [isinstance(layer.matmul, PackedLinear) for layer in (single, half)]
            assert got == packed and count == sum(packed), step_rows


def test_without_onednn_nothing_is_packed(monkeypatch):
    monkeypatch.setattr(packed_linear, "available", lambda: False)
    layer = Linear(16, 24)
    with packed_weights(layer) as count:
        assert count == 0 and layer.matmul is linear


def _logits_tolerance(want: torch.Tensor, tolerance: dict) -> dict:
    """`tolerance`, with bf16 logits also allowed 4 bf16 spacings at the logits' largest magnitude: every bf16
    rounding inside the model is that coarse, and kernels that sum in another order (torch's SDPA on a CPU
    without AVX2 differed by 2.3 spacings) round differently."""
    if want.dtype != torch.bfloat16:
        return tolerance
    spacing = torch.finfo(torch.bfloat16).eps * 2.0 ** (torch.frexp(want.abs().max().float()).exponent.item() - 1)
    return tolerance | {"atol": max(tolerance["atol"], 4 * spacing)}


# ---- the whole model -------------------------------------------------------------------------------------------

# The switches of pretrained checkpoints: multi-query with q/k/v biases and a head_dim != d_model / num_heads;
# grouped-query with QK-norm and llama3 RoPE scaling (an original context of 32 puts every band of its rule in use).
MQA_BIAS_HEAD_DIM = {"num_kv_heads": 1, "qkv_bias": True, "head_dim": 24}
GQA_LLAMA3 = {"num_kv_heads": 2, "qk_norm": True, "rope_scaling": "llama3", "rope_original_context": 32}


def _pair(dtype: torch.dtype = torch.float32, fused: bool = False, **overrides) -> tuple[TransformerLM, TransformerLM]:
    torch.manual_seed(0)
    readable = TransformerLM(ModelConfig.preset("tiny", **overrides), dtype=dtype)
    with torch.no_grad():  # biases start at 0, where a kernel that dropped them would still agree
        for name, parameter in readable.named_parameters():
            if name.endswith("bias"):
                parameter.normal_()
    return readable, kernels.apply(copy.deepcopy(readable), "cpu", fused_attention=fused)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overrides", [{}, {"qk_norm": True}, {"position": "nope", "tie_embeddings": True},
                                       MQA_BIAS_HEAD_DIM, GQA_LLAMA3])
def test_model_with_kernels_equals_readable_model_logits_and_parameter_gradients(fused, dtype, overrides):
    readable, fast = _pair(dtype, fused, **overrides)
    ids = torch.randint(0, readable.config.vocab_size, (3, 20))
    mask = _left_padding(3, 20, [0, 6, 19])
    for model in (readable, fast):
        model(ids, attention_mask=mask).float().logsumexp(-1).mean().backward()
    tolerance = TOLERANCE[dtype]
    want = readable(ids, attention_mask=mask)
    assert_close(fast(ids, attention_mask=mask), want, **_logits_tolerance(want, tolerance))
    for (name, got), want in zip(fast.named_parameters(), readable.parameters()):
        assert torch.isfinite(got.grad).all(), name
        assert_close(got.grad, want.grad, **tolerance, msg=name)


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_onednn)])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("overrides", [{}, MQA_BIAS_HEAD_DIM, GQA_LLAMA3])
def test_model_with_kernels_decodes_like_the_readable_model(packed, fused, overrides):
    readable, fast = _pair(fused=fused, **overrides)
    ids = torch.randint(0, readable.config.vocab_size, (4, 12))
    mask = _left_padding(4, 5, [0, 1, 3, 4])
    logits = []
    for model in (readable, fast):
        cache = KVCache.for_model(model, batch_size=4)
        with torch.inference_mode(), (packed_weights(model) if packed else contextlib.nullcontext()):
            steps = [model(ids[:, :5], attention_mask=mask, kv_cache=cache)]
            steps += [model(ids[:, t:t + 1], kv_cache=cache) for t in range(5, 12)]
        logits.append(torch.cat(steps, dim=1))
    assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_apply_and_readable_switch_every_module_and_keep_the_state_dict():
    readable, fast = _pair()
    assert fast.state_dict().keys() == readable.state_dict().keys()
    attention = fast.layers[0].attn
    assert attention.attention_core is chunked_causal_attention and attention.rope.rotate is rotate_as_complex
    assert all(layer.matmul is few_rows_linear for layer in fast.modules() if isinstance(layer, Linear))
    assert fast.layers[0].ffn.hidden is fused_swiglu
    on_gpu = kernels.apply(copy.deepcopy(readable), "cuda")
    assert on_gpu.layers[0].attn.attention_core is fused_causal_attention and on_gpu.lm_head.matmul is linear
    kernels.readable(fast)
    assert attention.attention_core is causal_attention and attention.rope.rotate is rotate_pairs
    assert all(layer.matmul is linear for layer in fast.modules() if isinstance(layer, Linear))
    assert fast.layers[0].ffn.hidden is SwiGLU.hidden


def test_decoding_switches_kernels_on_for_its_block_and_keeps_the_callers_choice():
    readable, fused = _pair(fused=True)
    with kernels.decoding(readable):
        assert readable.layers[0].attn.attention_core is grouped_causal_attention
        matmul = readable.lm_head.matmul  # few_rows_linear, or a packed copy over it (packed_linear.py)
        assert matmul is few_rows_linear or matmul.fallback is few_rows_linear
    assert readable.layers[0].attn.attention_core is causal_attention and readable.lm_head.matmul is linear
    with kernels.decoding(fused):
        assert fused.layers[0].attn.attention_core is fused_causal_attention
    assert fused.layers[0].attn.attention_core is fused_causal_attention
