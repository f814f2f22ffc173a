"""TransformerLM == transformers' Llama / Qwen2 / Qwen3 / Mistral with the same weights, mapped by compat/hf.py.

Both directions: HF models built here at random (tiny versions of real checkpoints' head layouts, no download)
run in ours, and ours run in the architecture export chooses. Logits agree to 1e-5 relative, greedy decoding
(transformers' `generate` against ours with the KV cache) token for token, and unsupported configs are refused
naming the field and its value.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from conftest import torch_threads
from hf_models import COMMON, HF_SHAPES, hf_config, hf_model, randomize_vectors, rope
from scratchlm.compat.hf import (
    choose_architecture,
    from_hf_state_dict,
    hf_config_to_model_config,
    to_hf_config,
    to_hf_state_dict,
)
from scratchlm.generate.decoding import generate
from scratchlm.model import ModelConfig, TransformerLM

transformers = pytest.importorskip("transformers")

CLOSE = dict(rtol=1e-5, atol=1e-5)


# Ours -> the architecture export chooses for it.
OURS = {
    "tiny": (ModelConfig.preset("tiny"), "LlamaForCausalLM"),
    "1-head": (ModelConfig(vocab_size=97, context_length=16, d_model=32, num_layers=1, num_heads=1, d_ff=64),
               "LlamaForCausalLM"),
    "gqa-9-3-tied": (ModelConfig(vocab_size=300, context_length=48, d_model=72, num_layers=2, num_heads=9,
                                 num_kv_heads=3, d_ff=96, tie_embeddings=True), "LlamaForCausalLM"),
    "mqa-llama3": (ModelConfig(vocab_size=300, context_length=48, d_model=64, num_layers=2, num_heads=8,
                               num_kv_heads=1, d_ff=96, rope_theta=500_000.0, rope_scaling="llama3",
                               rope_scaling_factor=8.0, rope_original_context=16), "LlamaForCausalLM"),
    "qkv-bias-14-2": (ModelConfig(vocab_size=300, context_length=48, d_model=112, num_layers=2, num_heads=14,
                                  num_kv_heads=2, d_ff=96, qkv_bias=True), "Qwen2ForCausalLM"),
    "qkv-bias-head-dim": (ModelConfig(vocab_size=300, context_length=48, d_model=32, num_layers=2, num_heads=4,
                                      head_dim=16, d_ff=64, qkv_bias=True, tie_embeddings=True), "Qwen2ForCausalLM"),
    "qk-norm-head-dim": (ModelConfig(vocab_size=300, context_length=48, d_model=64, num_layers=2, num_heads=16,
                                     num_kv_heads=8, head_dim=8, d_ff=96, qk_norm=True, norm_eps=1e-6),
                         "Qwen3ForCausalLM"),
}


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):  # these matmuls are tiny: more threads only contend on a shared machine
        yield


def _ours_of(hf) -> TransformerLM:
    cfg = hf_config_to_model_config(hf.config)
    ours = TransformerLM(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    return ours


def _load_into_hf(ours: TransformerLM, attn: str = "eager"):
    config = to_hf_config(ours.config)
    config._attn_implementation = attn
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    result = hf.load_state_dict(to_hf_state_dict(ours.state_dict(), ours.config), strict=False)
    expected_missing = ["lm_head.weight"] if ours.config.tie_embeddings else []
    assert result.missing_keys == expected_missing and not result.unexpected_keys
    hf.tie_weights()
    return hf


@pytest.mark.parametrize("name", sorted(HF_SHAPES))
def test_hf_model_runs_in_ours_with_equal_logits(name):
    hf = hf_model(hf_config(name))
    ours = _ours_of(hf)
    cfg = ours.config
    model_type, options = HF_SHAPES[name]
    assert (cfg.num_heads, cfg.num_kv_heads) == (options["num_attention_heads"], options["num_key_value_heads"])
    assert cfg.head_dim == options.get("head_dim", options["hidden_size"] // options["num_attention_heads"])
    assert (cfg.qkv_bias, cfg.qk_norm) == (model_type == "qwen2", model_type == "qwen3")
    assert cfg.rope_scaling == options["rope_parameters"]["rope_type"].replace("default", "none")
    for length in (1, 33, COMMON["max_position_embeddings"]):  # shorter than the context, and all of it
        ids = torch.randint(0, COMMON["vocab_size"], (2, length))
        with torch.no_grad():
            assert_close(ours(ids), hf(ids).logits, **CLOSE)


@pytest.mark.parametrize("name", sorted(HF_SHAPES))
def test_greedy_generation_equals_transformers_generate(name):
    """Left-padded prompts of different lengths, decoded with our KV cache and with HF's."""
    hf = hf_model(hf_config(name))
    ours = _ours_of(hf)
    prompts = [[5, 17, 250, 3, 99, 42, 7], [1, 2, 3]]
    new = 24
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0)[:, width:].tolist()
    mine = generate(ours, prompts, new, temperature=0.0)
    assert mine == theirs
    assert all(len(set(row)) > 3 for row in mine)  # not one token repeated: the comparison has teeth


