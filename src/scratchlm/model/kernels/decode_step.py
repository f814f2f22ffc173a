"""A decoding step of a TransformerLM in as few tensor ops as its math allows: the steps (and the prefills) of
generate() and serve.

Wins on: CPUs, for the small models this project trains, where a decoding step is bound as much by the number of
tensor ops as by streaming the weights: tinystories-17m at batch 1 spent ~4 of its ~8 ms a token outside the
matmuls, in the ~30 ops a layer of the readable forward (each a dispatch of a few microseconds; profile in
docs/benchmarks.md). `DecodeStep(model)` computes what `model(ids (B, T), kv_cache=cache, last_only=True)`
computes for a pre-norm RMSNorm model, with:
- q, k and v as one product against their concatenated weights, and SwiGLU's W1 and W3 as one: half the calls,
  and larger products, which oneDNN and BLAS run nearer memory speed;
- the B·T new tokens as the rows of every product, through the same packed matmuls (packed_linear.py) as a
  step: a prompt's prefill too (16 tokens of tinystories-17m at batch 1: 9.5 -> 7.7 ms fp32, 6.7 -> 3.9 ms bf16);
- RoPE on q and k together (adjacent in that product's output) as one complex multiply by each token's position
  (complex_rope.py's rotation);
- every RMSNorm as torch's fused rms_norm (aten), bit for bit the readable norm, in one op instead of six;
- the attention of the new tokens over the cached keys and their own as two batched products around one softmax,
  the query heads of a grouped-query KV head batched together (no repeated K and V), in at least float32;
- no checks beyond the cache's own: the caller (generate(), the server) made the ids.
Anything else goes to the model's forward: several new tokens after left padding, an attention mask, autograd
on, another kind of model (post-norm, LayerNorm), more tokens than the context has left, or weights changed in
place since the step was built. Proven equal to the forward over many steps and prefills, with padding and
grouped heads, in tests/test_decode_step.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from scratchlm.model.kv_cache import KVCache
from scratchlm.model.layers import Linear, RMSNorm
from scratchlm.model.transformer import ReLU2FFN, SiLUFFN, SwiGLU, TransformerLM

# The concatenated copies cost their weights' bytes once more: above this (models of gpt2-medium size and up,
# where the dispatch overhead is a small share of a step anyway) the model's forward decodes instead.
MAX_FUSED_BYTES = 2**30


def supports(model: nn.Module) -> bool:
    """Whether `DecodeStep` computes this model's step: a TransformerLM with pre-norm RMSNorm blocks."""
    if not isinstance(model, TransformerLM) or model.config.norm_position != "pre":
        return False
    norms = [model.ln_final, *(norm for layer in model.layers for norm in (layer.ln1, layer.ln2))]
    return all(isinstance(norm, RMSNorm) for norm in norms)


def fused_bytes(model: TransformerLM) -> int:
    """The bytes of the concatenated q/k/v and W1/W3 copies a DecodeStep keeps."""
    total = 0
    for layer in model.layers:
        attention, ffn = layer.attn, layer.ffn
        total += sum(p.weight.numel() * p.weight.element_size() for p in (attention.q_proj, attention.k_proj,
                                                                        attention.v_proj))
        if isinstance(ffn, SwiGLU):
            total += sum(p.weight.numel() * p.weight.element_size() for p in (ffn.w1, ffn.w3))
    return total


class _Layer:
    """One block's weights as the step uses them: fused q/k/v (and W1/W3) Linears, the others the model's own."""

    def __init__(self, block: nn.Module):
        attention, ffn = block.attn, block.ffn
        self.norm1, self.norm2 = _fused_norm(block.ln1), _fused_norm(block.ln2)
        self.qkv = _concatenated(attention.q_proj, attention.k_proj, attention.v_proj)
        self.q_norm = _fused_norm(attention.q_norm) if attention.q_norm is not None else None
        self.k_norm = _fused_norm(attention.k_norm) if attention.k_norm is not None else None
        self.heads, self.kv_heads, self.head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        self.output = attention.output_proj
        self.ffn_kind = type(ffn)
        self.up = _concatenated(ffn.w1, ffn.w3) if isinstance(ffn, SwiGLU) else ffn.w1  # (gate | up) or W1
        self.down = ffn.w2


