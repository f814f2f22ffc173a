"""The causal attention core through torch's fused SDPA kernel (FlashAttention and its kin).

Wins on: CUDA GPUs, where one fused kernel that never writes the (T_q, T_k) scores to memory beats a chain of
matmul and softmax kernels in time and memory; `is_causal` lets it skip the masked half of the work. On a CPU it
is faster alone than the cache-blocked core (chunked_attention.py), but a whole training step ties
(docs/benchmarks.md, bench_kernels), so it is opt-in there (`train.fused_attention`). This file is the one
sanctioned use of torch.nn.functional in model code: a speed path switched on from outside, tested equal to the
readable core (tests/test_kernels.py).
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention as torch_sdpa

from scratchlm.model.attention import causal_mask, repeat_kv_heads


def fused_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           key_padding: torch.Tensor | None = None,
                           documents: torch.Tensor | None = None) -> torch.Tensor:
    """`attention.causal_attention` through torch's SDPA (K and V repeated over their groups of query heads first)."""
    group = q.shape[-3] // k.shape[-3]
    k, v = repeat_kv_heads(k, group), repeat_kv_heads(v, group)
    T_q, T_k = q.shape[-2], k.shape[-2]
    if key_padding is None and documents is None and T_q == T_k:  # the plain causal mask, known to the kernel
        return torch_sdpa(q, k, v, is_causal=True)
    mask = causal_mask(T_q, T_k, key_padding, q.device, documents)
    if mask is None:
        return torch_sdpa(q, k, v)
    # For a query whose keys are all masked, some torch versions and backends give NaN (and NaN gradients to every
    # q, k, v through it) where the readable core gives 0: such a row attends to every key instead, then is zeroed.
    attends = mask.any(dim=-1, keepdim=True)  # (..., T_q, 1)
    return torch_sdpa(q, k, v, attn_mask=mask | ~attends).masked_fill(~attends, 0.0)
