"""Causal multi-head self-attention with rotary position embeddings, in the order of the CS336 handout.

- `RotaryPositionalEmbedding` (RoPE): rotates each ADJACENT pair (x₂ᵢ, x₂ᵢ₊₁) of a query or key by the angle
  pos · θ^(-2i/d_k), as the CS336 reference does (Hugging Face's Llama rotates (xᵢ, xᵢ₊d/2) instead; compat/hf.py
  permutes Q/K rows to map). The cos/sin tables are precomputed once, as non-persistent buffers (never saved).
- `scaled_dot_product_attention(Q, K, V, mask)`: softmax(Q Kᵀ / √d_k) V over any leading dims. `mask` is bool,
  True = may attend. A query whose keys are ALL masked returns zeros, not NaN: that happens at left-padding
  positions of a batch, whose outputs are never used, but NaNs there would still poison the backward pass.
- `causal_attention(q, k, v, key_padding)`: the attention of a decoder, built on it: each query sees itself and
  the keys before it (and, with a KV cache, every cached key), never a padding key.
- `MultiHeadSelfAttention`: q/k/v/output projections as separate `Linear`s (the reference state-dict names),
  optional QK-norm, RoPE, an optional KV cache for decoding.

This file is the readable reference and what runs by default. Faster implementations of the same contracts
live in model/kernels/ (a cache-blocked attention core, torch's fused SDPA, RoPE as one complex multiply); the
trainer and the generator switch them on from outside by setting `MultiHeadSelfAttention.attention_core` and
`RotaryPositionalEmbedding.rotate` (`kernels.apply`), and tests/test_kernels.py proves them equal to this.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from scratchlm.model.kv_cache import KVCache
from scratchlm.model.layers import Linear, RMSNorm, softmax


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., T, d_k) with each pair (x₂ᵢ, x₂ᵢ₊₁) rotated by the angle whose cos/sin are (..., T, d_k/2):
    (x₂ᵢ cos - x₂ᵢ₊₁ sin, x₂ᵢ sin + x₂ᵢ₊₁ cos)."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)  # x₂ᵢ and x₂ᵢ₊₁: (..., T, d_k/2) each
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class RotaryPositionalEmbedding(nn.Module):
    """RoPE on adjacent pairs. forward(x (..., T, d_k), token_positions (..., T) long) -> same shape as x."""

    def __init__(self, theta: float, d_k: int, max_seq_len: int, device=None) -> None:
        super().__init__()
        if d_k % 2:
            raise ValueError(f"RoPE needs an even d_k, got {d_k}")
        self.theta, self.d_k, self.max_seq_len = theta, d_k, max_seq_len
        inv_freq = 1.0 / theta ** (torch.arange(0, d_k, 2, device=device, dtype=torch.int64).float() / d_k)
        angles = torch.arange(max_seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq  # (S, d_k/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.rotate = rotate_pairs  # model/kernels/ may swap in a faster rotation with the same contract

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
        """token_positions None means positions start, start+1, ...: a table slice instead of a gather."""
        if token_positions is None:
            cos, sin = self.cos[start:start + x.shape[-2]], self.sin[start:start + x.shape[-2]]  # (T, d_k/2)
        else:
            cos, sin = self.cos[token_positions], self.sin[token_positions]  # (..., T, d_k/2)
        # Rotate in (at least) float32 and cast back: a bf16 x keeps its precision through the rotation. (After
        # `model.to(torch.bfloat16)` the tables hold bf16-rounded cos/sin, as Hugging Face's Llama multiplies by.)
        real = torch.promote_types(x.dtype, torch.float32)
        return self.rotate(x.to(real), cos.to(real), sin.to(real)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"theta={self.theta}, d_k={self.d_k}, max_seq_len={self.max_seq_len}"


def check_attention_mask(mask: torch.Tensor | None) -> None:
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"attention mask must be a bool tensor (True = may attend), got dtype {mask.dtype}")


def scaled_dot_product_attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """Q (..., T_q, d_k), K (..., T_k, d_k), V (..., T_k, d_v), mask bool (..., T_q, T_k) -> (..., T_q, d_v)."""
    check_attention_mask(mask)
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])  # (..., T_q, T_k)
    if mask is None:
        return softmax(scores, dim=-1) @ V
    weights = softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # exp(-inf) = 0: masked keys get nothing
    # A row whose keys are all masked is all -inf, and softmax gives NaN there (0/0): it attends to nothing, so 0.
    # (The backward is finite too: masked_fill passes no gradient to the filled scores, NaN or not.)
    weights = weights.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
    return weights @ V


def causal_mask(T_q: int, T_k: int, key_padding: torch.Tensor | None, device) -> torch.Tensor | None:
    """Which keys the last T_q of T_k positions may attend: keys at or before their own position, and (with
    key_padding (B, >= T_k), True = real token; a KV cache's is as long as the cache) no padding. Bool (T_q, T_k),
    or (B, 1, T_q, T_k) with padding (the 1 broadcasts over heads); None when nothing is masked (a single query
    sees every key before it)."""
    if key_padding is None and T_q == 1:
        return None
    causal = torch.ones(T_q, T_k, dtype=torch.bool, device=device).tril(diagonal=T_k - T_q)
    return causal if key_padding is None else causal & key_padding[:, None, None, :T_k]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     key_padding: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H, T_q, d_k) are the last T_q of the T_k positions of k, v (B, H, T_k, d): -> (B, H, T_q, d_v).
    key_padding (B, >= T_k) bool, True = real token."""
    return scaled_dot_product_attention(q, k, v, causal_mask(q.shape[-2], k.shape[-2], key_padding, q.device))


class MultiHeadSelfAttention(nn.Module):
    """Causal MHSA. theta=None means no position encoding (the "nope" ablation)."""

    def __init__(self, d_model: int, num_heads: int, max_seq_len: int | None = None, theta: float | None = None,
                 qk_norm: bool = False, norm_eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        if theta is not None and max_seq_len is None:
            raise ValueError("RoPE (theta given) needs max_seq_len for its rotation table")
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        self.max_seq_len = max_seq_len
        self.q_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.output_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.rope = None if theta is None else RotaryPositionalEmbedding(theta, self.head_dim, max_seq_len, device)
        # QK-norm: each head's q and k scaled to unit RMS (times a learned gain) before RoPE, so a score q·k/√d_k
        # cannot grow with the weights' scale: attention logits stay bounded and high learning rates stay stable.
        self.q_norm = RMSNorm(self.head_dim, norm_eps, device=device, dtype=dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, norm_eps, device=device, dtype=dtype) if qk_norm else None
        self.attention_core = causal_attention  # model/kernels/ may swap in a faster core with the same contract

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, layer_index: int = 0,
                key_padding: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, d_model) -> (B, T, d_model).

        token_positions (T,) or (B, T): RoPE positions (default: past length + arange(T)).
        kv_cache: keys/values of earlier calls; this call appends its own (the model advances the length).
        key_padding (B, T_k) bool, True = real token: keys that are padding are never attended.
        """
        past = kv_cache.length if kv_cache is not None else 0
        if self.max_seq_len is not None and past + x.shape[-2] > self.max_seq_len:
            raise ValueError(f"sequence length {past + x.shape[-2]} exceeds max_seq_len {self.max_seq_len}")
        q, k, v = (self._heads(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))  # (B, H, T, d_k)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            positions = token_positions
            if positions is not None and positions.dim() > 1:
                positions = positions.unsqueeze(-2)  # (B, 1, T): broadcast over heads
            q, k = self.rope(q, positions, start=past), self.rope(k, positions, start=past)
        if kv_cache is not None:
            k, v = kv_cache.update(layer_index, k, v)  # (B, H, past + T, d_k)
        out = self.attention_core(q, k, v, key_padding)  # (B, H, T, d_k)
        return self.output_proj(out.transpose(-3, -2).flatten(-2))  # (B, T, d_model)

    def _heads(self, projected: torch.Tensor) -> torch.Tensor:
        """(B, T, d_model) -> (B, H, T, d_k), a view. Q, K and V are three projections: one matmul against the
        concatenated weights is no faster on large inputs, copies 3·d² weights per call (most of the work when
        decoding one token), keeps that copy alive for backward, and its split costs a copy in backward."""
        return projected.unflatten(-1, (self.num_heads, self.head_dim)).transpose(-3, -2)
