"""A decoding step compiled by inductor for CPUs: `generate(..., compile=True)`, `scratchlm generate --compile`.

Wins on: CPUs, where the eager step (decode_step.py) spends most of its time outside the products, in ~330 small
tensor ops a token (norms, RoPE, casts, softmax), each a Python call and a dispatch; inductor fuses them into a few
loops. Two compiled forms, each where it was measured to win (bench_compile_decode.py and bench_llama_cpp.py;
figures in docs/benchmarks.md):
- bf16, any batch: torch.compile with `freezing`, which also packs the weights for oneDNN as packed_linear.py does;
- float32, one row (batch 1): the step ahead-of-time compiled into a shared library (AOTInductor), its products
  few_rows_linear.py's as in the eager step, so a token is one C++ call, with no Python per op and no guards: on
  the demo's model ~3x faster than the eager step, on tinystories-17m ~1.7x. With several float32 rows the eager
  step's packed products beat inductor's, so those stay eager.
The price is the compile, seconds for each form, paid once per model in a process (kept for the model's life while
its weights are unchanged), more with inductor's on-disk cache cold. So it pays for long generations and
long-lived decoders, and it is opt-in.

What it computes: `model(ids (B, 1), kv_cache=cache, last_only=True)` for a pre-norm TransformerLM, one
new token a row, rows with left padding included (each row's position is its count of real tokens, the padded
keys are masked). The cache's length is a dynamic dimension of both forms and the position a tensor, so a growing
cache does not compile again. The math is decode_step.py's, from the model's own pieces (norms, QK-norm, RoPE,
attention core, FFN activation, soft-cap) around concatenated q/k/v and FFN input products, for inductor to
trace. Anything else (a prefill, an attention mask, autograd, weights changed since the compile) takes the eager
step. Tested against the model's forward in tests/test_compiled_step.py.
"""

from __future__ import annotations

import logging
import tempfile
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config
from torch import nn

from scratchlm.model.attention import RotaryPositionalEmbedding, rotate_pairs
from scratchlm.model.kernels import decode_step
from scratchlm.model.kernels.few_rows_linear import few_rows_linear
from scratchlm.model.kv_cache import KVCache
from scratchlm.model.transformer import TransformerLM, softcap

COMPILED_DTYPES = (torch.bfloat16, torch.float32)  # where compiling was measured to win (see above)
ONE_ROW_DTYPES = (torch.float32,)  # compiled for one row only, ahead of time
# Graphs of this step's code in one process: each model (and each new set of its weights) adds two (batch 1 and
# the dynamic batch). Dynamo's default of 8 for a code object would refuse the fifth model's.
RECOMPILE_LIMIT = 64
log = logging.getLogger("scratchlm.compile")
_compiled: weakref.WeakKeyDictionary[TransformerLM, CompiledStep] = weakref.WeakKeyDictionary()


def supports(model: nn.Module) -> bool:
    """Whether `compiled_for(model)` decodes it: decode_step.py's models, in bf16 or float32, on a CPU."""
    return not_compiled_because(model) is None


def not_compiled_because(model: nn.Module) -> str | None:
    """Why `compile=True` decodes this model eagerly (None: it compiles), for the commands to say so."""
    if not decode_step.supports(model):
        return "only a pre-norm TransformerLM has a compiled step"
    weight = model.lm_head.weight
    if weight.dtype not in COMPILED_DTYPES:
        name = str(weight.dtype).removeprefix("torch.")
        return f"the weights are {name}: compiling wins only for bf16 and float32"
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


class CompileFailed(RuntimeError):
    """The one-row library could not be built; raised before the step wrote anything."""


