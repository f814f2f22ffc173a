"""ScratchLMForCausalLM: a scratchlm TransformerLM as Hugging Face custom code, for every architecture switch.

Written by `scratchlm`'s custom-code export beside the weights (model.safetensors, scratchlm's own parameter
names) and loaded with ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``; ``generate()``
works with transformers' KV cache. This file imports only torch and transformers, so the folder needs no
scratchlm. It is the export target, so it uses torch.nn freely; the math is scratchlm's, operation for
operation, so the logits equal scratchlm's up to float rounding:

- norms (``norm``: rmsnorm | layernorm | none) compute in at least float32 and cast back; ``norm_position``
  pre: x + attn(ln1(x)), then + ffn(ln2(.)); post: ln1(x + attn(x)), then ln2(. + ffn(.));
- attention: q/k/v projections (biases with ``qkv_bias``), ``num_kv_heads`` K/V heads each shared by
  num_heads / num_kv_heads consecutive query heads, ``head_dim`` per head, optional RMSNorm of each head's q and
  k (``qk_norm``), then RoPE (``position`` rope | nope) on ADJACENT pairs (x2i, x2i+1) with frequencies
  theta^(-2i/head_dim), optionally rescaled by Llama 3.1's rule (``rope_scaling_type`` llama3), then causal
  softmax attention that never attends a padding key;
- FFN (``ffn``): swiglu W2(SiLU(W1 x) * W3 x) | silu W2 SiLU(W1 x) | relu2 W2 ReLU(W1 x)^2;
- the head: ln_final, then lm_head, or the token-embedding matrix itself with ``tie_embeddings``; logits ->
  cap * tanh(logits / cap) with ``logit_softcap`` > 0.

Positions: without ``position_ids``, each row's real tokens are numbered 0, 1, 2, ... after any left padding
(from ``attention_mask``), continuing the cached ones. RoPE angles are computed from the positions on every call
(no precomputed table), so there is no length limit and nothing for from_pretrained to initialise.

The cache argument is ``past_key_values`` up to transformers 5.x's rename to ``cache``; both are accepted, and
the output carries it under the name the installed transformers uses.
"""

import math

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_scratchlm import ScratchLMConfig

_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _at_least_float32(x):
    return x.to(torch.promote_types(x.dtype, torch.float32))


class ScratchLMRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * g over the last dim, in at least float32."""

    def __init__(self, size, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        x32 = _at_least_float32(x)
        inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * inv_rms * self.weight.to(x32.dtype)).to(x.dtype)


class ScratchLMLayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * g + b over the last dim (biased variance), in at least float32."""

    def __init__(self, size, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))

    def forward(self, x):
        x32 = _at_least_float32(x)
        centered = x32 - x32.mean(dim=-1, keepdim=True)
        inv_std = torch.rsqrt(centered.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (centered * inv_std * self.weight.to(x32.dtype) + self.bias.to(x32.dtype)).to(x.dtype)


def make_norm(config, size):
    if config.norm == "rmsnorm":
        return ScratchLMRMSNorm(size, config.norm_eps)
    if config.norm == "layernorm":
        return ScratchLMLayerNorm(size, config.norm_eps)
    if config.norm == "none":
        return nn.Identity()
    raise ValueError(f"config.json: norm must be rmsnorm, layernorm or none, got {config.norm!r}")


def rope_inverse_frequencies(config, device):
    """theta^(-2i/head_dim) for i < head_dim/2, float32, rescaled by the llama3 rule when the config says so:
    wavelengths 2 pi / w above original_context / low_freq_factor rotate `factor` times slower, those below
    original_context / high_freq_factor are kept, the band between is interpolated smoothly."""
    d = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.int64).float() / d)
    if config.rope_scaling_type == "none":
        return inv_freq
    if config.rope_scaling_type != "llama3":
        raise ValueError(f"config.json: rope_scaling_type must be none or llama3, got {config.rope_scaling_type!r}")
    wavelength = 2 * math.pi / inv_freq
    smooth = (config.rope_original_context / wavelength - config.rope_low_freq_factor) / (
        config.rope_high_freq_factor - config.rope_low_freq_factor)
    smooth = smooth.clamp(0.0, 1.0)  # 0: long wavelengths (w / factor), 1: short ones (w kept)
    return (1 - smooth) * inv_freq / config.rope_scaling_factor + smooth * inv_freq


def rotate_pairs(x, cos, sin):
    """x (B, H, T, d) with each adjacent pair (x2i, x2i+1) rotated by the angles of cos/sin (B, 1, T, d/2)."""
    real = torch.promote_types(x.dtype, torch.float32)
    even, odd = x.to(real).unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos.to(real), sin.to(real)
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).to(x.dtype)


class ScratchLMAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.d_model, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.d_model, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.d_model, kv_size, bias=config.qkv_bias)
        self.output_proj = nn.Linear(q_size, config.d_model, bias=False)
        if config.qk_norm:
            self.q_norm = ScratchLMRMSNorm(self.head_dim, config.norm_eps)
            self.k_norm = ScratchLMRMSNorm(self.head_dim, config.norm_eps)
        self.qk_norm = config.qk_norm

    def forward(self, x, rope, mask, cache):
        """x (B, T, d_model); rope (cos, sin) or None; mask bool (B or 1, 1, T, T_k), True = may attend."""
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)  # (B, H, T, d)
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)).transpose(1, 2)  # (B, H_kv, T, d)
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = rotate_pairs(q, *rope), rotate_pairs(k, *rope)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # (B, H_kv, T_k, d): the cached keys, then these
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, T_k, d)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, H, T, T_k)
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        # A query that may attend no key (left padding) gets zeros, not the NaN of an all -inf softmax.
        weights = weights.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
        return self.output_proj((weights @ v).transpose(1, 2).flatten(-2))  # (B, T, d_model)


class ScratchLMFeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.kind = config.ffn
        if self.kind not in ("swiglu", "silu", "relu2"):
            raise ValueError(f"config.json: ffn must be swiglu, silu or relu2, got {self.kind!r}")
        self.w1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.w2 = nn.Linear(config.d_ff, config.d_model, bias=False)
        if self.kind == "swiglu":
            self.w3 = nn.Linear(config.d_model, config.d_ff, bias=False)

    def forward(self, x):
        hidden = self.w1(x)
        if self.kind == "relu2":
            return self.w2(hidden.clamp_min(0).square())
        hidden = hidden * torch.sigmoid(hidden)  # SiLU
        return self.w2(hidden * self.w3(x) if self.kind == "swiglu" else hidden)


class ScratchLMBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        if config.norm_position not in ("pre", "post"):
            raise ValueError(f"config.json: norm_position must be pre or post, got {config.norm_position!r}")
        self.pre_norm = config.norm_position == "pre"
        self.ln1 = make_norm(config, config.d_model)
        self.attn = ScratchLMAttention(config, layer_idx)
        self.ln2 = make_norm(config, config.d_model)
        self.ffn = ScratchLMFeedForward(config)

    def forward(self, x, rope, mask, cache):
        if self.pre_norm:
            x = x + self.attn(self.ln1(x), rope, mask, cache)
            return x + self.ffn(self.ln2(x))
        x = self.ln1(x + self.attn(x, rope, mask, cache))
        return self.ln2(x + self.ffn(x))


class ScratchLMPreTrainedModel(PreTrainedModel):
    config_class = ScratchLMConfig
    base_model_prefix = "scratchlm"  # no submodule of that name: the weights' names are used as they are
    _no_split_modules = ["ScratchLMBlock"]  # device_map="auto" keeps a block on one device


class ScratchLMForCausalLM(ScratchLMPreTrainedModel, GenerationMixin):
    """Token ids (B, T) -> next-token logits (B, T, vocab_size), with scratchlm's parameter names."""

    def __init__(self, config):
        super().__init__(config)
        if config.position not in ("rope", "nope"):
            raise ValueError(f"config.json: position must be rope or nope, got {config.position!r}")
        self.token_embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(ScratchLMBlock(config, index) for index in range(config.num_layers))
        self.ln_final = make_norm(config, config.d_model)
        if not config.tie_embeddings:  # tied: the head is the embedding matrix (one tensor in the weights file)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.token_embeddings

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        """attention_mask (B, T_k) of 1 = real token, 0 = padding, over the cached and the new tokens;
        logits_to_keep > 0: only the last that many positions' logits (generate asks for 1 after a prefill)."""
        cache = kwargs.get("cache", past_key_values)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        x = self.token_embeddings(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, d_model)
        batch, length = x.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        total = past + length
        if attention_mask is not None and tuple(attention_mask.shape) != (batch, total):
            raise ValueError(f"attention_mask must be (batch, cached + new tokens) = ({batch}, {total}), "
                             f"got {tuple(attention_mask.shape)}")
        if position_ids is None:
            if attention_mask is None:
                position_ids = torch.arange(past, total, device=x.device)[None]  # (1, T)
            else:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, past:]  # (B, T)
        rope = None
        if self.config.position == "rope":
            angles = position_ids[:, None, :, None].float() * rope_inverse_frequencies(self.config, x.device)
            rope = angles.cos(), angles.sin()  # (B or 1, 1, T, head_dim/2)
        mask = torch.ones(length, total, dtype=torch.bool, device=x.device).tril(diagonal=past)[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask.bool()[:, None, None, :]  # (B, 1, T, T_k)
        for layer in self.layers:
            x = layer(x, rope, mask, cache if use_cache else None)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        head = self.token_embeddings.weight if self.config.tie_embeddings else self.lm_head.weight
        logits = self.ln_final(x) @ head.t()  # (B, T, vocab_size)
        cap = self.config.logit_softcap
        if cap:
            logits = cap * torch.tanh(logits / cap)
        loss = None
        if labels is not None:  # next-token cross-entropy, -100 = ignored (transformers' convention)
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                               ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache if use_cache else None})
