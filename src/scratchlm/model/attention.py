"""Causal multi-head self-attention with rotary position embeddings, from tensor primitives.

- `scaled_dot_product_attention(Q, K, V, mask)`: softmax(Q Kᵀ / √d_k) V over arbitrary leading dims. `mask` is
  bool, True = may attend, broadcastable to (..., T_q, T_k). A query row whose keys are ALL masked returns
  zeros (not NaN): that happens for left-padding positions in a batch, whose outputs are never used, and NaNs
  there would still poison the backward pass and reductions.
- `RotaryPositionalEmbedding`: rotates ADJACENT pairs (x₂ᵢ, x₂ᵢ₊₁) by angle pos · θ^(-2i/d_k), as the CS336
  reference does (Hugging Face's Llama rotates (xᵢ, xᵢ₊d/2) instead; compat/hf.py permutes Q/K rows to map).
  the e^(i·angle) table is precomputed once as a non-persistent buffer (never saved in checkpoints).
- `MultiHeadSelfAttention`: q/k/v/output projections as separate `Linear`s (the reference state-dict names)
  projected separately; a cached lower-triangular bool mask; an optional KV cache for decoding.
  `use_fused_sdpa = True` switches the attention core to torch's built-in SDPA kernel: the ONE sanctioned use of
  torch.nn.functional in model code, off by default, tested against ours; the trainer may turn it on for speed.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from scratchlm.model.kv_cache import KVCache
from scratchlm.model.layers import Linear, RMSNorm, softmax_backward

# On CPU the attention core works on this many score elements at a time (2 MiB in fp32): few enough to stay in a
# core's L2 cache from the matmul that writes them, through the softmax, to the matmul that reads them.
_CHUNK_ELEMENTS = 1 << 19


def scaled_dot_product_attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """Q (..., T_q, d_k), K (..., T_k, d_k), V (..., T_k, d_v), mask bool (..., T_q, T_k) -> (..., T_q, d_v)."""
    *batch, T_q, d_k = Q.shape
    T_k = K.shape[-2]
    b = math.prod(batch)
    q, k, v = Q.reshape(b, T_q, d_k), K.reshape(b, T_k, d_k), V.reshape(b, T_k, V.shape[-1])
    bias = _additive_mask(mask, batch, T_q, T_k, q)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = _ChunkedAttention.apply(q, k, v, bias)
    else:  # inference (e.g. each decoding step): the same chunks without autograd's bookkeeping
        out = _concat(_attend_chunks(q, k, v, bias, _chunk_rows(q, k))[1])
    return out.reshape(*batch, T_q, v.shape[-1])


def _additive_mask(mask: torch.Tensor | None, batch: list[int], T_q: int, T_k: int,
                   like: torch.Tensor) -> torch.Tensor | None:
    """0 where a query may attend, -inf where not, as (b, T_q, T_k) (a broadcast view when the mask allows);
    None without a mask."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        raise ValueError(f"attention mask must be a bool tensor (True = may attend), got dtype {mask.dtype}")
    bias = torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill_(~mask, float("-inf"))
    return bias.expand(*batch, T_q, T_k).reshape(math.prod(batch), T_q, T_k)


