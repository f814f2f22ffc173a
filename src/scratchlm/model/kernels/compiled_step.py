"""A decoding step compiled ahead of time for CPUs: `generate(..., compile=True)`, `scratchlm generate --compile`.

Wins on: CPUs, where the eager step (decode_step.py) spends most of its time outside the products, in ~330 small
tensor ops a token (norms, RoPE, casts, softmax), each a Python call and a dispatch. Here the step is exported and
built by AOTInductor into a shared library: a step is one C++ call, those ops fused into a few loops, with no
Python per op and no guards. Two libraries for each cache size, each built at its first call:
- one row (batch 1): float32 products as inductor's own loop, x·W summed over the input features (a
  matrix-vector product at cache or memory speed, where a BLAS runs one row at about half of it); bf16 products as
  `x @ Wᵀ` on weights that inductor packs for oneDNN;
- several rows (a dynamic dimension): every product as `x @ Wᵀ` on packed weights.
On the demo's model that is ~3.4x the eager step at batch 1 and ~2.3x at batch 8; on tinystories-17m 1.3-1.6x
(bench_llama_cpp.py, bench_generate.py; figures in docs/benchmarks.md).
The price is the build, seconds for each library, paid once per model in a process (kept for the model's life while
its weights are unchanged). So it pays for long generations and long-lived decoders, and it is opt-in.

What it computes: `model(ids (B, 1), kv_cache=cache, last_only=True)` for a pre-norm TransformerLM, one
new token a row, rows with left padding included (each row's position is its count of real tokens, the padded
keys are masked). The cache's length is a dynamic dimension and the position a tensor, so a growing cache does not
build again. The math is decode_step.py's, from the model's own pieces (norms, QK-norm, RoPE, attention core, FFN
activation, soft-cap) around concatenated q/k/v and FFN input products, for export to trace. Anything else (a
prefill, an attention mask, autograd, weights changed since the build) takes the eager step. Tested against the
model's forward in tests/test_compiled_step.py.
"""

from __future__ import annotations

import logging
import tempfile
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from scratchlm.model.attention import RotaryPositionalEmbedding, rotate_pairs
from scratchlm.model.kernels import decode_step
from scratchlm.model.kv_cache import KVCache
from scratchlm.model.transformer import TransformerLM, softcap

COMPILED_DTYPES = (torch.bfloat16, torch.float32)  # where compiling was measured to win (see above)
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
    """The model's compiled step, its libraries built at their first calls and kept for the model's life; a new
    one once the weights changed (the libraries hold them as constants)."""
    step = _compiled.get(model)
    if step is None or not step.current():
        step = _compiled[model] = CompiledStep(model)
    return step


class CompileFailed(RuntimeError):
    """A library could not be built (no C++ compiler, an op export cannot trace); raised before the step wrote
    anything."""


