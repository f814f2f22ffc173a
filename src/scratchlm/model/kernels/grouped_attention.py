"""The causal attention core of decoding: a KV head's query heads as one block of rows, in at least float32.

Wins on: CPUs, for decoding steps and prefills (a few new queries against a KV cache), where the readable core
spends its time in small ops around two thin products:
- no repeated K and V: the query heads sharing a KV head, and their new tokens, are the rows of one product
  against that head's keys (with one new token and no padding, the grouping is a view);
- in at least float32: without bf16 instructions, batched bf16 products are emulated and slower than upcasting
  the step's keys and values; the sums are float32 either way, within the readable core's tolerance;
- torch's softmax, one op for the readable one's five.
Installed by `kernels.decoding` on CPU, and the fused step's core (decode_step.py).
"""

from __future__ import annotations

import math

import torch

from scratchlm.model.attention import causal_mask


def grouped_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             key_padding: torch.Tensor | None = None) -> torch.Tensor:
    """`attention.causal_attention`: q (B, H, T_q, d_k), k and v (B, H_kv, T_k, d), key_padding (B, >= T_k) ->
    (B, H, T_q, d), a query whose keys are all masked giving zeros."""
    batch, heads, new, head_dim = q.shape
    kv_heads, length = k.shape[-3], k.shape[-2]
    group = heads // kv_heads
    real = torch.promote_types(q.dtype, torch.float32)
    rows = q.to(real).reshape(batch, kv_heads, group * new, head_dim)  # a KV head's query heads, then their tokens
    scores = (rows @ k.to(real).transpose(-2, -1)).view(batch, kv_heads, group, new, length) / math.sqrt(head_dim)
    mask = causal_mask(new, length, key_padding, q.device)  # (T_q, T_k), (B, 1, T_q, T_k) or None
    if mask is None:
        weights = torch.softmax(scores, dim=-1)
    else:  # as the readable core: a query with no key to attend attends every key, and its output is zeroed
        mask = mask.unsqueeze(-3)  # over the group: (..., 1, T_q, T_k)
        empty = ~mask.any(dim=-1, keepdim=True)
        weights = torch.softmax(scores.masked_fill(~(mask | empty), float("-inf")), dim=-1)
    out = weights.view(batch, kv_heads, group * new, length) @ v.to(real)  # (B, H_kv, group·T_q, d)
    if mask is not None:
        out = out.view(batch, kv_heads, group, new, head_dim).masked_fill(empty, 0.0)
    return out.reshape(batch, heads, new, head_dim).to(q.dtype)
