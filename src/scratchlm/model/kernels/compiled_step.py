"""A decoding step compiled by torch.compile (inductor) for bf16 models on CPU: `generate(..., compile=True)`,
`scratchlm generate --compile`.

Wins on: CPUs, for bf16 models. The eager bf16 step (decode_step.py) spends much of its time outside the
products, in the small ops of every layer (norms, RoPE, casts, softmax), each a dispatch and, in bf16, a
conversion; inductor fuses them into a few loops and, with `freezing`, packs the weights for oneDNN as
packed_linear.py does. In float32 there are no casts to save and inductor's products are slower than
packed_linear.py's, so only bf16 models on a CPU are compiled (benchmarks/bench_compile_decode.py and
bench_generate.py measure both; figures in docs/benchmarks.md). The price is the compile, seconds for batch 1 and
as many again for every other batch size together (the batch is a dynamic dimension from 2 rows up), paid once
per model in a process (kept for the model's life while its weights are unchanged), and more with inductor's
on-disk cache cold. So it pays for long generations and long-lived decoders, and it is opt-in.

What it computes: `model(ids (B, 1), kv_cache=cache, last_only=True)` for a pre-norm TransformerLM, one
new token a row, rows with left padding included (each row's position is its count of real tokens, the padded
keys are masked). The cache's length is a dynamic dimension of the graph and the position a tensor, so a growing
cache does not compile again. The math is decode_step.py's, from the model's own pieces (norms, QK-norm, RoPE,
attention core, FFN activation, soft-cap) around concatenated q/k/v and FFN input products, for inductor to
trace. Anything else (a prefill,
an attention mask, autograd, weights changed since the compile) takes the eager step. Tested against the model's
forward in tests/test_compiled_step.py.
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config
from torch import nn

from scratchlm.model.kernels import decode_step
from scratchlm.model.kv_cache import KVCache
from scratchlm.model.transformer import TransformerLM, softcap

COMPILED_DTYPES = (torch.bfloat16,)  # where compiling was measured to win (see above)
# Graphs of this step's code in one process: each model (and each new set of its weights) adds two (batch 1 and
# the dynamic batch). Dynamo's default of 8 for a code object would refuse the fifth model's.
RECOMPILE_LIMIT = 64
log = logging.getLogger("scratchlm.compile")
_compiled: weakref.WeakKeyDictionary[TransformerLM, CompiledStep] = weakref.WeakKeyDictionary()


def supports(model: nn.Module) -> bool:
    """Whether `compiled_for(model)` decodes it: decode_step.py's models, in bf16, on a CPU."""
    return not_compiled_because(model) is None


def not_compiled_because(model: nn.Module) -> str | None:
    """Why `compile=True` decodes this model eagerly (None: it compiles), for the commands to say so."""
    if not decode_step.supports(model):
        return "only a pre-norm TransformerLM has a compiled step"
    weight = model.lm_head.weight
    if weight.dtype not in COMPILED_DTYPES:
        name = str(weight.dtype).removeprefix("torch.")
        return f"the weights are {name}: compiling wins only for bf16 (--dtype bf16)"
    if weight.device.type != "cpu":
        return f"it is on {weight.device.type}: compiling was measured to win only on a CPU"
    return None


def compiled_for(model: TransformerLM) -> CompiledStep:
    """The model's compiled step, compiled at its first call and kept for the model's life; a new one once the
    weights changed (the compiled graph holds them as constants)."""
    step = _compiled.get(model)
    if step is None or not step.current():
        step = _compiled[model] = CompiledStep(model)
    return step


