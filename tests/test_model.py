"""TransformerLM: ablation switches, input errors, KV cache and padding, gradcheck, checkpointing, counts."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from torch.testing import assert_close

from scratchlm.model import KVCache, ModelConfig, TransformerLM, kernels

TINY = ModelConfig.preset("tiny")


def _model(**overrides) -> TransformerLM:
    return TransformerLM(ModelConfig.preset("tiny", **overrides)).eval()


@pytest.mark.parametrize("norm,norm_position,position,ffn,tie", [
    combo for combo in itertools.product(("rmsnorm", "layernorm", "none"), ("pre", "post"), ("rope", "nope"),
                                         ("swiglu", "silu"), (False, True))
    if combo[1] == "pre" or combo[3] == "swiglu"  # post-norm × FFN kind adds nothing new
])
def test_every_ablation_builds_runs_forward_and_backward(norm, norm_position, position, ffn, tie):
    model = _model(norm=norm, norm_position=norm_position, position=position, ffn=ffn, tie_embeddings=tie).train()
    ids = torch.randint(0, TINY.vocab_size, (2, 12))
    logits = model(ids)
    assert logits.shape == (2, 12, TINY.vocab_size) and torch.isfinite(logits).all()
    logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    names = set(model.state_dict())
    assert ("layers.0.ln1.weight" in names) == (norm != "none")
    assert ("layers.0.ffn.w3.weight" in names) == (ffn == "swiglu")


def test_state_dict_names_follow_the_reference():
    names = set(_model().state_dict())
    expected = {"token_embeddings.weight", "ln_final.weight", "lm_head.weight"}
    for i in range(TINY.num_layers):
        expected |= {f"layers.{i}.attn.{p}_proj.weight" for p in ("q", "k", "v", "output")}
        expected |= {f"layers.{i}.ffn.w{j}.weight" for j in (1, 2, 3)} | {f"layers.{i}.ln{j}.weight" for j in (1, 2)}
    assert names == expected


def test_model_is_causal():
    model = _model()
    ids = torch.randint(0, TINY.vocab_size, (1, 10))
    changed = ids.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % TINY.vocab_size
    assert_close(model(ids)[:, :6], model(changed)[:, :6])
    assert not torch.allclose(model(ids)[:, 6:], model(changed)[:, 6:])


def test_bad_inputs_raise_clear_value_errors():
    model = _model()
    with pytest.raises(ValueError, match="exceeds context_length 32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token id 256 is outside the vocabulary \[0, 256\)"):
        model(torch.tensor([[1, 256, 3]]))
    with pytest.raises(ValueError, match="token id -1"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match=r"\(batch, seq\) integer tensor"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="in_indices must be an int64 or int32 tensor"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="attention_mask must be a bool tensor"):
        model(torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="token_positions must lie in"):
        model(torch.zeros(1, 4, dtype=torch.long), token_positions=torch.tensor([0, 1, 2, 40]))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.int16])
def test_token_ids_of_a_dtype_that_cannot_index_rows_are_refused(dtype):
    """uint8 ids would index as a boolean mask and wrap when compared with the vocabulary size 256."""
    model = _model()
    with pytest.raises(ValueError, match=rf"in_indices must be an int64 or int32 tensor .*\.long\(\).*{dtype}"):
        model(torch.tensor([[1, 255, 3]]).to(dtype))
    with pytest.raises(ValueError, match="token ids must be an int64 or int32 tensor"):
        model.token_embeddings(torch.tensor([1, 0]).to(dtype))
    ids = torch.tensor([[1, 255, 3]])
    assert_close(model(ids.int()), model(ids))


@pytest.mark.parametrize("fused", [False, True])
def test_zero_length_sequence_gives_empty_logits(fused):
    model = kernels.apply(_model(), fused_attention=fused)
    empty = torch.zeros(2, 0, dtype=torch.long)
    assert model(empty).shape == (2, 0, TINY.vocab_size)
    assert model(empty, attention_mask=torch.ones(2, 0, dtype=torch.bool)).shape == (2, 0, TINY.vocab_size)
    cache = KVCache.for_model(model, batch_size=2)
    ids = torch.randint(0, TINY.vocab_size, (2, 5))
    with torch.no_grad():
        assert model(empty, kv_cache=cache).shape == (2, 0, TINY.vocab_size)
        model(ids[:, :3], kv_cache=cache)
        assert model(empty, kv_cache=cache).shape == (2, 0, TINY.vocab_size)
        assert cache.length == 3
        assert_close(model(ids[:, 3:], kv_cache=cache), model(ids)[:, 3:], atol=1e-5, rtol=1e-5)


def test_token_positions_of_wrong_dtype_or_shape_are_refused():
    model = _model()
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="token_positions must be an int64 or int32 tensor"):
        model(ids, token_positions=torch.arange(5.0))
    for shape in ((3, 5), (2, 1, 5), (2, 4)):
        with pytest.raises(ValueError, match=rf"= \(2, 5\), got {re.escape(str(shape))}"):
            model(ids, token_positions=torch.zeros(shape, dtype=torch.long))
    positions = torch.arange(5)
    expected = model(ids, token_positions=positions)
    for shaped in (positions[None], positions.expand(2, 5), positions.int()):
        assert_close(model(ids, token_positions=shaped), expected)


@pytest.mark.parametrize("other, message", [
    (dict(config=ModelConfig.preset("tiny", num_layers=1)), "layers 1 (model: 2)"),
    (dict(config=ModelConfig.preset("tiny", num_heads=2)), "kv_heads 2 (model: 4), head_dim 32 (model: 16)"),
    (dict(config=TINY, dtype=torch.float64), "dtype torch.float64 (model: torch.float32)"),
])
def test_kv_cache_built_for_another_model_is_refused(other, message):
    model = _model()
    cache = KVCache.for_model(TransformerLM(**other), batch_size=2)
    with pytest.raises(ValueError, match=f"KV cache was built for another model: {re.escape(message)}"):
        model(torch.zeros(2, 3, dtype=torch.long), kv_cache=cache)
    assert cache.length == 0


def test_config_rejects_bad_d_ff_norm_eps_rope_theta_and_tie():
    for field, bad in [("d_ff", 40.0), ("d_ff", True), ("d_ff", 0), ("norm_eps", -1e-5), ("norm_eps", float("nan")),
                       ("norm_eps", float("inf")), ("rope_theta", float("nan")), ("rope_theta", float("inf")),
                       ("rope_theta", 0.0), ("rope_theta", "1e4"), ("tie_embeddings", "false")]:
        with pytest.raises(ValueError, match=f"model.{field} must be .*got {re.escape(repr(bad))}"):
            ModelConfig.preset("tiny", **{field: bad})
    assert ModelConfig.preset("tiny", norm_eps=0.0, rope_theta=500).rope_theta == 500


def test_check_inputs_off_skips_the_value_range_check():
    model = _model()
    model.check_inputs = False
    with pytest.raises(IndexError):  # our ValueError was skipped; the lookup itself fails
        model(torch.tensor([[1, 256]]))


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 0.05), (torch.float64, 1e-5)])
def test_module_to_dtype_keeps_the_logits(dtype, tolerance, fast):
    """``Module.to`` casts the cos/sin tables with the weights; the logits must survive a dtype change, on the
    readable path and with the kernels (the complex rotation needs float32/64 pairs: RoPE computes in them)."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.preset("tiny")).eval()
    if fast:
        kernels.apply(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    with torch.no_grad():
        expected = model(ids)
        cast = model.to(dtype)
        assert all(layer.attn.rope.cos.dtype == dtype for layer in cast.layers)
        error = (cast(ids).double() - expected.double()).abs().max() / expected.abs().max()
    assert error < tolerance


@pytest.mark.parametrize("fused", [False, True])
def test_kv_cache_logits_equal_full_recompute_at_every_step(fused):
    model = _model()
    ids = torch.randint(0, TINY.vocab_size, (3, 20))
    full = model(ids)
    kernels.apply(model, fused_attention=fused)
    cache = KVCache.for_model(model, batch_size=3)
    with torch.no_grad():
        chunks = [model(ids[:, :5], kv_cache=cache)]  # prefill, then one token at a time
        chunks += [model(ids[:, t:t + 1], kv_cache=cache) for t in range(5, 20)]
    assert cache.length == 20
    assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=1e-5)


