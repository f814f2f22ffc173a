"""The causal attention core in cache-sized chunks, with a hand-written backward: the CPU training path.

Wins on: CPUs, where the attention core is bound by memory traffic: the readable core streams the whole
(B·H, T_q, T_k) score tensor through memory once per op. This one walks the B·H slices a few at a time
(`CHUNK_ELEMENTS` scores, within a core's L2 cache), so each chunk's scores go from the matmul that writes them,
through an in-place softmax, to the matmul that reads them without a trip to memory; one `baddbmm` computes
mask bias + QKᵀ/√d_k. Elsewhere (GPU, MPS) one chunk holds every slice: kernel launches are the cost there.

The backward walks the same chunks with the kept probabilities p (the scores are never kept):
    dv = pᵀ do,  ds = p ⊙ (dp - Σ p ⊙ dp) / √d_k  (softmax's backward) with dp = do vᵀ,  dq = ds k,  dk = dsᵀ q.
ds is already 0 wherever p is, so masked keys need no masked-fill backward. A fully masked row gives zeros,
not NaN, as in the readable core (tests/test_kernels.py).
"""

from __future__ import annotations

import math

import torch

from scratchlm.model.attention import causal_mask, check_attention_mask, repeat_kv_heads
from scratchlm.model.layers import softmax_backward

CHUNK_ELEMENTS = 1 << 19  # scores per chunk on CPU: 2 MiB in float32, within a core's L2 cache


def chunked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             key_padding: torch.Tensor | None = None,
                             documents: torch.Tensor | None = None) -> torch.Tensor:
    """`attention.causal_attention`, in chunks (K and V repeated over their groups of query heads first)."""
    group = q.shape[-3] // k.shape[-3]
    k, v = repeat_kv_heads(k, group), repeat_kv_heads(v, group)
    return chunked_attention(q, k, v, causal_mask(q.shape[-2], k.shape[-2], key_padding, q.device, documents))


def chunked_attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """`attention.scaled_dot_product_attention`, in chunks: Q (..., T_q, d_k), K (..., T_k, d_k),
    V (..., T_k, d_v), mask bool (..., T_q, T_k) -> (..., T_q, d_v)."""
    check_attention_mask(mask)
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
    bias = torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill_(~mask, float("-inf"))
    return bias.expand(*batch, T_q, T_k).reshape(math.prod(batch), T_q, T_k)


class _ChunkedAttention(torch.autograd.Function):
    """softmax(q kᵀ/√d_k + bias) v for q (b, T_q, d_k), k (b, T_k, d_k), v (b, T_k, d_v), bias (b, T_q, T_k) or None."""

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
    """How many of the b slices one chunk holds: CHUNK_ELEMENTS scores on CPU; all of them elsewhere."""
    if q.device.type != "cpu":
        return q.shape[0]
    return max(1, CHUNK_ELEMENTS // max(1, q.shape[1] * k.shape[1]))


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