class CompiledStep:
    """`applies(ids, cache, mask)` says whether `step(ids, cache)` computes this call; the caller decodes the rest
    eagerly."""

    def __init__(self, model: TransformerLM):
        self.model = weakref.ref(model)  # not a reference: the model is the key it is kept under
        self.static = _StaticStep(model)
        self.one_row_product = _summed if model.lm_head.weight.dtype == torch.float32 else _product
        self.libraries: dict[tuple[int, bool], Callable[..., torch.Tensor]] = {}  # (cache size, one row) -> built
        self.sources = [(parameter, parameter._version) for parameter in model.parameters()]
        self.failed = False  # set by `give_up`: the calls go to the eager step from then on

    def give_up(self, error: Exception) -> None:
        """After a build failed: say so once; `applies` is False from now."""
        self.failed = True
        log.warning("compiling the decoding step failed, decoding eagerly: %s",
                    str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)

    def current(self) -> bool:
        return all(parameter._version == version for parameter, version in self.sources)

    def applies(self, ids: torch.Tensor, cache: KVCache | None, attention_mask: torch.Tensor | None) -> bool:
        # A step on an empty cache (a one-token prompt) stays eager: a dimension of size 1 cannot be dynamic. The
        # cache's buffers must be contiguous rows: their strides are built into the library.
        return (cache is not None and attention_mask is None and ids.dim() == 2 and ids.shape[1] == 1
                and cache.keys[0].is_contiguous() and 0 < cache.length < cache.max_seq_len
                and not torch.is_grad_enabled() and not self.failed and self.current())

    def __call__(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """ids (B, 1) -> logits (B, 1, V); writes the new keys and values at the cache's length and advances it."""
        cache.check_room(1, ids.shape[0])
        cache.check_model(self.model())
        column = torch.tensor([cache.length], device=ids.device)
        inputs = _step_inputs(ids, cache, column, cache.keys, cache.values)
        logits = self._library(inputs, cache)(*inputs)
        cache.next_position += 1
        cache.length += 1
        return logits[:, None]

    def _library(self, inputs: tuple, cache: KVCache) -> Callable[..., torch.Tensor]:
        """The library for caches of this size (their buffers' strides are in it) and this many rows (one, or a
        dynamic count), built at its first call with the cache's length as a dimension."""
        one_row, max_seq_len = inputs[0].shape[0] == 1, cache.max_seq_len
        if (max_seq_len, one_row) not in self.libraries:
            length = torch.export.Dim("length", min=2, max=max_seq_len - 1)
            rows = {} if one_row else {0: torch.export.Dim("rows", min=2)}
            layers = len(inputs[4])
            shapes = (rows, rows, None, rows | {1: length}, [rows | {2: length}] * layers,
                      [rows | {2: length}] * layers)
            self.static.product = self.one_row_product if one_row else _product  # read while it is traced
            try:
                with torch.inference_mode(False), torch.no_grad(), _readable_rotation(self.static):
                    # traced on copies of the cache's buffers, which the step writes and which may be inference
                    # tensors (a trace cannot write those), copied whole so that their strides are the cache's
                    example = _step_inputs(inputs[0][:, None], cache, inputs[2], [k.clone() for k in cache.keys],
                                           [v.clone() for v in cache.values])
                    program = torch.export.export(self.static, example, dynamic_shapes=shapes)
                with tempfile.TemporaryDirectory() as folder:
                    # freezing: the weights become constants that inductor packs for oneDNN (its `x @ Wᵀ` without
                    # it is slower than the eager step's packed products)
                    package = torch._inductor.aoti_compile_and_package(
                        program, package_path=f"{folder}/step.pt2", inductor_configs={"freezing": True})
                    self.libraries[max_seq_len, one_row] = torch._inductor.aoti_load_package(package)
            except Exception as error:  # no C++ compiler, an op export cannot trace: nothing was written yet
                raise CompileFailed(str(error) or type(error).__name__) from error
        return self.libraries[max_seq_len, one_row]


def _step_inputs(ids: torch.Tensor, cache: KVCache, column: torch.Tensor, keys: list[torch.Tensor],
                 values: list[torch.Tensor]) -> tuple:
    """The library's arguments: the new ids (B,), their positions, the column they are written at, and the key
    padding, keys and values of the columns written so far and the new one (a length that changes every step)."""
    end = cache.length + 1
    return (ids[:, 0], cache.next_position, column, cache.key_padding[:, :end], [k[:, :, :end] for k in keys],
            [v[:, :, :end] for v in values])


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
    """x Wᵀ as plain `@`: inductor calls oneDNN's (or the BLAS's) product on its packed weight."""
    return x @ weight.t()


def _summed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x Wᵀ as the sum over the input features of x·W: (B, in) -> (B, out). Inductor writes it as one loop over W's
    rows (a matrix-vector product, vectorized and split across threads), with no (B, out, in) temporary."""
    return (x[..., None, :] * weight).sum(-1)


def _frozen(*tensors: torch.Tensor) -> nn.Parameter:
    """The tensors concatenated along their first dimension, as a parameter without gradient."""
    return nn.Parameter(torch.cat([t.detach() for t in tensors]), requires_grad=False)


class _StaticStep(nn.Module):
    """(ids (B,), positions (B,), column (1,), key_padding (B, T), keys, values) -> logits (B, V), writing each
    layer's new key and value at `column` = T - 1 of its (B, H_kv, T, d_k) cache views. decode_step.py's math
    with the model's own pieces, its products against the weights by `product(x, weight)` = x Wᵀ (set before each
    export: `_product` or `_summed`)."""

    def __init__(self, model: TransformerLM):
        super().__init__()
        self.product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _product
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
