"""One decoding step of a TransformerLM in as few tensor ops as its math allows: the step of generate() and serve.

Wins on: CPUs, for the small models this project trains, where a decoding step is bound as much by the number of
tensor ops as by streaming the weights: tinystories-17m at batch 1 spent ~4 of its ~8 ms a token outside the
matmuls, in the ~30 ops a layer of the readable forward (each a dispatch of a few microseconds; profile in
docs/benchmarks.md). `DecodeStep(model)` computes what `model(ids (B, 1), kv_cache=cache, last_only=True)`
computes for a pre-norm RMSNorm model, with:
- q, k and v as one product against their concatenated weights, and SwiGLU's W1 and W3 as one: half the calls,
  and larger products, which oneDNN and BLAS run nearer memory speed;
- RoPE on q and k together (adjacent in that product's output) as one complex multiply by each row's position
  (complex_rope.py's rotation);
- every RMSNorm as torch's fused rms_norm (aten), bit for bit the readable norm, in one op instead of six;
- the attention of each row's one query over its cached keys as two batched products around one softmax, the
  query heads of a grouped-query KV head batched together (no repeated K and V), in at least float32;
- no checks beyond the cache's own: the caller (generate(), the server) made the ids.
Its products are timed like every decoding matmul (tuned_linear.py). Anything else goes to the model's forward:
several new tokens (a prefill), an attention mask, autograd on, another kind of model (post-norm, LayerNorm),
a cache full to the context, or weights changed in place since the step was built. Proven equal to the forward
over many steps, with padding and grouped heads, in tests/test_decode_step.py.
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
TIMING_CONTEXT = 16  # the positions of the scratch cache the matmul strategies are timed on


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
    where it applies (one new token a row, a cache, no mask, no autograd), through the model's forward otherwise.
    `linears` are the Linear layers the step multiplies by, for tuned_linear.tuned_weights to tune."""

    def __init__(self, model: TransformerLM):
        self.model = model
        self.layers = [_Layer(block) for block in model.layers]
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
        return self._step(ids[:, 0], kv_cache)[:, None]

    def timing_pass(self, rows: int) -> Callable[[], None]:
        """One step of `rows` rows on a scratch cache: what tuned_linear times each matmul strategy by."""
        cache = KVCache.for_model(self.model, rows, min(TIMING_CONTEXT, self.model.config.context_length))
        ids = torch.zeros(rows, dtype=torch.long, device=cache.key_padding.device)

        def one_step() -> None:
            if cache.length == cache.max_seq_len:
                cache.reset()
            self._step(ids, cache)

        return one_step

    def _applies(self, ids: torch.Tensor, cache: KVCache | None, attention_mask: torch.Tensor | None) -> bool:
        return (cache is not None and attention_mask is None and ids.dim() == 2 and ids.shape[1] == 1
                and not torch.is_grad_enabled() and cache.length < self.model.config.context_length
                and all(parameter._version == version for parameter, version in self.sources))

    def _step(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """ids (B,) -> logits (B, V); writes each layer's key and value at the cache's length and advances it."""
        cache.check_room(1, ids.shape[0])
        cache.check_model(self.model)
        length = cache.length
        # Each row's position: its count of real tokens (with padding), else the shared length.
        rotation = None
        if self.rotation is not None:
            rotation = self.rotation[cache.next_position if cache.has_padding else length]  # (B or 1, d_k/2)
            rotation = rotation.view(-1, 1, rotation.shape[-1])  # broadcast over heads
        masked = ~cache.key_padding[:, None, None, :length + 1] if cache.has_padding else None  # (B, 1, 1, T_k)
        x = self.model.token_embeddings.weight[ids]  # (B, d_model)
        for index, layer in enumerate(self.layers):
            x = x + layer.output(self._attention(layer, layer.norm1(x), cache, index, rotation, masked))
            x = x + layer.down(self._ffn(layer, layer.norm2(x)))
        cache.next_position += 1
        cache.length += 1
        logits = self.model.lm_head(self.final_norm(x))  # (B, V)
        cap = self.model.config.logit_softcap
        return cap * torch.tanh(logits / cap) if cap else logits

    @staticmethod
    def _attention(layer: _Layer, x: torch.Tensor, cache: KVCache, index: int, rotation: torch.Tensor | None,
                   masked: torch.Tensor | None) -> torch.Tensor:
        """x (B, d_model) -> the attention output (B, H·d_k), before the output projection."""
        rows, heads, kv_heads, head_dim = x.shape[0], layer.heads, layer.kv_heads, layer.head_dim
        qkv = layer.qkv(x)  # (B, (H + 2·H_kv)·d_k)
        qk, v = qkv.split(((heads + kv_heads) * head_dim, kv_heads * head_dim), dim=-1)
        qk = qk.view(rows, heads + kv_heads, head_dim)  # q's heads, then k's: adjacent in qkv's columns
        if layer.q_norm is not None:
            qk = torch.cat((layer.q_norm(qk[:, :heads]), layer.k_norm(qk[:, heads:])), dim=1)
        if rotation is not None:
            qk = _rotate(qk, rotation)  # q and k in one pass
        q, k = qk.split((heads, kv_heads), dim=1)
        length = cache.length
        cache.keys[index][:, :, length] = k
        cache.values[index][:, :, length] = v.view(rows, kv_heads, head_dim)
        # In at least float32: a CPU's bf16 batched products are emulated and ~2x slower (batch 1) than
        # upcasting this step's keys and values (a small copy) and multiplying in float32. The sums are float32
        # either way; only the scores and weights skip their rounding to bf16.
        real = torch.promote_types(x.dtype, torch.float32)
        keys = cache.keys[index][:, :, :length + 1].to(real)  # (B, H_kv, T_k, d_k)
        values = cache.values[index][:, :, :length + 1].to(real)
        grouped = q.to(real).view(rows, kv_heads, heads // kv_heads, head_dim)  # (B, H_kv, group, d_k)
        scores = grouped @ keys.transpose(-2, -1) / math.sqrt(head_dim)  # (B, H_kv, group, T_k)
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))  # the row's own new key is real: never all masked
        return (torch.softmax(scores, dim=-1) @ values).to(x.dtype).view(rows, heads * head_dim)

    @staticmethod
    def _ffn(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """x (B, d_model) -> the FFN's hidden activations (B, d_ff), before the down projection."""
        up = layer.up(x)
        if layer.ffn_kind is SwiGLU:
            gate, up = up.chunk(2, dim=-1)
            return gate * torch.sigmoid(gate) * up
        if layer.ffn_kind is SiLUFFN:
            return up * torch.sigmoid(up)
        if layer.ffn_kind is ReLU2FFN:
            return up.clamp_min(0).square()
        raise TypeError(f"DecodeStep has no FFN of kind {layer.ffn_kind.__name__}")


def _fused_norm(norm: RMSNorm) -> Callable[[torch.Tensor], torch.Tensor]:
    """`norm` as torch's fused RMSNorm (aten's rms_norm): one op for the six of the readable forward, and the same
    bits in float32, bf16, fp16 and float64 (tests/test_decode_step.py): it too normalizes in at least float32,
    multiplies by the gain there and rounds once."""
    weight, eps = norm.weight, norm.eps
    return lambda x: torch.rms_norm(x, weight.shape, weight, eps)


def _rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x (B, heads, d_k) with each adjacent pair rotated by rotation (B or 1, 1, d_k/2), in at least float32."""
    real = torch.promote_types(x.dtype, torch.float32)
    pairs = torch.view_as_complex(x.to(real).unflatten(-1, (-1, 2)).contiguous())  # (B, heads, d_k/2)
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