@pytest.mark.parametrize("name", sorted(OURS))
def test_ours_runs_in_the_chosen_architecture_with_equal_logits(name):
    cfg, class_name = OURS[name]
    torch.manual_seed(0)
    ours = TransformerLM(cfg).eval()
    randomize_vectors(ours.named_parameters())
    hf = _load_into_hf(ours)
    assert type(hf).__name__ == class_name == choose_architecture(cfg)[0].class_name
    for length in (1, cfg.context_length // 2 + 1, cfg.context_length):
        ids = torch.randint(0, cfg.vocab_size, (2, length))
        with torch.no_grad():
            assert_close(ours(ids), hf(ids).logits, **CLOSE)
    assert hf_config_to_model_config(hf.config) == cfg  # and the config maps back to ours


@pytest.mark.parametrize("name", sorted(OURS))
def test_state_dict_round_trip_is_exact(name):
    cfg, _ = OURS[name]
    ours = TransformerLM(cfg).state_dict()
    back = from_hf_state_dict(to_hf_state_dict(ours, cfg), cfg)
    assert back.keys() == ours.keys()
    for key in ours:
        assert torch.equal(back[key], ours[key]), key


def test_logits_and_gradients_match_sdpa():
    cfg, _ = OURS["qk-norm-head-dim"]
    ours = TransformerLM(cfg)
    randomize_vectors(ours.named_parameters())
    hf = _load_into_hf(ours, attn="sdpa")
    ids = torch.randint(0, cfg.vocab_size, (2, 20))
    ours_logits, hf_logits = ours(ids), hf(ids).logits
    assert_close(ours_logits, hf_logits, atol=2e-5, rtol=1e-4)
    probe = torch.randn_like(ours_logits)
    (ours_logits * probe).sum().backward()
    (hf_logits * probe).sum().backward()
    hf_grads = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters()}, cfg)
    for name, param in ours.named_parameters():
        assert_close(param.grad, hf_grads[name], atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_logits_match_on_left_padded_rows_and_extreme_ids():
    """Ids 0 and V-1 and a left-padded batch, where each row's real tokens are numbered 0, 1, ... (HF's generate
    does the same through position_ids from the mask; a plain HF forward needs them given)."""
    hf = hf_model(hf_config("qwen2.5"))
    ours = _ours_of(hf)
    ids = torch.randint(0, COMMON["vocab_size"], (3, 24))
    ids[0, :4] = 0
    ids[1, -4:] = COMMON["vocab_size"] - 1
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :7] = False  # left padding
    mask[2, :23] = False  # a single real token
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ours_logits = ours(ids, attention_mask=mask)
        hf_logits = hf(ids, attention_mask=mask.long(), position_ids=positions).logits
    assert_close(ours_logits[mask], hf_logits[mask], **CLOSE)


