"""A decoding step (and prefill) of a TransformerLM in as few tensor ops as its math allows: generate() and serve.

Wins on: CPUs, for small models, whose decoding steps are bound as much by the number of ops as by streaming the
weights. It computes `model(ids (B, T), kv_cache=cache, last_only=True)` of a pre-norm model with the model's
own pieces (norms, QK-norm, RoPE, attention core, FFN `hidden`, soft-cap) under whatever kernels are installed.
It adds only: q, k and v as one product against concatenated weights, and SwiGLU's W1 and W3 as one; the B·T
new tokens as the rows of every product (a prompt's prefill too); RoPE angles once a step, q and k rotated
together; no checks beyond the cache's own (the caller made the ids). Anything else goes to the model's forward:
several new tokens after left padding, an attention mask, autograd, more tokens than the context has left, or
weights changed in place since the step was built. Proven equal to the forward in tests/test_decode_step.py.
"""

from __future__ import annotations

import torch
from torch import nn

from scratchlm.model.kv_cache import KVCache
from scratchlm.model.layers import Linear
from scratchlm.model.transformer import TransformerBlock, TransformerLM, softcap

# The concatenated copies cost their weights' bytes once more: above this (models of gpt2-medium size and up,
# where the dispatch overhead is a small share of a step anyway) the model's forward decodes instead.
MAX_FUSED_BYTES = 2**30

Angles = tuple[torch.Tensor, torch.Tensor]  # RoPE's (cos, sin) of the step's positions, broadcast over heads


def supports(model: nn.Module) -> bool:
    """Whether `DecodeStep` computes this model's step: a pre-norm TransformerLM."""
    return isinstance(model, TransformerLM) and model.config.norm_position == "pre"


def fused_bytes(model: TransformerLM) -> int:
    """The bytes of the concatenated q/k/v and FFN input copies a DecodeStep keeps."""
    return sum(linear.weight.numel() * linear.weight.element_size() for block in model.layers
               for group in _fused_groups(block) if len(group) > 1 for linear in group)


def _fused_groups(block: TransformerBlock) -> tuple[tuple[Linear, ...], tuple[Linear, ...]]:
    """The Linears a step multiplies by as one product a group: q, k and v; the FFN's inputs (W1 alone: no copy)."""
    attention = block.attn
    return (attention.q_proj, attention.k_proj, attention.v_proj), block.ffn.inputs


class _Layer:
    """One block as the step runs it: its own modules, and the concatenated q/k/v (and FFN input) Linears."""

    def __init__(self, block: TransformerBlock):
        self.block = block
        self.qkv, self.up = (_concatenated(*group) for group in _fused_groups(block))  # up: (gate | up) or W1
        attention = block.attn
        self.splits = (attention.num_heads, attention.num_kv_heads, attention.num_kv_heads)