class _ChunkedAttention(torch.autograd.Function):
    """softmax(q kᵀ/√d_k + bias) v for q (b, T_q, d_k), k (b, T_k, d_k), v (b, T_k, d_v), bias (b, T_q, T_k) or None.

    It walks the b (batch x head) slices a few at a time, so each chunk's scores stay in cache from the matmul
    through the in-place softmax to the matmul with v: one trip to memory instead of one per pass over the whole
    (b, T_q, T_k) tensor (~1.6x faster than unchunked on CPU). One baddbmm computes bias + q kᵀ/√d_k (without
    a mask, a bmm scaled in place). The backward walks the same chunks with the kept probabilities p:
        dv = pᵀ do,  ds = p ⊙ (dp - Σ p ⊙ dp) / √d_k  (softmax's backward) with dp = do vᵀ,  dq = ds k,  dk = dsᵀ q.
    ds is already 0 wherever p is, so masked keys need no masked-fill backward. A fully masked row gives zeros,
    not NaN (``_softmax_rows_``).
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        step = _chunk_rows(q, k)
        probs, outputs = _attend_chunks(q, k, v, bias, step)
        ctx.save_for_backward(q, k, v, *probs)
        ctx.step = step
        return _concat(outputs)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, *probs = ctx.saved_tensors
        grad_q, grad_k, grad_v = [], [], []
        for index, p in enumerate(probs):
            rows = slice(index * ctx.step, (index + 1) * ctx.step)
            grad_v.append(torch.bmm(p.transpose(1, 2), grad_out[rows]))
            ds = softmax_backward(p, torch.bmm(grad_out[rows], v[rows].transpose(1, 2)), -1).mul_(_scale(q))
            grad_q.append(torch.bmm(ds, k[rows]))
            grad_k.append(torch.bmm(ds.transpose(1, 2), q[rows]))
        return _concat(grad_q), _concat(grad_k), _concat(grad_v), None


def _chunk_rows(q: torch.Tensor, k: torch.Tensor) -> int:
    """How many of the b slices one chunk holds: _CHUNK_ELEMENTS scores on CPU; all of them elsewhere
    (accelerators are not bound by cache misses here but by kernel launches)."""
    if q.device.type != "cpu":
        return q.shape[0]
    return max(1, _CHUNK_ELEMENTS // max(1, q.shape[1] * k.shape[1]))


def _attend_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                   step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(probabilities, outputs) of each chunk of `step` slices: softmax(q kᵀ/√d_k + bias) and its product with v."""
    probs, outputs = [], []
    for start in range(0, max(q.shape[0], 1), step):  # at least one chunk: an empty batch keeps its shapes
        rows = slice(start, start + step)
        keys_t = k[rows].transpose(1, 2)
        if bias is None:  # nothing masked (e.g. a decoding step): no fully masked row to guard either
            p = _softmax_rows_(torch.bmm(q[rows], keys_t).mul_(_scale(q)), masked=False)  # (step, T_q, T_k)
        else:
            p = _softmax_rows_(torch.baddbmm(bias[rows], q[rows], keys_t, alpha=_scale(q)), masked=True)
        probs.append(p)
        outputs.append(torch.bmm(p, v[rows]))
    return probs, outputs


def _softmax_rows_(scores: torch.Tensor, masked: bool) -> torch.Tensor:
    """Softmax over the last dim, in place. A fully masked row (masked=True) gives zeros, not NaN: its max is
    clamped to a finite value (exp gives 0, not exp(-inf + inf)) and its sum of 0 away from 0. No keys at all
    (an empty sequence) leaves the empty scores as they are: amax of an empty dim raises."""
    if not scores.shape[-1]:
        return scores
    row_max = scores.amax(dim=-1, keepdim=True)
    if masked:
        row_max.clamp_(min=torch.finfo(scores.dtype).min)
    p = scores.sub_(row_max).exp_()
    total = p.sum(dim=-1, keepdim=True)
    if masked:
        total.clamp_(min=torch.finfo(p.dtype).tiny)
    return p.div_(total)


def _scale(q: torch.Tensor) -> float:
    """1/√d_k, the score scale."""
    return 1.0 / math.sqrt(q.shape[-1])


def _concat(chunks: list[torch.Tensor]) -> torch.Tensor:
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


