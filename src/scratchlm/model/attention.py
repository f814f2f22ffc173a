"""Causal multi-head self-attention with rotary position embeddings, in the order of the CS336 handout.

- `RotaryPositionalEmbedding` rotates each ADJACENT pair (x₂ᵢ, x₂ᵢ₊₁) by pos · θ^(-2i/d_k), as the CS336
  reference does (Hugging Face's Llama rotates (xᵢ, xᵢ₊d/2); compat/hf.py permutes Q/K rows to map).
  `Llama3Scaling` optionally rescales the frequencies first (Llama 3.1's long-context rule).
- `scaled_dot_product_attention`: softmax(Q Kᵀ / √d_k) V; a query whose keys are ALL masked (left padding)
  returns zeros, not NaN, which would poison the backward pass.
- `causal_attention`: each query sees itself, earlier and cached keys, never padding, and with `documents`
  only its own packed document's keys (each document computed exactly as alone).
- `MultiHeadSelfAttention`: separate q/k/v/output `Linear`s (the reference names), optional biases and
  QK-norm, RoPE, KV cache. With grouped-query attention (num_kv_heads < num_heads) each KV head serves
  num_heads / num_kv_heads consecutive query heads; the cache holds only the KV heads.

This is the readable path that runs by default; model/kernels/ swaps in faster equivalents through
`MultiHeadSelfAttention.attention_core` and `RotaryPositionalEmbedding.rotate` (tests/test_kernels.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from scratchlm.model.config import ModelConfig
from scratchlm.model.kv_cache import KVCache
from scratchlm.model.layers import Linear, RMSNorm, softmax


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., T, d_k) with each pair (x₂ᵢ, x₂ᵢ₊₁) rotated by the angle whose cos/sin are (..., T, d_k/2):
    (x₂ᵢ cos - x₂ᵢ₊₁ sin, x₂ᵢ sin + x₂ᵢ₊₁ cos)."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)  # x₂ᵢ and x₂ᵢ₊₁: (..., T, d_k/2) each
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's RoPE frequency scaling (transformers' `_compute_llama3_parameters`), for a model trained at
    `original_context` tokens and extended to longer contexts. Each frequency's wavelength 2π/ω decides:
    - wavelengths above original_context / low_freq_factor (slow rotations, which never completed a turn
      within the original context) rotate `factor` times slower: ω / factor;
    - wavelengths below original_context / high_freq_factor (fast rotations, already seen at every angle) are
      kept: ω;
    - in between, a smooth interpolation: (1 - s) · ω / factor + s · ω, with s = (original_context / wavelength
      - low_freq_factor) / (high_freq_factor - low_freq_factor) going from 0 to 1 over that band.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context: int

    @classmethod
    def of(cls, config: ModelConfig) -> Llama3Scaling | None:
        """The scaling `config` asks for (rope_scaling = llama3), or None."""
        if config.rope_scaling == "none":
            return None
        return cls(config.rope_scaling_factor, config.rope_low_freq_factor, config.rope_high_freq_factor,
                   config.rope_original_context)

    def __call__(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies ω (d_k/2,)."""
        wavelength = 2 * math.pi / inv_freq
        smooth = (self.original_context / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smooth = smooth.clamp(0.0, 1.0)  # 0: long wavelengths (ω / factor), 1: short ones (ω kept)
        return (1 - smooth) * inv_freq / self.factor + smooth * inv_freq


class RotaryPositionalEmbedding(nn.Module):
    """RoPE on adjacent pairs. forward(x (..., T, d_k), token_positions (..., T) long) -> same shape as x.
    `scaling` (e.g. `Llama3Scaling`) maps the inverse frequencies θ^(-2i/d_k) before the tables are built."""

    def __init__(self, theta: float, d_k: int, max_seq_len: int, device=None,
                 scaling: Llama3Scaling | None = None) -> None:
        super().__init__()
        if d_k % 2:
            raise ValueError(f"RoPE needs an even d_k, got {d_k}")
        self.theta, self.d_k, self.max_seq_len, self.scaling = theta, d_k, max_seq_len, scaling
        inv_freq = 1.0 / theta ** (torch.arange(0, d_k, 2, device=device, dtype=torch.int64).float() / d_k)
        if scaling is not None:
            inv_freq = scaling(inv_freq)
        angles = torch.arange(max_seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq  # (S, d_k/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.rotate = rotate_pairs  # model/kernels/ may swap in a faster rotation with the same contract

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
        """token_positions None means positions start, start+1, ...: a table slice instead of a gather."""
        return self.rotated(x, *self.angles(token_positions, start, x.shape[-2]))

    def angles(self, token_positions: torch.Tensor | None, start: int = 0,
               length: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the positions' angles, (..., T, d_k/2): token_positions (..., T), or with None the `length`
        positions from `start` (a table slice instead of a gather)."""
        if token_positions is None:
            return self.cos[start:start + length], self.sin[start:start + length]  # (T, d_k/2)
        return self.cos[token_positions], self.sin[token_positions]  # (..., T, d_k/2)

    def rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (..., T, d_k) with each pair rotated by its angle (cos/sin broadcast to (..., T, d_k/2))."""
        # Rotate in (at least) float32 and cast back: a bf16 x keeps its precision through the rotation. (After
        # `model.to(torch.bfloat16)` the tables hold bf16-rounded cos/sin, as Hugging Face's Llama multiplies by.)
        real = torch.promote_types(x.dtype, torch.float32)
        return self.rotate(x.to(real), cos.to(real), sin.to(real)).to(x.dtype)

    def extra_repr(self) -> str:
        scaling = "" if self.scaling is None else f", scaling={self.scaling}"
        return f"theta={self.theta}, d_k={self.d_k}, max_seq_len={self.max_seq_len}{scaling}"


def check_attention_mask(mask: torch.Tensor | None) -> None:
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"attention mask must be a bool tensor (True = may attend), got dtype {mask.dtype}")


def scaled_dot_product_attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """Q (..., T_q, d_k), K (..., T_k, d_k), V (..., T_k, d_v), mask bool (..., T_q, T_k) -> (..., T_q, d_v)."""
    check_attention_mask(mask)
    # The scale and the mask edit the scores in place (neither's backward needs them), so a (T_q, T_k) tensor of
    # scores exists once beside the softmax's, as in Hugging Face's eager attention, not two or three times.
    scores = (Q @ K.transpose(-2, -1)).div_(math.sqrt(Q.shape[-1]))  # (..., T_q, T_k)
    if mask is None:
        return softmax(scores, dim=-1) @ V
    # A query whose keys are ALL masked attends to nothing: its output is 0. Its scores would be all -inf, and
    # softmax NaN there (0/0), so such a row attends every key instead (finite weights, finite gradients) and its
    # output is zeroed. Zeroing the (T_q, d_v) output, not the weights, keeps one (T_q, T_k) tensor for backward
    # (the softmax output, which the product with V also keeps), not two.
    empty = ~mask.any(dim=-1, keepdim=True)  # (..., T_q, 1): the queries with no key to attend
    weights = softmax(scores.masked_fill_(~(mask | empty), float("-inf")), dim=-1)  # exp(-inf) = 0: masked keys
    return (weights @ V).masked_fill(empty, 0.0)  # get no weight


def causal_mask(T_q: int, T_k: int, key_padding: torch.Tensor | None, device,
                documents: torch.Tensor | None = None) -> torch.Tensor | None:
    """Which keys the last T_q of T_k positions may attend: keys at or before their own position, and (with
    key_padding (B, >= T_k), True = real token; a KV cache's is as long as the cache) no padding, and (with
    documents (B, T_k), ids of the packed document each position belongs to) only keys of the query's own
    document. Bool (T_q, T_k), or (B, 1, T_q, T_k) with padding or documents (the 1 broadcasts over heads); None
    when nothing is masked (a single query sees every key before it)."""
    if T_q == 1 and documents is None:  # a single query, the last position, sees every key before it
        return None if key_padding is None else key_padding[:, None, None, :T_k]
    mask = torch.ones(T_q, T_k, dtype=torch.bool, device=device).tril(diagonal=T_k - T_q)
    if documents is not None:  # a block-diagonal causal mask: query i and key j of the same document
        mask = mask & (documents[:, None, T_k - T_q:, None] == documents[:, None, None, :T_k])  # (B, 1, T_q, T_k)
    return mask if key_padding is None else mask & key_padding[:, None, None, :T_k]


def repeat_kv_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """(B, H_kv, T, d) -> (B, H_kv·group, T, d): KV head j repeated for query heads j·group ... (j+1)·group - 1
    (Hugging Face's `repeat_kv` order). group 1 (multi-head attention) returns x itself, no copy."""
    return x if group == 1 else x.repeat_interleave(group, dim=-3)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding: torch.Tensor | None = None,
                     documents: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H, T_q, d_k) are the last T_q of the T_k positions of k, v (B, H_kv, T_k, d), H_kv dividing H (each
    KV head serves a group of H / H_kv consecutive query heads): -> (B, H, T_q, d_v). key_padding (B, >= T_k)
    bool, True = real token; documents (B, T_k) int, the packed document of each position (causal_mask)."""
    group = q.shape[-3] // k.shape[-3]
    k, v = repeat_kv_heads(k, group), repeat_kv_heads(v, group)  # (B, H, T_k, d): each KV head per group
    mask = causal_mask(q.shape[-2], k.shape[-2], key_padding, q.device, documents)
    return scaled_dot_product_attention(q, k, v, mask)


class MultiHeadSelfAttention(nn.Module):
    """Causal MHSA, or grouped-query attention with num_kv_heads < num_heads, as `config` (a ModelConfig) shapes
    it: d_model, num_heads, num_kv_heads, head_dim, qkv_bias, qk_norm (with norm_eps), and the position encoding
    (position = rope | nope; rope_theta and rope_scaling; a table of context_length positions)."""

    def __init__(self, config: ModelConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.d_model, self.num_heads, self.num_kv_heads = config.d_model, config.num_heads, config.num_kv_heads
        self.head_dim, self.max_seq_len = config.head_dim, config.context_length
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.qkv_bias
        self.q_proj = Linear(self.d_model, q_size, bias=bias, device=device, dtype=dtype)
        self.k_proj = Linear(self.d_model, kv_size, bias=bias, device=device, dtype=dtype)
        self.v_proj = Linear(self.d_model, kv_size, bias=bias, device=device, dtype=dtype)
        self.output_proj = Linear(q_size, self.d_model, device=device, dtype=dtype)
        self.rope = None
        if config.position == "rope":
            self.rope = RotaryPositionalEmbedding(config.rope_theta, self.head_dim, self.max_seq_len, device,
                                                  scaling=Llama3Scaling.of(config))
        # QK-norm: each head's q and k scaled to unit RMS (times a learned gain) before RoPE, so a score q·k/√d_k
        # cannot grow with the weights' scale: attention logits stay bounded and high learning rates stay stable.
        eps = config.norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, device=device, dtype=dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, device=device, dtype=dtype) if config.qk_norm else None
        self.attention_core = causal_attention  # model/kernels/ may swap in a faster core with the same contract

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, layer_index: int = 0,
                key_padding: torch.Tensor | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, d_model) -> (B, T, d_model).

        token_positions (T,) or (B, T): RoPE positions (default: past length + arange(T)).
        kv_cache: keys/values of earlier calls; this call appends its own (the model advances the length).
        key_padding (B, T_k) bool, True = real token: keys that are padding are never attended.
        documents (B, T) int: each query attends only keys of its own document (packed sequences, no cache).
        """
        past = kv_cache.length if kv_cache is not None else 0
        if past + x.shape[-2] > self.max_seq_len:
            raise ValueError(f"sequence length {past + x.shape[-2]} exceeds max_seq_len {self.max_seq_len}")
        q = self._heads(self.q_proj(x), self.num_heads)  # (B, H, T, d_k)
        k = self._heads(self.k_proj(x), self.num_kv_heads)  # (B, H_kv, T, d_k)
        v = self._heads(self.v_proj(x), self.num_kv_heads)  # (B, H_kv, T, d_k)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            positions = token_positions
            if positions is not None and positions.dim() > 1:
                positions = positions.unsqueeze(-2)  # (B, 1, T): broadcast over heads
            q, k = self.rope(q, positions, start=past), self.rope(k, positions, start=past)
        if kv_cache is not None:
            k, v = kv_cache.update(layer_index, k, v)  # (B, H_kv, past + T, d_k): the cache holds the KV heads only
        if documents is None:  # the contract's short form: a decoding core need not know of documents
            out = self.attention_core(q, k, v, key_padding)  # (B, H, T, d_k)
        else:
            out = self.attention_core(q, k, v, key_padding, documents)
        return self.output_proj(out.transpose(-3, -2).flatten(-2))  # (B, T, H·d_k) -> (B, T, d_model)

    def _heads(self, projected: torch.Tensor, heads: int) -> torch.Tensor:
        """(B, T, heads·d_k) -> (B, heads, T, d_k), a view. Q, K and V stay three projections: a matmul against
        concatenated weights would copy them every call and keep the copy alive for backward (the decoding step,
        kernels/decode_step.py, concatenates them once)."""
        return projected.unflatten(-1, (heads, self.head_dim)).transpose(-3, -2)