class DecodeStep:
    """`model(ids, kv_cache=cache, attention_mask=mask, last_only=True)` -> (B, 1, V), through the fused step
    where it applies (a cache, no mask, no autograd; one new token a row, or several on a cache without padding),
    through the model's forward otherwise.
    `linears` are the Linear layers the step multiplies by, for packed_linear.packed_weights to pack."""

    def __init__(self, model: TransformerLM):
        self.model = model
        self.layers = [_Layer(block) for block in model.layers]
        self.linears = nn.ModuleList(linear for layer in self.layers for linear in (
            layer.qkv, layer.block.attn.output_proj, layer.up, layer.block.ffn.w2))
        self.linears.append(model.lm_head)
        self.rope = model.layers[0].attn.rope  # None: no position encoding
        self.sources = [(parameter, parameter._version) for parameter in model.parameters()]

    def __call__(self, ids: torch.Tensor, kv_cache: KVCache | None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if not self._applies(ids, kv_cache, attention_mask):
            return self.model(ids, kv_cache=kv_cache, attention_mask=attention_mask, last_only=True)
        return self.step(ids, kv_cache)[:, None]

    def _applies(self, ids: torch.Tensor, cache: KVCache | None, attention_mask: torch.Tensor | None) -> bool:
        # Several new tokens (a prefill) only without padding: a padded row's positions are its own count.
        return (cache is not None and attention_mask is None and ids.dim() == 2
                and (ids.shape[1] == 1 or (ids.shape[1] > 1 and not cache.has_padding))
                and not torch.is_grad_enabled() and cache.length + ids.shape[1] <= self.model.config.context_length
                and all(parameter._version == version for parameter, version in self.sources))

    def step(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """ids (B, T) -> the last position's logits (B, V); writes each layer's T keys and values at the cache's
        length and advances it. The B·T tokens go through every product as one matrix of rows. What the compiled
        step (compiled_step.py) traces too, over its library's inputs."""
        rows, new = ids.shape
        cache.check_room(new, rows)
        cache.check_model(self.model)
        angles = self._angles(cache, new)
        key_padding = cache.key_padding if cache.has_padding else None
        x = self.model.token_embeddings(ids).view(rows * new, -1)  # (B·T, d_model)
        for index, layer in enumerate(self.layers):
            block = layer.block
            attended = self._attention(layer, block.ln1(x), rows, cache, index, angles, key_padding)
            x = x + block.attn.output_proj(attended)
            ffn = block.ffn
            x = x + ffn.w2(ffn.hidden(*layer.up(block.ln2(x)).chunk(len(ffn.inputs), dim=-1)))
        cache.next_position += new
        cache.length += new
        last = x.view(rows, new, -1)[:, -1]  # (B, d_model)
        return softcap(self.model.lm_head(self.model.ln_final(last)), self.model.config.logit_softcap)  # (B, V)

    def _angles(self, cache: KVCache, new: int) -> Angles | None:
        """The RoPE angles of the new tokens, shaped to broadcast over (B, heads, T, d_k/2): with padding (one
        new token) each row's count of real tokens, else the cache's length + t."""
        if self.rope is None:
            return None
        if cache.has_padding:
            cos, sin = self.rope.angles(cache.next_position[:, None])  # (B, 1, d_k/2)
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, 1, d_k/2)
        else:
            cos, sin = self.rope.angles(None, start=cache.length, length=new)  # (T, d_k/2)
        real = torch.promote_types(cos.dtype, torch.float32)  # as `rope.rotated` casts them: once, not per layer
        return cos.to(real), sin.to(real)

    def _attention(self, layer: _Layer, x: torch.Tensor, rows: int, cache: KVCache, index: int,
                   angles: Angles | None, key_padding: torch.Tensor | None) -> torch.Tensor:
        """x (B·T, d_model) -> the attention output (B·T, H·d_k), before the output projection."""
        attention = layer.block.attn
        heads, kv_heads, _ = layer.splits
        new = x.shape[0] // rows
        qkv = layer.qkv(x).view(rows, new, -1, attention.head_dim).transpose(1, 2)  # (B, H + 2·H_kv, T, d_k)
        q, k, v = qkv.split(layer.splits, dim=1)
        qk = qkv[:, :heads + kv_heads]  # q's heads, then k's: adjacent in qkv's columns
        if attention.q_norm is not None:
            qk = torch.cat((attention.q_norm(q), attention.k_norm(k)), dim=1)
        if angles is not None:  # q and k together: one rotation for both
            qk = self.rope.rotated(qk, *angles)
        q, k = qk.split((heads, kv_heads), dim=1)
        length, end = cache.length, cache.length + new
        cache.keys[index][:, :, length:end] = k
        cache.values[index][:, :, length:end] = v
        out = attention.attention_core(q, cache.keys[index][:, :, :end], cache.values[index][:, :, :end],
                                       key_padding)  # (B, H, T, d_k)
        return out.transpose(1, 2).reshape(rows * new, heads * attention.head_dim)


def _concatenated(*linears: Linear) -> Linear:
    """One Linear whose output is the outputs of `linears` side by side (weights and biases concatenated); a
    single Linear is itself."""
    first = linears[0]
    if len(linears) == 1:
        return first
    with torch.inference_mode(False):  # a normal tensor, whose version counter the packed matmuls check
        fused = Linear(first.in_features, sum(linear.out_features for linear in linears), device="meta")
        fused.weight = nn.Parameter(torch.cat([linear.weight.detach() for linear in linears]), requires_grad=False)
        if first.bias is not None:
            fused.bias = nn.Parameter(torch.cat([linear.bias.detach() for linear in linears]), requires_grad=False)
    return fused