@pytest.mark.parametrize(("switches", "chosen", "why"), [
    ({}, "LlamaForCausalLM", "Llama's layout"),
    (dict(num_kv_heads=2, tie_embeddings=True, zero_init_residual=True), "LlamaForCausalLM", "Llama's layout"),
    (dict(qkv_bias=True), "Qwen2ForCausalLM", "qkv_bias=True needs Qwen2's q/k/v biases"),
    (dict(qk_norm=True, head_dim=8), "Qwen3ForCausalLM", "qk_norm=True needs Qwen3's q_norm/k_norm"),
    (dict(qk_norm=True, qkv_bias=True), None, "qk_norm=True with qkv_bias=True"),
    (dict(ffn="relu2"), None, "ffn='relu2'"),
    (dict(ffn="silu"), None, "ffn='silu'"),
    (dict(logit_softcap=15.0), None, "logit_softcap=15.0"),
    (dict(norm="layernorm"), None, "norm='layernorm'"),
    (dict(norm="none"), None, "norm='none'"),
    (dict(norm_position="post"), None, "norm_position='post'"),
    (dict(position="nope"), None, "position='nope'"),
])
def test_export_chooses_the_architecture_that_is_exact_and_says_why(switches, chosen, why):
    cfg = ModelConfig.preset("tiny", **switches)
    arch, reason = choose_architecture(cfg)
    assert (arch.class_name if arch else None) == chosen
    assert why in reason
    if arch is None:
        with pytest.raises(ValueError, match="no standard Hugging Face architecture expresses this model"):
            to_hf_state_dict(TransformerLM(cfg).state_dict(), cfg)
        with pytest.raises(ValueError, match="cannot be expressed as a Hugging Face LlamaForCausalLM"):
            to_hf_config(cfg, "llama")


def _llama3(**changes) -> dict:
    return rope(500_000.0, **({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16} | changes))


@pytest.mark.parametrize(("model_type", "options", "message"), [
    ("llama", dict(attention_bias=True), "attention_bias=True"),
    ("qwen3", dict(attention_bias=True), "attention_bias=True"),
    ("llama", dict(mlp_bias=True), "mlp_bias=True"),
    ("llama", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("qwen2", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope_type='linear'"),
    ("qwen3", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                    "original_max_position_embeddings": 16}), "rope_type='yarn'"),
    ("mistral", dict(sliding_window=16), "sliding_window=16 is shorter than max_position_embeddings=64"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
     "sliding_window=16 on its 'sliding_attention' layer_types"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
     "sliding_window=8 on its 'sliding_attention' layer_types"),
    ("qwen2", dict(num_key_value_heads=3), "model.num_kv_heads (3) must divide model.num_heads (4)"),
])
def test_unsupported_hf_configs_are_refused_naming_field_and_value(model_type, options, message):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=64)
    config = transformers.AutoConfig.for_model(model_type, **(base | options))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hf_config_to_model_config(config)


def test_harmless_sliding_settings_are_accepted():
    """A window that covers the context, or one switched off, changes nothing: not refused."""
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=64)
    for model_type, options in (("qwen2", dict(use_sliding_window=True, sliding_window=64, max_window_layers=0)),
                                ("qwen2", dict(use_sliding_window=False, sliding_window=16)),
                                ("mistral", dict(sliding_window=100))):
        cfg = hf_config_to_model_config(transformers.AutoConfig.for_model(model_type, **(base | options)))
        # The full-attention model of the same shape: nothing of the window survives, nothing else is lost.
        assert (cfg.context_length, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (64, 32, 2, 4, 4)
        assert cfg.qkv_bias == (model_type == "qwen2")


def test_llama3_parameters_are_read_and_written():
    config = transformers.AutoConfig.for_model("llama", **COMMON, hidden_size=32, num_attention_heads=4,
                                               intermediate_size=64, **_llama3(factor=32.0, high_freq_factor=2.0))
    cfg = hf_config_to_model_config(config)
    assert (cfg.rope_scaling, cfg.rope_theta, cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor, cfg.rope_original_context) == ("llama3", 500_000.0, 32.0, 1.0, 2.0, 16)
    assert to_hf_config(cfg).rope_parameters == config.rope_parameters


def test_missing_tensors_are_named():
    cfg = ModelConfig.preset("tiny", qkv_bias=True)
    sd = TransformerLM(cfg).state_dict()
    del sd["layers.1.attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"lacks 1 expected tensors, e.g. \['layers.1.attn.k_proj.bias'\]"):
        to_hf_state_dict(sd, cfg)