class RotaryPositionalEmbedding(nn.Module):
    """RoPE on adjacent pairs. forward(x (..., T, d_k), token_positions (..., T) long) -> same shape as x."""

    def __init__(self, theta: float, d_k: int, max_seq_len: int, device=None) -> None:
        super().__init__()
        if d_k % 2:
            raise ValueError(f"RoPE needs an even d_k, got {d_k}")
        self.theta, self.d_k, self.max_seq_len = theta, d_k, max_seq_len
        inv_freq = 1.0 / theta ** (torch.arange(0, d_k, 2, device=device, dtype=torch.int64).float() / d_k)
        angles = torch.arange(max_seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq  # (S, d_k/2)
        # Each adjacent pair (x₂ᵢ, x₂ᵢ₊₁) is the complex number x₂ᵢ + i·x₂ᵢ₊₁; rotating it by the angle is one complex
        # multiply by e^(i·angle): a single fused op instead of the four of x ⊙ cos + swap_pairs(x) ⊙ sin.
        self.register_buffer("rotations", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
        """token_positions None means positions start, start+1, ...: a table slice instead of a gather."""
        if token_positions is None:
            rotations = self.rotations[start:start + x.shape[-2]]  # (T, d_k/2) complex
        else:
            rotations = self.rotations[token_positions]  # (..., T, d_k/2) complex
        # Complex arithmetic needs float32/64 pairs (bf16/fp16 have no complex type): upcast, rotate, cast back.
        real = torch.float64 if x.dtype == torch.float64 else torch.float32
        pairs = torch.view_as_complex(x.to(real).unflatten(-1, (-1, 2)).contiguous())  # (..., T, d_k/2)
        return torch.view_as_real(pairs * rotations.to(pairs.dtype)).flatten(-2).to(x.dtype)

    def _apply(self, fn, recurse: bool = True):
        """``Module.to(torch.bfloat16)`` would cast the complex table to that *real* dtype, dropping the imaginary
        parts: the table follows the module's device, but stays complex."""
        table = self._buffers.pop("rotations")
        super()._apply(fn, recurse)
        device = fn(torch.zeros(0, device=table.device)).device
        self.register_buffer("rotations", table.to(device), persistent=False)
        return self

    def extra_repr(self) -> str:
        return f"theta={self.theta}, d_k={self.d_k}, max_seq_len={self.max_seq_len}"


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
        causal = None
        if max_seq_len is not None:
            causal = torch.ones(max_seq_len, max_seq_len, dtype=torch.bool, device=device).tril()
        self.register_buffer("causal_mask", causal, persistent=False)
        self.use_fused_sdpa = False

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, layer_index: int = 0,
                key_padding: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, d_model) -> (B, T, d_model).

        token_positions (T,) or (B, T): RoPE positions (default: past length + arange(T)).
        kv_cache: keys/values of earlier calls; this call appends its own (the model advances the length).
        key_padding (B, T_k) bool, True = real token: keys that are padding are never attended.
        """
        T = x.shape[-2]
        past = kv_cache.length if kv_cache is not None else 0
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
        mask = self._mask(T, past, key_padding, x.device)
        if self.use_fused_sdpa:
            out = self._fused_sdpa(q, k, v, mask, is_causal=key_padding is None and past == 0)
        else:
            out = scaled_dot_product_attention(q, k, v, mask)  # (B, H, T, d_k)
        return self.output_proj(out.transpose(-3, -2).flatten(-2))  # (B, T, d_model)

    def _heads(self, projected: torch.Tensor) -> torch.Tensor:
        """(B, T, d_model) -> (B, H, T, d_k), a view. Q, K and V are three projections: one matmul against the
        concatenated weights is no faster on large inputs, copies 3·d² weights per call (most of the work when
        decoding one token), keeps that copy alive for backward, and its split costs a copy in backward."""
        return projected.unflatten(-1, (self.num_heads, self.head_dim)).transpose(-3, -2)

    def _mask(self, T: int, past: int, key_padding: torch.Tensor | None, device) -> torch.Tensor | None:
        """Bool (T, past+T) causal mask, combined with key padding to (B, 1, T, past+T) when given; None when
        nothing is masked (one query, no padding)."""
        total = past + T
        if self.causal_mask is not None:
            if total > self.causal_mask.shape[0]:
                raise ValueError(f"sequence length {total} exceeds max_seq_len {self.causal_mask.shape[0]}")
            causal = self.causal_mask[past:total, :total]
        else:
            causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()[past:]
        if key_padding is None:
            return None if T == 1 else causal  # one new query may attend to every key so far
        return causal & key_padding[:, None, None, :total]

    @staticmethod
    def _fused_sdpa(q, k, v, mask, is_causal: bool) -> torch.Tensor:
        # The sanctioned exception to "no torch.nn.functional": opt-in speed path, tested against ours.
        from torch.nn.functional import scaled_dot_product_attention as torch_sdpa

        if is_causal or mask is None:
            return torch_sdpa(q, k, v, is_causal=is_causal)
        out = torch_sdpa(q, k, v, attn_mask=mask)
        return out.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)  # same fully-masked-row rule as ours
