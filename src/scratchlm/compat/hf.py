"""The one mapping between scratchlm's TransformerLM and Hugging Face transformers' Llama-family decoders.

Parity tests, `scratchlm export hf|gguf` and `import hf|gguf` all use these functions, so the mapping exists once.
Llama, Qwen2, Qwen3 and Mistral share one layout (RMSNorm, pre-norm, RoPE, SwiGLU, grouped-query attention, tied
or untied embeddings, any head_dim, the "llama3" RoPE scaling) and differ only in what their attention adds
(`ARCHITECTURES`). Llama's and Qwen3's ``attention_bias`` also adds an o_proj bias, which our attention has not,
so it is refused, as are ``mlp_bias``, a non-SiLU ``hidden_act``, other RoPE types and a sliding window shorter
than the context. Tensor names: `_names`.

RoPE pairing differs: we rotate adjacent pairs (x₂ᵢ, x₂ᵢ₊₁), HF's `rotate_half` rotates (xᵢ, xᵢ₊d/2), both with
frequency θ^(-2i/d). Reordering each head's Q and K output rows as [0, 2, 4, ..., 1, 3, 5, ...] turns one into
the other; q·k is unchanged because Q and K get the same permutation, and V is untouched. Everything indexed by
those rows is reordered alike: the q/k biases (per head; K has num_kv_heads heads) and the q_norm/k_norm gains
(one head_dim vector; the RMS over a head does not depend on the order).

`transformers` is imported lazily (it is a test/export dependency, not a runtime one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scratchlm.model.config import ModelConfig


@dataclass(frozen=True)
class Architecture:
    model_type: str
    class_name: str
    qkv_bias: bool  # its q/k/v projections always (True) or never (False) have biases
    qk_norm: bool  # it always (True) or never (False) has q_norm/k_norm
    off: dict  # the options of its transformers config that export switches off (biases, sliding windows)
    why: str = ""  # why export chooses it; empty: export never does (Llama says the same), import reads it


# In export's order: the first that expresses a model exactly is the one export writes.
ARCHITECTURES = {arch.model_type: arch for arch in (
    Architecture("llama", "LlamaForCausalLM", qkv_bias=False, qk_norm=False,
                 off=dict(attention_bias=False, mlp_bias=False),
                 why="RMSNorm, pre-norm, RoPE and SwiGLU without biases or QK-norm are Llama's layout"),
    Architecture("qwen2", "Qwen2ForCausalLM", qkv_bias=True, qk_norm=False,
                 off=dict(use_sliding_window=False, sliding_window=None),
                 why="qkv_bias=True needs Qwen2's q/k/v biases"),
    Architecture("qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True,
                 off=dict(attention_bias=False, use_sliding_window=False, sliding_window=None),
                 why="qk_norm=True needs Qwen3's q_norm/k_norm"),
    Architecture("mistral", "MistralForCausalLM", qkv_bias=False, qk_norm=False, off=dict(sliding_window=None)),
)}
# What all four share: our switches that must have these values.
_SHARED_LAYOUT = {"norm": "rmsnorm", "norm_position": "pre", "position": "rope", "ffn": "swiglu"}
ROPE_TYPES = ("default", "llama3")
# Our llama3 fields and the names of the same numbers in transformers' rope parameters.
_LLAMA3_PARAMETERS = (("rope_scaling_factor", "factor"), ("rope_low_freq_factor", "low_freq_factor"),
                      ("rope_high_freq_factor", "high_freq_factor"),
                      ("rope_original_context", "original_max_position_embeddings"))


# ------------------------------------------------------------------------------------ choosing an architecture

def _unshared(cfg: ModelConfig) -> dict[str, str]:
    """{"name=value": what none of the four architectures has} for the switches of `cfg` outside their layout."""
    wrong = {f"{name}={getattr(cfg, name)!r}": f"needs {value!r}"
             for name, value in _SHARED_LAYOUT.items() if getattr(cfg, name) != value}
    if cfg.logit_softcap:
        wrong[f"logit_softcap={cfg.logit_softcap!r}"] = "has no logit cap"
    return wrong  # zero_init_residual is only an initialisation: it maps


def mismatches(cfg: ModelConfig, arch: Architecture) -> list[str]:
    """The switches of `cfg` that `arch` cannot express, each as "name=value (why)"; empty: it maps exactly."""
    wrong = [f"{switch} ({arch.class_name} {why})" for switch, why in _unshared(cfg).items()]
    for name in ("qk_norm", "qkv_bias"):
        if getattr(cfg, name) != getattr(arch, name):
            has = "always has them" if getattr(arch, name) else "has none"
            wrong.append(f"{name}={getattr(cfg, name)!r} ({arch.class_name} {has})")
    return wrong


def choose_architecture(cfg: ModelConfig) -> tuple[Architecture | None, str]:
    """(the architecture export writes, why) or (None, why no standard architecture expresses `cfg` exactly)."""
    for arch in ARCHITECTURES.values():
        if arch.why and not mismatches(cfg, arch):
            return arch, f"{arch.class_name}: {arch.why}"
    if shared := list(_unshared(cfg)):
        return None, (f"{', '.join(shared)}: Llama, Qwen2 and Qwen3 are RMSNorm, pre-norm, RoPE and SwiGLU "
                      f"without a logit cap")
    return None, ("qk_norm=True with qkv_bias=True: Qwen3's q_norm/k_norm come without q/k/v-only biases (its "
                  "attention_bias adds an o_proj bias too), Qwen2's biases without QK-norm")


def check_expressible(cfg: ModelConfig, model_type: str | None = None) -> Architecture:
    """The architecture of `model_type`, or the one export chooses; ValueError naming why it cannot express `cfg`."""
    if model_type is None:
        arch, why = choose_architecture(cfg)
        if arch is None:
            raise ValueError(f"no standard Hugging Face architecture expresses this model: {why}")
        return arch
    arch = ARCHITECTURES[model_type]
    wrong = mismatches(cfg, arch)
    if wrong:
        raise ValueError(f"this model cannot be expressed as a Hugging Face {arch.class_name}: " + ", ".join(wrong))
    return arch


# ------------------------------------------------------------------------------------------------ configs

def rope_parameters(cfg: ModelConfig) -> dict:
    """transformers 5's ``rope_parameters`` of our RoPE: θ, and the llama3 rule's four numbers when it is on."""
    parameters = {"rope_type": "default" if cfg.rope_scaling == "none" else cfg.rope_scaling,
                  "rope_theta": float(cfg.rope_theta)}
    if cfg.rope_scaling == "llama3":
        parameters |= {theirs: getattr(cfg, ours) for ours, theirs in _LLAMA3_PARAMETERS}
    return parameters


def to_hf_config(cfg: ModelConfig, model_type: str | None = None):
    """The transformers config (LlamaConfig, Qwen2Config...) of the same model, of `model_type` or of the
    architecture export chooses; ValueError when it cannot express `cfg`. Attention implementation: the caller's."""
    from transformers import AutoConfig

    arch = check_expressible(cfg, model_type)
    return AutoConfig.for_model(
        arch.model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.context_length, rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope_parameters(cfg), tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu",
        architectures=[arch.class_name], **arch.off)