class DecodeStep:
    """`model(ids, kv_cache=cache, attention_mask=mask, last_only=True)` -> (B, 1, V), through the fused step
    where it applies (a cache, no mask, no autograd; one new token a row, or several on a cache without padding),
    through the model's forward otherwise.
    `linears` are the Linear layers the step multiplies by, for packed_linear.packed_weights to pack."""

    def __init__(self, model: TransformerLM):
        self.model = model
        self.layers = [_Layer(block) for block in model.layers]
        attention = model.layers[0].attn
        self.group = attention.num_heads // attention.num_kv_heads  # query heads per KV head
        self.final_norm = _fused_norm(model.ln_final)
        self.linears = nn.ModuleList(linear for layer in self.layers
                                     for linear in (layer.qkv, layer.output, layer.up, layer.down))
        self.linears.append(model.lm_head)
        rope = model.layers[0].attn.rope
        # Each position's rotation cos + i·sin, as complex_rope.py multiplies by (None: no position encoding), in
        # the precision the forward rotates in (at least float32; the tables are bf16 in a bf16 model).
        self.rotation = None
        if rope is not None:
            real = torch.promote_types(rope.cos.dtype, torch.float32)
            self.rotation = torch.complex(rope.cos.to(real), rope.sin.to(real))  # (S, d_k/2)
        self.sources = [(parameter, parameter._version) for parameter in model.parameters()]

    def __call__(self, ids: torch.Tensor, kv_cache: KVCache | None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if not self._applies(ids, kv_cache, attention_mask):
            return self.model(ids, kv_cache=kv_cache, attention_mask=attention_mask, last_only=True)
        return self._step(ids, kv_cache)[:, None]

    def _applies(self, ids: torch.Tensor, cache: KVCache | None, attention_mask: torch.Tensor | None) -> bool:
        # Several new tokens (a prefill) only without padding: a padded row's positions are its own count.
        return (cache is not None and attention_mask is None and ids.dim() == 2
                and (ids.shape[1] == 1 or (ids.shape[1] > 1 and not cache.has_padding))
                and not torch.is_grad_enabled() and cache.length + ids.shape[1] <= self.model.config.context_length
                and all(parameter._version == version for parameter, version in self.sources))

    def _step(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """ids (B, T) -> the last position's logits (B, V); writes each layer's T keys and values at the cache's
        length and advances it. The B·T tokens go through every product as one matrix of rows."""
        rows, new = ids.shape
        cache.check_room(new, rows)
        cache.check_model(self.model)
        length = cache.length
        # Each token's position: with padding (one new token) the row's count of real tokens, else length + t.
        rotation = None
        if self.rotation is not None:
            if cache.has_padding:
                rotation = self.rotation[cache.next_position][:, None]  # (B, 1, d_k/2)
            else:
                rotation = self.rotation[length:length + new]  # (T, d_k/2)
            rotation = rotation.reshape(-1, new, 1, rotation.shape[-1])  # (B or 1, T, 1, d_k/2): over heads
        x = self.model.token_embeddings.weight[ids.reshape(-1)]  # (B·T, d_model)
        masked = _masked_keys(cache, new, self.group)
        for index, layer in enumerate(self.layers):
            x = x + layer.output(self._attention(layer, layer.norm1(x), rows, cache, index, rotation, masked))
            x = x + layer.down(self._ffn(layer, layer.norm2(x)))
        cache.next_position += new
        cache.length += new
        last = x.view(rows, new, -1)[:, -1]  # (B, d_model)
        logits = self.model.lm_head(self.final_norm(last))  # (B, V)
        cap = self.model.config.logit_softcap
        return cap * torch.tanh(logits / cap) if cap else logits

    @staticmethod
    def _attention(layer: _Layer, x: torch.Tensor, rows: int, cache: KVCache, index: int,
                   rotation: torch.Tensor | None, masked: torch.Tensor | None) -> torch.Tensor:
        """x (B·T, d_model) -> the attention output (B·T, H·d_k), before the output projection."""
        heads, kv_heads, head_dim = layer.heads, layer.kv_heads, layer.head_dim
        group, new = heads // kv_heads, x.shape[0] // rows
        qkv = layer.qkv(x)  # (B·T, (H + 2·H_kv)·d_k)
        qk, v = qkv.split(((heads + kv_heads) * head_dim, kv_heads * head_dim), dim=-1)
        qk = qk.view(rows, new, heads + kv_heads, head_dim)  # q's heads, then k's: adjacent in qkv's columns
        if layer.q_norm is not None:
            qk = torch.cat((layer.q_norm(qk[:, :, :heads]), layer.k_norm(qk[:, :, heads:])), dim=2)
        if rotation is not None:
            qk = _rotate(qk, rotation)  # q and k in one pass
        q, k = qk.split((heads, kv_heads), dim=2)
        length = cache.length
        cache.keys[index][:, :, length:length + new] = k.transpose(1, 2)
        cache.values[index][:, :, length:length + new] = v.view(rows, new, kv_heads, head_dim).transpose(1, 2)
        # In at least float32: a CPU's bf16 batched products are emulated and ~2x slower (batch 1) than
        # upcasting this step's keys and values (a small copy) and multiplying in float32. The sums are float32
        # either way; only the scores and weights skip their rounding to bf16.
        real = torch.promote_types(x.dtype, torch.float32)
        keys = cache.keys[index][:, :, :length + new].to(real)  # (B, H_kv, T_k, d_k)
        values = cache.values[index][:, :, :length + new].to(real)
        # The query heads of a KV head and their T tokens as one block of rows (no repeated K and V): one new token
        # makes this a view, (B, H_kv, group, d_k).
        grouped = q.to(real).view(rows, new, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        grouped = grouped.reshape(rows, kv_heads, group * new, head_dim)  # (B, H_kv, group·T, d_k)
        scores = grouped @ keys.transpose(-2, -1) / math.sqrt(head_dim)  # (B, H_kv, group·T, T_k)
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))  # a token's own key is real: never all masked
        out = torch.softmax(scores, dim=-1) @ values  # (B, H_kv, group·T, d_k)
        out = out.view(rows, kv_heads, group, new, head_dim).permute(0, 3, 1, 2, 4)  # (B, T, H_kv, group, d_k)
        return out.to(x.dtype).reshape(rows * new, heads * head_dim)

    @staticmethod
    def _ffn(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """x (B, d_model) -> the FFN's hidden activations (B, d_ff), before the down projection."""
        return ffn_hidden(layer.ffn_kind, layer.up(x))


def up_projections(ffn: nn.Module) -> tuple[torch.Tensor, ...]:
    """The weights the FFN multiplies its input by, in the order `ffn_hidden` reads their outputs: (W1, W3) for
    SwiGLU (gate, up), (W1,) otherwise."""
    return (ffn.w1.weight, ffn.w3.weight) if isinstance(ffn, SwiGLU) else (ffn.w1.weight,)


def ffn_hidden(kind: type, up: torch.Tensor) -> torch.Tensor:
    """The hidden activations (B, d_ff) of an FFN of `kind` from its up projections' outputs side by side."""
    if kind is SwiGLU:
        gate, up = up.chunk(2, dim=-1)
        return gate * torch.sigmoid(gate) * up
    if kind is SiLUFFN:
        return up * torch.sigmoid(up)
    if kind is ReLU2FFN:
        return up.clamp_min(0).square()
    raise TypeError(f"DecodeStep has no FFN of kind {kind.__name__}")


def _fused_norm(norm: RMSNorm) -> Callable[[torch.Tensor], torch.Tensor]:
    """`norm` as torch's fused RMSNorm (aten's rms_norm): one op for the six of the readable forward, and the same
    bits in float32, bf16, fp16 and float64 (tests/test_decode_step.py): it too normalizes in at least float32,
    multiplies by the gain there and rounds once."""
    weight, eps = norm.weight, norm.eps
    return lambda x: torch.rms_norm(x, weight.shape, weight, eps)


def _masked_keys(cache: KVCache, new: int, group: int) -> torch.Tensor | None:
    """Where each new token must not attend, for scores (B, H_kv, group·T, T_k) (None: nowhere): with padding
    (one new token), the padded keys, (B, 1, 1, T_k); for several tokens, the keys after each token's own position,
    (group·T, T_k), token t at rows t, T + t, 2·T + t, ... (the grouped queries' order)."""
    length = cache.length
    if cache.has_padding:
        return ~cache.key_padding[:, None, None, :length + 1]
    if new == 1:
        return None
    device = cache.key_padding.device
    own_position = length + torch.arange(new, device=device)  # (T,)
    return torch.arange(length + new, device=device) > own_position.repeat(group)[:, None]


def _rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x (B, T, heads, d_k) with each adjacent pair rotated by rotation (B or 1, T, 1, d_k/2), in at least
    float32."""
    real = torch.promote_types(x.dtype, torch.float32)
    pairs = torch.view_as_complex(x.to(real).unflatten(-1, (-1, 2)).contiguous())  # (B, T, heads, d_k/2)
    return torch.view_as_real(pairs * rotation.to(pairs.dtype)).flatten(-2).to(x.dtype)


def _concatenated(*linears: Linear) -> Linear:
    """One Linear whose output is the outputs of `linears` side by side (weights and biases concatenated)."""
    first = linears[0]
    with torch.inference_mode(False):  # a normal tensor, whose version counter the tuned matmuls check
        fused = Linear(first.in_features, sum(linear.out_features for linear in linears), device="meta")
        fused.weight = nn.Parameter(torch.cat([linear.weight.detach() for linear in linears]), requires_grad=False)
        if first.bias is not None:
            fused.bias = nn.Parameter(torch.cat([linear.bias.detach() for linear in linears]), requires_grad=False)
    return fused
