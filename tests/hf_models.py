"""Tiny random Hugging Face models with the head layouts of real checkpoints (built here, nothing downloaded)."""

from __future__ import annotations

import torch

COMMON = dict(vocab_size=300, num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-6)


def rope(theta: float, **llama3) -> dict:
    """transformers 5's rope_parameters keyword: default RoPE at `theta`, or the llama3 rule with `llama3`."""
    scaling = {"rope_type": "llama3", **llama3} if llama3 else {"rope_type": "default"}
    return {"rope_parameters": {**scaling, "rope_theta": theta}}


# Tiny versions of real checkpoints: fewer layers, a smaller vocabulary, the same head layout.
HF_SHAPES = {
    # SmolLM2-135M: d 576, 9 query / 3 KV heads of 64, tied.
    "smollm2-135m": ("llama", dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, intermediate_size=96,
                                   tie_word_embeddings=True, **rope(100_000.0))),
    # Llama-3.2-1B: 32 / 8 heads, tied, llama3 RoPE scaling (an original context short enough to matter here:
    # of head_dim 4's two frequencies one is in the smoothed band, the other divided by the factor).
    "llama-3.2-1b": ("llama", dict(hidden_size=128, num_attention_heads=32, num_key_value_heads=8, intermediate_size=96,
                                   tie_word_embeddings=True, **rope(500_000.0, factor=32.0, low_freq_factor=1.0,
                                                                    high_freq_factor=4.0,
                                                                    original_max_position_embeddings=16))),
    # Qwen2.5-0.5B: 14 / 2 heads, q/k/v biases, tied.
    "qwen2.5": ("qwen2", dict(hidden_size=112, num_attention_heads=14, num_key_value_heads=2, intermediate_size=96,
                              tie_word_embeddings=True, **rope(1_000_000.0))),
    # Qwen3-0.6B: 16 / 8 heads with head_dim 128 != d_model 1024 / 16; QK-norm.
    "qwen3-0.6b": ("qwen3", dict(hidden_size=64, num_attention_heads=16, num_key_value_heads=8, head_dim=8,
                                 intermediate_size=96, tie_word_embeddings=True, **rope(1_000_000.0))),
    "mistral": ("mistral", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                sliding_window=None, **rope(10_000.0))),
    "mistral-window-covers-context": ("mistral", dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                                                      intermediate_size=64, sliding_window=64, **rope(10_000.0))),
}


def randomize_vectors(named_parameters) -> None:
    """Norm gains far from 1 and non-zero biases, so a wrong or missing mapping of either shows."""
    with torch.no_grad():
        for name, parameter in named_parameters:
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.5)
            elif parameter.dim() == 1:
                parameter.uniform_(0.5, 1.5)


def hf_config(name: str, attn: str = "eager"):
    from transformers import AutoConfig

    model_type, options = HF_SHAPES[name]
    config = AutoConfig.for_model(model_type, **COMMON, **options)
    config._attn_implementation = attn
    return config


def hf_model(config, seed: int = 0):
    """A random model of `config` whose greedy decoding does not settle on one token."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # matrices larger than the init and small embeddings: decoding does not settle on one
        for name, parameter in model.named_parameters():  # token (a tied model repeats its input otherwise)
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.02 if "embed_tokens" in name else 0.2)
    randomize_vectors(model.named_parameters())
    model.tie_weights()
    return model
