"""The one mapping between scratchlm's TransformerLM and Hugging Face `transformers.LlamaForCausalLM`.

Parity tests and `scratchlm export hf` / `import hf` all use these four functions, so the mapping exists once.

Names: ours follow CS336, HF's follow Llama:
    token_embeddings.weight          <-> model.embed_tokens.weight
    layers.{i}.attn.{q,k,v}_proj     <-> model.layers.{i}.self_attn.{q,k,v}_proj
    layers.{i}.attn.output_proj      <-> model.layers.{i}.self_attn.o_proj
    layers.{i}.ffn.w1 / w3 / w2      <-> model.layers.{i}.mlp.gate_proj / up_proj / down_proj
    layers.{i}.ln1 / ln2             <-> model.layers.{i}.input_layernorm / post_attention_layernorm
    ln_final / lm_head               <-> model.norm / lm_head

RoPE pairing differs: we rotate adjacent pairs (x₂ᵢ, x₂ᵢ₊₁), HF's `rotate_half` rotates (xᵢ, xᵢ₊d/2), both with
frequency θ^(-2i/d). Reordering each head's Q and K output rows as [0, 2, 4, ..., 1, 3, 5, ...] turns one into
the other; q·k is unchanged because Q and K get the same permutation, and V is untouched.

Only the Llama architecture maps: rmsnorm, pre-norm, RoPE, SwiGLU. Anything else is refused with a clear error.
`transformers` is imported lazily (it is a test/export dependency, not a runtime one).
"""

from __future__ import annotations

import torch

from scratchlm.model.config import ModelConfig

_LLAMA_ARCHITECTURE = {"norm": "rmsnorm", "norm_position": "pre", "position": "rope", "ffn": "swiglu"}

# (our suffix, HF suffix) inside layer i.
_LAYER_NAMES = (
    ("attn.q_proj.weight", "self_attn.q_proj.weight"),
    ("attn.k_proj.weight", "self_attn.k_proj.weight"),
    ("attn.v_proj.weight", "self_attn.v_proj.weight"),
    ("attn.output_proj.weight", "self_attn.o_proj.weight"),
    ("ffn.w1.weight", "mlp.gate_proj.weight"),
    ("ffn.w3.weight", "mlp.up_proj.weight"),
    ("ffn.w2.weight", "mlp.down_proj.weight"),
    ("ln1.weight", "input_layernorm.weight"),
    ("ln2.weight", "post_attention_layernorm.weight"),
)
_ROPE_PERMUTED = ("attn.q_proj.weight", "attn.k_proj.weight")


def check_llama_compatible(cfg: ModelConfig) -> None:
    """Raise ValueError naming every switch that has no Llama equivalent."""
    wrong = [f"{name}={getattr(cfg, name)!r} (Llama needs {value!r})"
             for name, value in _LLAMA_ARCHITECTURE.items() if getattr(cfg, name) != value]
    # Llama has no q/k norms and no logit cap (zero_init_residual is only an initialisation: it exports fine).
    wrong += [f"{name}={getattr(cfg, name)!r} (Llama has none)" for name in ("qk_norm", "logit_softcap")
              if getattr(cfg, name)]
    # Not mapped yet: q/k/v biases and RoPE scaling (Llama itself can hold both).
    wrong += [f"{name}={getattr(cfg, name)!r} (not mapped to Hugging Face yet)"
              for name, off in (("qkv_bias", False), ("rope_scaling", "none")) if getattr(cfg, name) != off]
    if wrong:
        raise ValueError("this model cannot be expressed as a Hugging Face Llama: " + ", ".join(wrong))


def _pairs_to_halves(head_dim: int) -> torch.Tensor:
    """Row order that turns adjacent-pair RoPE rows into rotate_half rows: [0, 2, 4, ..., 1, 3, 5, ...]."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def _permute_heads(weight: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Reorder the output rows of a (heads·head_dim, d_model) projection within each head (head_dim = len(order);
    K has num_kv_heads heads, Q num_heads)."""
    return weight.unflatten(0, (-1, len(order)))[:, order].flatten(0, 1).contiguous()


def to_hf_llama_config(cfg: ModelConfig):
    """The `transformers.LlamaConfig` of the same architecture (attention implementation left to the caller)."""
    from transformers import LlamaConfig

    check_llama_compatible(cfg)
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.context_length, rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu", attention_bias=False, mlp_bias=False,
    )