class CompiledStep:
    """`applies(ids, cache, mask)` says whether `step(ids, cache)` computes this call; the caller decodes the rest
    eagerly."""

    def __init__(self, model: TransformerLM):
        self.model = weakref.ref(model)  # not a reference: the model is the key it is kept under
        self.static = torch.compile(_StaticStep(model), fullgraph=True)
        self.sources = [(parameter, parameter._version) for parameter in model.parameters()]
        self.failed = False  # set by `give_up`: the calls go to the eager step from then on

    def give_up(self, error: Exception) -> None:
        """After torch.compile failed (no C++ compiler, a dynamo limit): say so once; `applies` is False from now."""
        self.failed = True
        log.warning("torch.compile of the decoding step failed, decoding eagerly: %s",
                    str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)

    def current(self) -> bool:
        return all(parameter._version == version for parameter, version in self.sources)

    def applies(self, ids: torch.Tensor, cache: KVCache | None, attention_mask: torch.Tensor | None) -> bool:
        # A step on an empty cache (a one-token prompt) stays eager: a dimension of size 1 cannot be dynamic.
        return (cache is not None and attention_mask is None and ids.dim() == 2 and ids.shape[1] == 1
                and 0 < cache.length < cache.max_seq_len and not torch.is_grad_enabled() and not self.failed
                and self.current())

    def __call__(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """ids (B, 1) -> logits (B, 1, V); writes the new keys and values at the cache's length and advances it."""
        cache.check_room(1, ids.shape[0])
        cache.check_model(self.model())
        column = torch.tensor([cache.length], device=ids.device)
        # The columns written so far and the new one: a length that changes every step, marked dynamic so that it
        # is a symbol in the graph, not a new compile each step.
        end = cache.length + 1
        keys, values = [k[:, :, :end] for k in cache.keys], [v[:, :, :end] for v in cache.values]
        key_padding = cache.key_padding[:, :end]
        for tensor in (*keys, *values):
            torch._dynamo.mark_dynamic(tensor, 2)
        torch._dynamo.mark_dynamic(key_padding, 1)
        rows = ids[:, 0]
        if rows.shape[0] > 1:  # the batch too (a server's changes size), in a graph of its own beside batch 1
            for tensor in (rows, cache.next_position, key_padding, *keys, *values):
                torch._dynamo.mark_dynamic(tensor, 0)
        # freezing: the weights become constants that inductor packs for oneDNN (without it the compiled step is
        # slower than the eager one). It is read whenever a graph compiles (the first call of one row, and of
        # more), so every call sets it (torch.compile's `options` do not reach it).
        with inductor_config.patch(freezing=True), dynamo_config.patch(recompile_limit=RECOMPILE_LIMIT):
            logits = self.static(rows, cache.next_position, column, key_padding, keys, values)
        cache.next_position += 1
        cache.length += 1
        return logits[:, None]


def _frozen(*tensors: torch.Tensor) -> nn.Parameter:
    """The tensors concatenated along their first dimension, as a parameter without gradient."""
    return nn.Parameter(torch.cat([t.detach() for t in tensors]), requires_grad=False)


class _StaticStep(nn.Module):
    """(ids (B,), positions (B,), column (1,), key_padding (B, T), keys, values) -> logits (B, V), writing each
    layer's new key and value at `column` = T - 1 of its (B, H_kv, T, d_k) cache views. decode_step.py's math
    with the model's own pieces, its products against the weights as plain `@` (inductor packs them itself)."""

    def __init__(self, model: TransformerLM):
        super().__init__()
        # The model's parts, not the model: the compiled step is kept under the model as a weak key.
        self.embedding, self.blocks, self.final_norm, self.head = (model.token_embeddings, model.layers,
                                                                   model.ln_final, model.lm_head)
        self.cap = model.config.logit_softcap
        blocks = model.layers
        self.qkv = nn.ParameterList(_frozen(b.attn.q_proj.weight, b.attn.k_proj.weight, b.attn.v_proj.weight)
                                    for b in blocks)
        self.qkv_bias = nn.ParameterList(_frozen(b.attn.q_proj.bias, b.attn.k_proj.bias, b.attn.v_proj.bias)
                                         for b in blocks if b.attn.q_proj.bias is not None)
        self.up = nn.ParameterList(_frozen(*(linear.weight for linear in block.ffn.inputs)) for block in blocks)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, column: torch.Tensor, key_padding: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        rows = ids.shape[0]
        rope = self.blocks[0].attn.rope
        if rope is not None:
            cos, sin = rope.angles(positions[:, None])  # (B, 1, d_k/2)
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, 1, d_k/2): over heads
        x = self.embedding(ids)  # (B, d_model)
        for index, block in enumerate(self.blocks):
            attention, ffn = block.attn, block.ffn
            heads, kv_heads, d = attention.num_heads, attention.num_kv_heads, attention.head_dim
            qkv = block.ln1(x) @ self.qkv[index].t()  # (B, (H + 2·H_kv)·d_k)
            if self.qkv_bias:
                qkv = qkv + self.qkv_bias[index]
            q, k, v = qkv.view(rows, -1, 1, d).split((heads, kv_heads, kv_heads), dim=1)  # (B, heads, 1, d_k)
            if attention.q_norm is not None:
                q, k = attention.q_norm(q), attention.k_norm(k)
            if rope is not None:
                q, k = rope.rotated(q, cos, sin), rope.rotated(k, cos, sin)
            keys[index].index_copy_(2, column, k)
            values[index].index_copy_(2, column, v)
            out = attention.attention_core(q, keys[index], values[index], key_padding)  # (B, H, 1, d_k)
            x = x + out.view(rows, heads * d) @ attention.output_proj.weight.t()
            up = block.ln2(x) @ self.up[index].t()
            x = x + ffn.hidden(*up.chunk(len(ffn.inputs), dim=-1)) @ ffn.w2.weight.t()
        return softcap(self.final_norm(x) @ self.head.weight.t(), self.cap)