def test_last_only_returns_the_last_positions_logits_and_fills_the_cache_the_same():
    model = _model()
    ids = torch.randint(0, TINY.vocab_size, (2, 9))
    nxt = torch.randint(0, TINY.vocab_size, (2, 1))
    with torch.no_grad():
        full_cache, last_cache = KVCache.for_model(model, batch_size=2), KVCache.for_model(model, batch_size=2)
        full = model(ids, kv_cache=full_cache)
        last = model(ids, kv_cache=last_cache, last_only=True)
        assert last.shape == (2, 1, TINY.vocab_size)
        assert_close(last, full[:, -1:], atol=1e-6, rtol=1e-6)
        assert_close(model(nxt, kv_cache=last_cache), model(nxt, kv_cache=full_cache), atol=1e-6, rtol=1e-6)


def test_kv_cache_errors_when_full_or_wrong_batch():
    model = _model()
    cache = KVCache.for_model(model, batch_size=2, max_seq_len=8)
    with torch.no_grad():
        model(torch.zeros(2, 8, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError, match="KV cache full"):
            model(torch.zeros(2, 1, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError, match="batch size 2"):
            model(torch.zeros(3, 1, dtype=torch.long), kv_cache=KVCache.for_model(model, batch_size=2))


def test_left_padded_batch_matches_each_prompt_alone_with_and_without_cache():
    model = _model()
    prompts = [torch.randint(0, TINY.vocab_size, (n,)) for n in (7, 3, 5)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = p, True
    nxt = torch.randint(0, TINY.vocab_size, (3, 4))
    with torch.no_grad():
        padded = model(ids, attention_mask=mask)
        cache = KVCache.for_model(model, batch_size=3)
        prefill = model(ids, attention_mask=mask, kv_cache=cache)
        steps = torch.cat([model(nxt[:, t:t + 1], kv_cache=cache) for t in range(4)], dim=1)
        for row, p in enumerate(prompts):
            alone = model(torch.cat([p, nxt[row]])[None])
            assert_close(padded[row, width - len(p):], alone[0, :len(p)], atol=1e-5, rtol=1e-5)
            assert_close(prefill[row, width - len(p):], alone[0, :len(p)], atol=1e-5, rtol=1e-5)
            assert_close(steps[row], alone[0, len(p):], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(padded).all()


@pytest.mark.parametrize("padded", [False, True])
def test_fused_sdpa_path_matches_ours(padded):
    model = _model()
    ids = torch.randint(0, TINY.vocab_size, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.bool)
    if padded:
        mask[1, :5] = False
    ours = model(ids, attention_mask=mask)
    kernels.apply(model, fused_attention=True)
    fused = model(ids, attention_mask=mask)
    assert_close(fused, ours, atol=1e-5, rtol=1e-5)


def test_gradcheck_float64_tiny_model():
    cfg = ModelConfig(vocab_size=11, context_length=4, d_model=8, num_layers=1, num_heads=2, d_ff=8)
    model = TransformerLM(cfg, dtype=torch.float64)
    ids = torch.randint(0, 11, (1, 4))
    names = [name for name, _ in model.named_parameters()]

    def logits_of(*weights):
        return torch.func.functional_call(model, dict(zip(names, weights)), (ids,))

    inputs = tuple(p.detach().clone().requires_grad_() for p in model.parameters())
    assert torch.autograd.gradcheck(logits_of, inputs, eps=1e-6, atol=1e-5, fast_mode=True)


def test_checkpoint_blocks_gives_identical_gradients():
    model = _model().train()
    ids = torch.randint(0, TINY.vocab_size, (2, 12))
    model(ids).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.checkpoint_blocks = True
    model(ids).square().mean().backward()
    for p, g in zip(model.parameters(), expected):
        assert_close(p.grad, g)


def test_tied_embeddings_share_one_matrix_with_lm_head_init():
    cfg = ModelConfig.preset("tinystories-17m", tie_embeddings=True, num_layers=1)
    model = TransformerLM(cfg)
    assert model.lm_head.weight is model.token_embeddings.weight
    sigma = (2 / (cfg.d_model + cfg.vocab_size)) ** 0.5
    assert model.lm_head.weight.std().item() == pytest.approx(sigma * 0.9866, rel=0.02)
    untied = TransformerLM(ModelConfig.preset("tinystories-17m", num_layers=1))
    assert model.num_parameters() == untied.num_parameters() - cfg.vocab_size * cfg.d_model
    assert model.num_parameters(non_embedding=True) == model.num_parameters()


def test_num_parameters_matches_closed_formula():
    cfg = ModelConfig.preset("tinystories-17m")
    model = TransformerLM(cfg, device="meta")
    d, L, V, f = cfg.d_model, cfg.num_layers, cfg.vocab_size, cfg.d_ff
    per_layer = 4 * d * d + 3 * d * f + 2 * d
    assert model.num_parameters() == L * per_layer + 2 * V * d + d
    assert model.num_parameters(non_embedding=True) == L * per_layer + V * d + d


# The switches of pretrained checkpoints: grouped-query attention, head_dim, q/k/v biases, llama3 RoPE scaling.
GQA = dict(num_kv_heads=2, head_dim=24, qkv_bias=True, qk_norm=True)
LLAMA3 = dict(rope_scaling="llama3", rope_scaling_factor=4.0, rope_original_context=32)  # every band in use


def _randomize_biases(model: TransformerLM) -> TransformerLM:
    """Biases start at 0, where a bug could not show: give them random values."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_()
    return model


def test_default_switches_keep_the_state_dict_names_shapes_and_saved_configs():
    """Defaults: no bias parameters, every attention matrix d × d as before; an old config (without the new keys)
    loads as the same model."""
    model = _model()
    d = TINY.d_model
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    for i in range(TINY.num_layers):
        for p in ("q", "k", "v", "output"):
            assert shapes.pop(f"layers.{i}.attn.{p}_proj.weight") == (d, d)
    assert not [name for name in shapes if ".attn." in name or "bias" in name]
    assert (TINY.num_kv_heads, TINY.head_dim, TINY.qkv_bias, TINY.rope_scaling) == (4, 16, False, "none")
    new_keys = ("num_kv_heads", "head_dim", "qkv_bias", "rope_scaling", "rope_scaling_factor",
                "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_context")
    old_saved = {key: value for key, value in TINY.to_dict().items() if key not in new_keys}
    assert ModelConfig.from_dict(old_saved) == TINY
    # RNG draws are unchanged (biases start at 0 without a draw): the same seed gives the same weights.
    torch.manual_seed(3)
    before = TransformerLM(TINY).state_dict()
    torch.manual_seed(3)
    explicit = TransformerLM(ModelConfig.preset("tiny", num_kv_heads=4, head_dim=16)).state_dict()
    assert before.keys() == explicit.keys() and all(torch.equal(before[k], explicit[k]) for k in before)


def test_gqa_head_dim_and_bias_shapes():
    model = _model(**GQA)
    attn = model.layers[0].attn
    assert tuple(attn.q_proj.weight.shape) == (4 * 24, 64) and tuple(attn.q_proj.bias.shape) == (96,)
    assert tuple(attn.k_proj.weight.shape) == (2 * 24, 64) and tuple(attn.v_proj.bias.shape) == (48,)
    assert tuple(attn.output_proj.weight.shape) == (64, 96) and attn.output_proj.bias is None
    assert tuple(attn.q_norm.weight.shape) == (24,)
    assert {"layers.1.attn.q_proj.bias", "layers.1.attn.k_proj.bias", "layers.1.attn.v_proj.bias"} <= set(
        model.state_dict())
    cache = KVCache.for_model(model, batch_size=3)
    assert tuple(cache.keys[0].shape) == (3, 2, TINY.context_length, 24)  # only the KV heads are cached


@pytest.mark.parametrize("num_kv_heads", [1, 2])
@pytest.mark.parametrize("extra", [dict(), dict(head_dim=24, qkv_bias=True, qk_norm=True), LLAMA3])
def test_gqa_equals_multi_head_attention_with_the_kv_heads_repeated(num_kv_heads, extra):
    """The oracle: a multi-head model whose K/V projections hold each KV head's rows once per query head of its
    group (query heads 2j, 2j+1 share KV head j with 2 KV heads of 4) computes the same logits."""
    torch.manual_seed(0)
    gqa = _randomize_biases(_model(num_kv_heads=num_kv_heads, **extra))
    mha = _model(**extra)
    group = TINY.num_heads // num_kv_heads
    head_dim = gqa.config.head_dim
    weights = {}
    for name, tensor in gqa.state_dict().items():
        if re.search(r"attn\.[kv]_proj\.", name):  # (H_kv·d_k, ...) -> (H·d_k, ...)
            tensor = tensor.unflatten(0, (num_kv_heads, head_dim)).repeat_interleave(group, dim=0).flatten(0, 1)
        weights[name] = tensor
    mha.load_state_dict(weights)
    ids = torch.randint(0, TINY.vocab_size, (2, 20))
    with torch.no_grad():
        assert_close(gqa(ids), mha(ids), atol=1e-5, rtol=1e-5)
        mask = torch.ones(2, 20, dtype=torch.bool)
        mask[0, :6] = False
        assert_close(gqa(ids, attention_mask=mask), mha(ids, attention_mask=mask), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("extra", [dict(num_kv_heads=1), GQA, dict(num_kv_heads=2, **LLAMA3)])
def test_kv_cache_with_the_new_switches_equals_full_recompute(extra, fused):
    torch.manual_seed(0)
    model = _randomize_biases(_model(**extra))
    ids = torch.randint(0, TINY.vocab_size, (3, 20))
    with torch.no_grad():
        full = model(ids)
        kernels.apply(model, fused_attention=fused)
        cache = KVCache.for_model(model, batch_size=3)
        chunks = [model(ids[:, :5], kv_cache=cache)]
        chunks += [model(ids[:, t:t + 1], kv_cache=cache) for t in range(5, 20)]
    assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=1e-5)


def test_new_switches_train_forward_and_backward():
    model = _randomize_biases(_model(**GQA, **LLAMA3)).train()
    model(torch.randint(0, TINY.vocab_size, (2, 12))).logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
               for p in model.parameters())


def test_head_dim_is_independent_of_d_model():
    """d_model 60 does not split into 8 heads; an explicit head_dim makes it a valid model (Qwen3's shapes)."""
    with pytest.raises(ValueError, match=r"model.d_model \(60\) must be divisible by model.num_heads \(8\)"):
        ModelConfig.preset("tiny", d_model=60, num_heads=8)
    model = _model(d_model=60, num_heads=8, head_dim=10)
    assert tuple(model.layers[0].attn.q_proj.weight.shape) == (80, 60)
    assert model(torch.randint(0, TINY.vocab_size, (1, 7))).shape == (1, 7, TINY.vocab_size)


@pytest.mark.parametrize("overrides, message", [
    (dict(num_kv_heads=3), r"model.num_kv_heads \(3\) must divide model.num_heads \(4\)"),
    (dict(num_kv_heads=0), r"model.num_kv_heads must be a positive integer, got 0"),
    (dict(num_kv_heads=2.0), r"model.num_kv_heads must be a positive integer, got 2.0"),
    (dict(head_dim=0), r"model.head_dim must be a positive integer, got 0"),
    (dict(head_dim=15), r"RoPE needs an even head dimension, got model.head_dim = 15"),
    (dict(qkv_bias="yes"), r"model.qkv_bias must be true or false, got 'yes'"),
    (dict(rope_scaling="yarn"), r"model.rope_scaling must be one of \('none', 'llama3'\), got 'yarn'"),
    (dict(rope_scaling_factor=0.0), r"model.rope_scaling_factor must be a finite number > 0, got 0.0"),
    (dict(rope_low_freq_factor=float("nan")), r"model.rope_low_freq_factor must be a finite number > 0, got nan"),
    (dict(rope_high_freq_factor=1.0), r"model.rope_high_freq_factor \(1.0\) must be greater than "
                                      r"model.rope_low_freq_factor \(1.0\)"),
    (dict(rope_original_context=-1), r"model.rope_original_context must be a positive integer, got -1"),
])
def test_config_rejects_bad_new_switches(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.preset("tiny", **overrides)
    assert ModelConfig.preset("tiny", head_dim=15, position="nope").head_dim == 15  # odd is fine without RoPE


def test_llama3_scaling_reaches_every_rope_table():
    from scratchlm.model.attention import Llama3Scaling

    scaled, plain = _model(**LLAMA3), _model()
    for layer, unscaled in zip(scaled.layers, plain.layers):
        assert layer.attn.rope.scaling == Llama3Scaling(4.0, 1.0, 4.0, 32) and unscaled.attn.rope.scaling is None
        assert_close(layer.attn.rope.cos[:, 0], unscaled.attn.rope.cos[:, 0])  # the shortest wavelength is kept
        assert_close(layer.attn.rope.cos[:, -1], (torch.arange(32.0) * 10_000 ** -(14 / 16) / 4).cos())  # divided