class CompiledStep:
    """`applies(ids, cache, mask)` says whether `step(ids, cache)` computes this call; the caller decodes the rest
    eagerly."""

    def __init__(self, model: TransformerLM):
        self.model = weakref.ref(model)  # not a reference: the model is the key it is kept under
        self.one_row_only = model.lm_head.weight.dtype in ONE_ROW_DTYPES
        self.static = _StaticStep(model, product=few_rows_linear if self.one_row_only else _product)
        self.compiled = None if self.one_row_only else torch.compile(self.static, fullgraph=True)
        self.ahead_of_time: dict[int, object] = {}  # the one-row library (float32) for each cache length it met
        self.sources = [(parameter, parameter._version) for parameter in model.parameters()]
        self.failed = False  # set by `give_up`: the calls go to the eager step from then on

    def give_up(self, error: Exception) -> None:
        """After the compile failed (no C++ compiler, a dynamo limit): say so once; `applies` is False from now."""
        self.failed = True
        log.warning("torch.compile of the decoding step failed, decoding eagerly: %s",
                    str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)

    def current(self) -> bool:
        return all(parameter._version == version for parameter, version in self.sources)

    def applies(self, ids: torch.Tensor, cache: KVCache | None, attention_mask: torch.Tensor | None) -> bool:
        # A step on an empty cache (a one-token prompt) stays eager: a dimension of size 1 cannot be dynamic.
        return (cache is not None and attention_mask is None and ids.dim() == 2 and ids.shape[1] == 1
                and (not self.one_row_only or (ids.shape[0] == 1 and cache.keys[0].is_contiguous()))
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
        inputs = (ids[:, 0], cache.next_position, column, key_padding, keys, values)
        logits = self._one_row(inputs, cache.max_seq_len) if self.one_row_only else self._traced(inputs)
        cache.next_position += 1
        cache.length += 1
        return logits[:, None]

    def _one_row(self, inputs: tuple, max_seq_len: int) -> torch.Tensor:
        """The step through the ahead-of-time library, compiled at the first call for caches of this size (their
        contiguous buffers' strides are in the library) with the length written so far as a dimension."""
        if max_seq_len not in self.ahead_of_time:
            length = torch.export.Dim("length", min=2, max=max_seq_len - 1)
            layers = len(inputs[4])
            shapes = (None, None, None, {1: length}, [{2: length}] * layers, [{2: length}] * layers)
            try:
                with torch.inference_mode(False), torch.no_grad(), _readable_rotation(self.static):
                    program = torch.export.export(self.static, inputs, dynamic_shapes=shapes)
                with tempfile.TemporaryDirectory() as folder:
                    package = torch._inductor.aoti_compile_and_package(program, package_path=f"{folder}/step.pt2")
                    self.ahead_of_time[max_seq_len] = torch._inductor.aoti_load_package(package)
            except Exception as error:  # no C++ compiler, an op export cannot trace: nothing was written yet
                raise CompileFailed(str(error) or type(error).__name__) from error
        return self.ahead_of_time[max_seq_len](*inputs)

    def _traced(self, inputs: tuple) -> torch.Tensor:
        """The step through torch.compile: graphs for one row and for any other count (a dynamic batch)."""
        rows, positions, column, key_padding, keys, values = inputs
        for tensor in (*keys, *values):
            torch._dynamo.mark_dynamic(tensor, 2)
        torch._dynamo.mark_dynamic(key_padding, 1)
        if rows.shape[0] > 1:  # the batch too (a server's changes size), in a graph of its own beside batch 1
            for tensor in (rows, positions, key_padding, *keys, *values):
                torch._dynamo.mark_dynamic(tensor, 0)
        # freezing: the weights become constants that inductor packs for oneDNN (without it the compiled step is
        # slower than the eager one). It is read whenever a graph compiles (the first call of one row, and of
        # more), so every call sets it (torch.compile's `options` do not reach it).
        with inductor_config.patch(freezing=True), dynamo_config.patch(recompile_limit=RECOMPILE_LIMIT):
            return self.compiled(*inputs)


@contextmanager
def _readable_rotation(step: nn.Module) -> Iterator[None]:
    """RoPE's readable rotation while the step is traced: inductor fuses it into the step's loops, where the
    complex one that decoding installs (complex_rope.py) has no C++ kernel in the library and goes back to ATen."""
    ropes = [module for module in step.modules() if isinstance(module, RotaryPositionalEmbedding)]
    saved = [rope.rotate for rope in ropes]
    for rope in ropes:
        rope.rotate = rotate_pairs
    try:
        yield
    finally:
        for rope, rotate in zip(ropes, saved):
            rope.rotate = rotate


def _product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x Wᵀ as plain `@`."""
    return x @ weight.t()


def _frozen(*tensors: torch.Tensor) -> nn.Parameter:
    """The tensors concatenated along their first dimension, as a parameter without gradient."""
    return nn.Parameter(torch.cat([t.detach() for t in tensors]), requires_grad=False)


class _StaticStep(nn.Module):
    """(ids (B,), positions (B,), column (1,), key_padding (B, T), keys, values) -> logits (B, V), writing each
    layer's new key and value at `column` = T - 1 of its (B, H_kv, T, d_k) cache views. decode_step.py's math
    with the model's own pieces, its products against the weights by `product(x, weight)` = x Wᵀ: plain `@` for
    torch.compile (inductor packs frozen weights itself), few_rows_linear for the one-row library."""

    def __init__(self, model: TransformerLM, product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.product = product
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
            qkv = self.product(block.ln1(x), self.qkv[index])  # (B, (H + 2·H_kv)·d_k)
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
            x = x + self.product(out.view(rows, heads * d), attention.output_proj.weight)
            up = self.product(block.ln2(x), self.up[index])
            x = x + self.product(ffn.hidden(*up.chunk(len(ffn.inputs), dim=-1)), ffn.w2.weight)
        return softcap(self.product(self.final_norm(x), self.head.weight), self.cap)