def with_both_rope_spellings(document: dict, cfg: ModelConfig) -> dict:
    """config.json that transformers 4.x (reads ``rope_theta``, ``rope_scaling``) and 5.x (reads
    ``rope_parameters``) both load with our RoPE: each version reads its own keys, and a 4.x reader missing
    ``rope_theta`` would silently use 10000 (and one missing ``rope_scaling`` no llama3 rule)."""
    parameters = rope_parameters(cfg)
    scaling = None
    if cfg.rope_scaling != "none":
        scaling = {key: value for key, value in parameters.items() if key != "rope_theta"}
    return {**document, "rope_theta": float(cfg.rope_theta), "rope_scaling": scaling, "rope_parameters": parameters}


def rope_spellings(document: dict) -> list[dict]:
    """The RoPE settings a config.json spells, normalised to transformers 5's rope_parameters: one per spelling
    present (5.x's ``rope_parameters``, 4.x's ``rope_theta`` + ``rope_scaling``, whose type key was once
    ``type``). Two that differ mean transformers versions would run different models."""
    found = []
    if isinstance(document.get("rope_parameters"), dict):
        found.append(_normalised_rope(document["rope_parameters"], document["rope_parameters"].get("rope_theta")))
    if "rope_theta" in document or document.get("rope_scaling") is not None:
        found.append(_normalised_rope(document.get("rope_scaling") or {}, document.get("rope_theta")))
    return found