def hf_config_to_model_config(hf_cfg) -> ModelConfig:
    """ModelConfig of a Hugging Face LlamaConfig; refuses GQA, biases, RoPE scaling and non-SiLU activations."""
    heads, kv_heads = hf_cfg.num_attention_heads, getattr(hf_cfg, "num_key_value_heads", None)
    problems = []
    if kv_heads not in (None, heads):
        problems.append(f"grouped-query attention (num_key_value_heads={kv_heads} != num_attention_heads={heads})")
    head_dim = getattr(hf_cfg, "head_dim", None)
    if head_dim not in (None, hf_cfg.hidden_size // heads):
        problems.append(f"head_dim={head_dim} != hidden_size/num_attention_heads")
    problems += [f"{name}=True (our model has no biases)" for name in ("attention_bias", "mlp_bias")
                 if getattr(hf_cfg, name, False)]
    if getattr(hf_cfg, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf_cfg.hidden_act!r} (need 'silu')")
    rope_theta, scaling = rope_settings(hf_cfg)
    if scaling != "default":
        problems.append(f"RoPE scaling {scaling!r} (our RoPE has none)")
    if problems:
        raise ValueError("unsupported Hugging Face Llama config: " + "; ".join(problems))
    return ModelConfig(
        vocab_size=hf_cfg.vocab_size, context_length=hf_cfg.max_position_embeddings, d_model=hf_cfg.hidden_size,
        num_layers=hf_cfg.num_hidden_layers, num_heads=heads, d_ff=hf_cfg.intermediate_size,
        rope_theta=rope_theta, norm_eps=hf_cfg.rms_norm_eps,
        tie_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", False)),
    )


def rope_settings(hf_cfg) -> tuple[float, str]:
    """(rope_theta, scaling type) under either spelling: transformers 5's ``rope_parameters`` or 4.x's
    ``rope_theta`` + ``rope_scaling`` (whose type key was once ``type``); a scaling under either is reported."""
    parameters = getattr(hf_cfg, "rope_parameters", None) or {}
    scalings = [settings.get("rope_type", settings.get("type", "default"))
                for settings in (parameters, getattr(hf_cfg, "rope_scaling", None) or {})]
    theta = parameters.get("rope_theta") or getattr(hf_cfg, "rope_theta", None) or 10_000.0
    return float(theta), next((kind for kind in scalings if kind != "default"), "default")


def with_both_rope_spellings(document: dict, rope_theta: float) -> dict:
    """config.json that transformers 4.x (reads ``rope_theta``, ``rope_scaling``) and 5.x (reads
    ``rope_parameters``) both load with our θ: each version ignores the other's keys, and a 4.x reader missing
    ``rope_theta`` would silently use 10000."""
    return {**document, "rope_theta": float(rope_theta), "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(rope_theta)}}


def _top_level_names(cfg: ModelConfig) -> list[tuple[str, str]]:
    names = [("token_embeddings.weight", "model.embed_tokens.weight"), ("ln_final.weight", "model.norm.weight")]
    if not cfg.tie_embeddings:
        names.append(("lm_head.weight", "lm_head.weight"))
    return names


def _convert(source: dict[str, torch.Tensor], cfg: ModelConfig, to_hf: bool) -> dict[str, torch.Tensor]:
    check_llama_compatible(cfg)
    pairs = _top_level_names(cfg) + [(f"layers.{i}.{ours}", f"model.layers.{i}.{theirs}")
                                     for i in range(cfg.num_layers) for ours, theirs in _LAYER_NAMES]
    order = _pairs_to_halves(cfg.head_dim)
    if not to_hf:
        order = torch.argsort(order)  # the inverse permutation
    out: dict[str, torch.Tensor] = {}
    missing = []
    for ours, theirs in pairs:
        src, dst = (ours, theirs) if to_hf else (theirs, ours)
        if src not in source:
            missing.append(src)
            continue
        tensor = source[src]
        if ours.endswith(_ROPE_PERMUTED):
            tensor = _permute_heads(tensor, order)
        out[dst] = tensor
    if missing:
        raise ValueError(f"state dict lacks {len(missing)} expected tensors, e.g. {missing[:3]}")
    if cfg.tie_embeddings and not to_hf:
        out["lm_head.weight"] = out["token_embeddings.weight"]
    return out


def to_hf_state_dict(our_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> LlamaForCausalLM state dict (tied: lm_head.weight omitted, HF re-ties it)."""
    return _convert(our_sd, cfg, to_hf=True)


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM state dict -> ours (tied: lm_head.weight is the embedding tensor, as in our model)."""
    return _convert(hf_sd, cfg, to_hf=False)
