"""TransformerLM == Hugging Face LlamaForCausalLM with the same weights, mapped by scratchlm.compat.hf."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from scratchlm.compat.hf import (
    from_hf_state_dict,
    hf_config_to_model_config,
    to_hf_llama_config,
    to_hf_state_dict,
)
from scratchlm.model import ModelConfig, TransformerLM

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "tiny": ModelConfig.preset("tiny"),
    "8-heads-theta-500": ModelConfig(vocab_size=300, context_length=48, d_model=64, num_layers=3, num_heads=8,
                                     d_ff=96, rope_theta=500.0, norm_eps=1e-6),
    "1-head": ModelConfig(vocab_size=97, context_length=16, d_model=32, num_layers=1, num_heads=1, d_ff=64),
    "tied": ModelConfig.preset("tiny", tie_embeddings=True),
}


def _hf_model(cfg: ModelConfig, attn: str = "eager"):
    hf_cfg = to_hf_llama_config(cfg)
    hf_cfg._attn_implementation = attn
    return transformers.LlamaForCausalLM(hf_cfg).eval()


def _load_into_hf(ours: TransformerLM, attn: str = "eager"):
    hf = _hf_model(ours.config, attn)
    result = hf.load_state_dict(to_hf_state_dict(ours.state_dict(), ours.config), strict=False)
    expected_missing = ["lm_head.weight"] if ours.config.tie_embeddings else []
    assert result.missing_keys == expected_missing and not result.unexpected_keys
    return hf


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_llama_eager(name):
    cfg = CONFIGS[name]
    ours = TransformerLM(cfg).eval()
    hf = _load_into_hf(ours)
    for length in (1, cfg.context_length // 2 + 1, cfg.context_length):  # shorter than context, and full
        ids = torch.randint(0, cfg.vocab_size, (2, length))
        with torch.no_grad():
            assert_close(ours(ids), hf(ids).logits, atol=2e-5, rtol=1e-4)


def test_logits_and_gradients_match_llama_sdpa():
    cfg = CONFIGS["8-heads-theta-500"]
    ours = TransformerLM(cfg)
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


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_state_dict_round_trip_is_exact(name):
    cfg = CONFIGS[name]
    ours = TransformerLM(cfg).state_dict()
    back = from_hf_state_dict(to_hf_state_dict(ours, cfg), cfg)
    assert back.keys() == ours.keys()
    for key in ours:
        assert torch.equal(back[key], ours[key]), key


def test_import_direction_hf_weights_run_in_our_model():
    cfg = CONFIGS["8-heads-theta-500"]
    hf = _hf_model(cfg)
    converted = hf_config_to_model_config(hf.config)
    assert converted == cfg
    ours = TransformerLM(converted).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), converted))
    ids = torch.randint(0, cfg.vocab_size, (1, 30))
    with torch.no_grad():
        assert_close(ours(ids), hf(ids).logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("switch", [dict(norm="layernorm"), dict(norm_position="post"), dict(position="nope"),
                                    dict(ffn="silu"), dict(norm="none")])
def test_non_llama_architectures_are_refused(switch):
    cfg = ModelConfig.preset("tiny", **switch)
    key = next(iter(switch))
    with pytest.raises(ValueError, match=f"cannot be expressed as a Hugging Face Llama: {key}="):
        to_hf_llama_config(cfg)
    with pytest.raises(ValueError, match=key):
        to_hf_state_dict(TransformerLM(cfg).state_dict(), cfg)


def test_unsupported_hf_configs_are_refused():
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(ValueError, match="grouped-query attention"):
        hf_config_to_model_config(transformers.LlamaConfig(**base, num_key_value_heads=2))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        hf_config_to_model_config(transformers.LlamaConfig(**base, hidden_act="gelu"))
    with pytest.raises(ValueError, match="biases"):
        hf_config_to_model_config(transformers.LlamaConfig(**base, attention_bias=True))


def test_missing_tensors_are_named():
    cfg = CONFIGS["tiny"]
    sd = TransformerLM(cfg).state_dict()
    del sd["layers.1.ffn.w2.weight"]
    with pytest.raises(ValueError, match=r"lacks 1 expected tensors, e.g. \['layers.1.ffn.w2.weight'\]"):
        to_hf_state_dict(sd, cfg)


def test_logits_match_llama_on_left_padded_rows_extreme_ids_and_random_norm_gains():
    """Adversarial inputs against HF: norm gains far from 1 (a swapped or missing norm mapping shows), ids 0 and
    V-1, and a left-padded batch, where each row's real tokens are numbered 0, 1, ... (HF's generate does the same
    through position_ids from the mask; a plain HF forward needs them given)."""
    cfg = CONFIGS["8-heads-theta-500"]
    torch.manual_seed(3)
    ours = TransformerLM(cfg).eval()
    with torch.no_grad():
        for name, parameter in ours.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")):
                parameter.copy_(torch.empty_like(parameter).uniform_(0.2, 3.0))
    hf = _load_into_hf(ours)
    ids = torch.randint(0, cfg.vocab_size, (3, 24))
    ids[0, :4] = 0
    ids[1, -4:] = cfg.vocab_size - 1
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :7] = False  # left padding
    mask[2, :23] = False  # a single real token
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ours_logits = ours(ids, attention_mask=mask)
        hf_logits = hf(ids, attention_mask=mask.long(), position_ids=positions).logits
    assert_close(ours_logits[mask], hf_logits[mask], atol=2e-5, rtol=1e-4)