def _normalised_rope(settings, theta) -> dict:
    if not isinstance(settings, dict):
        raise ValueError(f"rope_scaling={settings!r} is not an object")
    kind = settings.get("rope_type", settings.get("type", "default"))
    rest = {key: value for key, value in settings.items() if key not in ("rope_type", "type", "rope_theta")}
    return {"rope_type": kind, "rope_theta": 10_000.0 if theta is None else theta, **rest}


def hf_config_to_model_config(hf_cfg, rope: dict | None = None) -> ModelConfig:
    """ModelConfig of a transformers config of one of ARCHITECTURES (read by its model_type); ValueError naming
    each unsupported field and its value. `rope`: normalised RoPE settings (`rope_spellings`) to use instead of
    ``hf_cfg.rope_parameters``, which transformers fills from whichever spelling it prefers."""
    model_type = getattr(hf_cfg, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type={model_type!r} is not one of {sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[model_type]
    problems = [f"{name}={getattr(hf_cfg, name)!r} (our layers have no such bias)"
                for name in ("attention_bias", "mlp_bias") if getattr(hf_cfg, name, False)]
    if getattr(hf_cfg, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf_cfg.hidden_act!r} (our SwiGLU needs 'silu')")
    if getattr(hf_cfg, "quantization_config", None):
        problems.append(f"quantization_config={hf_cfg.quantization_config!r} (only float weights are read)")
    if getattr(hf_cfg, "partial_rotary_factor", 1.0) != 1.0:  # 4.x's spelling; 5.x's is in rope_parameters
        problems.append(f"partial_rotary_factor={hf_cfg.partial_rotary_factor!r} (our RoPE rotates the whole head)")
    problems += _sliding_window_problems(hf_cfg)
    if rope is None:
        parameters = hf_cfg.rope_parameters or {}
        rope = _normalised_rope(parameters, parameters.get("rope_theta"))
    scaling, rope_problems = _rope_fields(rope)
    problems += rope_problems
    if problems:
        raise ValueError(f"unsupported Hugging Face {model_type} config: " + "; ".join(problems))
    heads = hf_cfg.num_attention_heads
    return ModelConfig(
        vocab_size=hf_cfg.vocab_size, context_length=hf_cfg.max_position_embeddings, d_model=hf_cfg.hidden_size,
        num_layers=hf_cfg.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(hf_cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // heads,
        d_ff=hf_cfg.intermediate_size, norm_eps=hf_cfg.rms_norm_eps,
        tie_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", False)),
        qkv_bias=arch.qkv_bias, qk_norm=arch.qk_norm, **scaling)


def _sliding_window_problems(hf_cfg) -> list[str]:
    """A sliding window shorter than the context changes attention (ours sees the whole context); one that
    covers it is the same as none. Mistral applies `sliding_window` to every layer; Qwen2/3 to the layers
    their `layer_types` (from use_sliding_window and max_window_layers) call "sliding_attention"."""
    layer_types = list(getattr(hf_cfg, "layer_types", None) or [])
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        return [f"layer_types has {unknown[0]!r} (only 'full_attention' is ours)"]
    window, context = getattr(hf_cfg, "sliding_window", None), hf_cfg.max_position_embeddings
    slides = hf_cfg.model_type == "mistral" or "sliding_attention" in layer_types
    if slides and window is not None and window < context:
        where = "" if hf_cfg.model_type == "mistral" else " on its 'sliding_attention' layer_types"
        return [f"sliding_window={window!r}{where} is shorter than max_position_embeddings={context!r} (our "
                f"attention sees the whole context)"]
    return []


def _rope_fields(rope: dict) -> tuple[dict, list[str]]:
    """(our rope_* ModelConfig fields, problems) of normalised RoPE settings."""
    kind = rope.get("rope_type")
    fields = {"rope_theta": rope["rope_theta"]}
    if kind not in ROPE_TYPES:
        return fields, [f"rope_type={kind!r} (our RoPE knows {list(ROPE_TYPES)})"]
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        return fields, [f"partial_rotary_factor={partial!r} (our RoPE rotates the whole head)"]
    if kind == "default":
        return fields, []
    missing = [theirs for _, theirs in _LLAMA3_PARAMETERS if theirs not in rope]
    if missing:
        return fields, [f"rope_type='llama3' without {missing[0]}"]
    return fields | {"rope_scaling": "llama3"} | {ours: rope[theirs] for ours, theirs in _LLAMA3_PARAMETERS}, []


# ------------------------------------------------------------------------------------------------ weights

def _pairs_to_halves(head_dim: int) -> torch.Tensor:
    """Row order that turns adjacent-pair RoPE rows into rotate_half rows: [0, 2, 4, ..., 1, 3, 5, ...]."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def _permute_heads(weight: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Reorder the rows of a (heads·head_dim, ...) projection weight or bias within each head (head_dim =
    len(order); K has num_kv_heads heads, Q num_heads, a q/k norm gain is one head)."""
    return weight.unflatten(0, (-1, len(order)))[:, order].flatten(0, 1).contiguous()


# (our suffix, HF suffix) inside layer i, and whether its rows follow RoPE's pairing. Ours follow CS336, HF's follow
# Llama (identical across the four architectures).
_LAYER_NAMES = (
    ("attn.q_proj.weight", "self_attn.q_proj.weight", True),
    ("attn.k_proj.weight", "self_attn.k_proj.weight", True),
    ("attn.v_proj.weight", "self_attn.v_proj.weight", False),
    ("attn.output_proj.weight", "self_attn.o_proj.weight", False),
    ("ffn.w1.weight", "mlp.gate_proj.weight", False),
    ("ffn.w3.weight", "mlp.up_proj.weight", False),
    ("ffn.w2.weight", "mlp.down_proj.weight", False),
    ("ln1.weight", "input_layernorm.weight", False),
    ("ln2.weight", "post_attention_layernorm.weight", False),
)
_BIAS_NAMES = (("attn.q_proj.bias", "self_attn.q_proj.bias", True), ("attn.k_proj.bias", "self_attn.k_proj.bias", True),
               ("attn.v_proj.bias", "self_attn.v_proj.bias", False))
_QK_NORM_NAMES = (("attn.q_norm.weight", "self_attn.q_norm.weight", True),
                  ("attn.k_norm.weight", "self_attn.k_norm.weight", True))


def _names(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    """(our name, HF name, permuted) of every tensor of `cfg` (tied: no lm_head, HF re-ties it)."""
    names = [("token_embeddings.weight", "model.embed_tokens.weight", False),
             ("ln_final.weight", "model.norm.weight", False)]
    if not cfg.tie_embeddings:
        names.append(("lm_head.weight", "lm_head.weight", False))
    layer = list(_LAYER_NAMES) + list(_BIAS_NAMES if cfg.qkv_bias else ()) + list(_QK_NORM_NAMES if cfg.qk_norm else ())
    return names + [(f"layers.{i}.{ours}", f"model.layers.{i}.{theirs}", permuted)
                    for i in range(cfg.num_layers) for ours, theirs, permuted in layer]


def _convert(source: dict[str, torch.Tensor], cfg: ModelConfig, *, to_hf: bool,
             rope_halves: bool) -> dict[str, torch.Tensor]:
    check_expressible(cfg)
    order = _pairs_to_halves(cfg.head_dim)
    if not to_hf:
        order = torch.argsort(order)  # the inverse permutation
    out: dict[str, torch.Tensor] = {}
    missing = []
    for ours, theirs, permuted in _names(cfg):
        src, dst = (ours, theirs) if to_hf else (theirs, ours)
        if src not in source:
            missing.append(src)
            continue
        out[dst] = _permute_heads(source[src], order) if permuted and rope_halves else source[src]
    if missing:
        raise ValueError(f"state dict lacks {len(missing)} expected tensors, e.g. {missing[:3]}")
    if cfg.tie_embeddings and not to_hf:
        out["lm_head.weight"] = out["token_embeddings.weight"]
    return out


def to_hf_state_dict(our_sd: dict[str, torch.Tensor], cfg: ModelConfig, *,
                     rope_halves: bool = True) -> dict[str, torch.Tensor]:
    """Our state dict -> the HF state dict of the chosen architecture (tied: lm_head.weight omitted).
    rope_halves=False keeps our RoPE row order (llama.cpp's llama graph pairs rows as we do)."""
    return _convert(our_sd, cfg, to_hf=True, rope_halves=rope_halves)


def from_hf_state_dict(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig, *,
                       rope_halves: bool = True) -> dict[str, torch.Tensor]:
    """HF state dict -> ours (tied: lm_head.weight is the embedding tensor, as in our model); rope_halves=False:
    its RoPE rows are already in our order."""
    return _convert(hf_sd, cfg, to_hf=False, rope_halves=rope_halves)
