"""A decoding step compiled ahead of time for CPUs: `generate(..., compile=True)`, `scratchlm generate --compile`.

Wins on: CPUs, where the eager step (decode_step.py) spends most of its time dispatching hundreds of small ops a
token; AOTInductor builds the step into a shared library, one C++ call with those ops fused into a few loops. Two
libraries per cache size, each built at its first call (seconds, once per model in a process: opt-in): one row
(float32 products as inductor's own matrix-vector loop, `_summed`; bf16 ones as `x @ Wᵀ` on weights inductor
packs for oneDNN) and several rows (a dynamic dimension; every product on packed weights, bf16 ones packed as
float32 where the CPU has no bf16 arithmetic, `_in_float32`, as packed_linear.py packs them).

It computes `model(ids (B, 1), kv_cache=cache, last_only=True)` of a pre-norm TransformerLM, left padding
included; the cache's length is a dynamic dimension and the position a tensor, so a growing cache does not
rebuild. Export traces decode_step.py's own `DecodeStep.step`, so the step is written once. Anything else (a
prefill, a mask, autograd, weights changed since the build) takes the eager step (tests/test_compiled_step.py).
"""

from __future__ import annotations

import logging
import tempfile
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch
from torch import nn

from scratchlm.model.attention import RotaryPositionalEmbedding, rotate_pairs
from scratchlm.model.kernels import decode_step, packed_linear
from scratchlm.model.kernels.swap import swapped
from scratchlm.model.kv_cache import KVCache
from scratchlm.model.layers import linear
from scratchlm.model.transformer import TransformerLM

if TYPE_CHECKING:  # a type only: importing inductor's package loader takes seconds
    from torch._inductor.package.package import AOTICompiledModel

COMPILED_DTYPES = (torch.bfloat16, torch.float32)  # where compiling was measured to win
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
        weight = model.lm_head.weight
        self.one_row_product = _summed if weight.dtype == torch.float32 else linear
        packed_as, _ = packed_linear.packing_for(weight)  # the eager step's rule: float32 without bf16 arithmetic
        self.rows_product = linear if packed_as == weight.dtype else _in_float32
        self.libraries: dict[tuple[int, bool], AOTICompiledModel] = {}  # (cache size, one row) -> built
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
        inputs = _library_inputs(ids, cache, cache.next_position, cache.keys, cache.values)
        library = self._library(inputs, cache)
        new_ids, positions, key_padding, keys, values = inputs
        # The library's runner, given the inputs in the order export flattened them: the loaded package's own
        # __call__ would parse its call spec and flatten the inputs again at every step (docs/benchmarks.md).
        (logits,) = library.loader.boxed_run([new_ids, positions, key_padding, *keys, *values])
        cache.length += 1  # the library advanced cache.next_position
        return logits[:, None]

    def _library(self, inputs: tuple, cache: KVCache) -> AOTICompiledModel:
        """The library for caches of this size (their buffers' strides are in it) and this many rows (one, or a
        dynamic count), built at its first call with the cache's length as a dimension."""
        one_row, max_seq_len = inputs[0].shape[0] == 1, cache.max_seq_len
        if (max_seq_len, one_row) not in self.libraries:
            length = torch.export.Dim("length", min=2, max=max_seq_len - 1)
            rows = {} if one_row else {0: torch.export.Dim("rows", min=2)}
            layers = len(inputs[3])
            shapes = (rows, rows, rows | {1: length}, [rows | {2: length}] * layers, [rows | {2: length}] * layers)
            step = _ExportedStep(self.model())
            try:
                with torch.inference_mode(False), torch.no_grad(), step.traceable(
                        self.one_row_product if one_row else self.rows_product):
                    # traced on copies of the cache's tensors, which the step writes and which may be inference
                    # tensors (a trace cannot write those), the buffers copied whole so that their strides are kept
                    example = _library_inputs(inputs[0][:, None], cache, cache.next_position.clone(),
                                              [k.clone() for k in cache.keys], [v.clone() for v in cache.values])
                    program = torch.export.export(step, example, dynamic_shapes=shapes)
                with tempfile.TemporaryDirectory() as folder:
                    # freezing: the weights become constants that inductor packs for oneDNN (its `x @ Wᵀ` without
                    # it is slower than the eager step's packed products)
                    package = torch._inductor.aoti_compile_and_package(
                        program, package_path=f"{folder}/step.pt2", inductor_configs={"freezing": True})
                    self.libraries[max_seq_len, one_row] = torch._inductor.aoti_load_package(package)
            except Exception as error:  # no C++ compiler, an op export cannot trace: nothing was written yet
                raise CompileFailed(str(error) or type(error).__name__) from error
        return self.libraries[max_seq_len, one_row]


def _library_inputs(ids: torch.Tensor, cache: KVCache, positions: torch.Tensor, keys: list[torch.Tensor],
                    values: list[torch.Tensor]) -> tuple:
    """The library's arguments: the new ids (B,), each row's position, and the key padding, keys and values of the
    columns written so far and the new one (a length that changes every step)."""
    end = cache.length + 1
    return (ids[:, 0], positions, cache.key_padding[:, :end], [k[:, :, :end] for k in keys],
            [v[:, :, :end] for v in values])


class _LibraryCache:
    """What decode_step.py's step reads of a KVCache, over the library's inputs: the columns so far and the new
    one (the length, a dimension of the trace, is one less than theirs), each row's position and key padding (as
    after left padding: the positions come from `next_position`, correct with or without padding)."""

    has_padding = True

    def __init__(self, positions: torch.Tensor, key_padding: torch.Tensor, keys: list[torch.Tensor],
                 values: list[torch.Tensor]):
        self.next_position, self.key_padding, self.keys, self.values = positions, key_padding, keys, values
        self.length = keys[0].shape[2] - 1

    def check_room(self, new_tokens: int, batch_size: int) -> None:
        """The caller's KVCache was checked before the call."""

    def check_model(self, model: nn.Module) -> None:
        """The caller's KVCache was checked before the call."""


class _ExportedStep(nn.Module):
    """decode_step.py's step as export traces it: (ids (B,), positions (B,), key_padding (B, T), keys, values) ->
    logits (B, V), writing each layer's new key and value in the last of its (B, H_kv, T, d_k) cache columns and
    advancing `positions`. The model is a submodule only while the library is built."""

    def __init__(self, model: TransformerLM):
        super().__init__()
        self.model, self.step = model, decode_step.DecodeStep(model)
        self.fused = self.step.linears  # the concatenated q/k/v and FFN inputs, with the model's own Linears

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, key_padding: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        return self.step.step(ids[:, None], _LibraryCache(positions, key_padding, keys, values))

    def traceable(self, product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> AbstractContextManager:
        """While traced: every product of the step as `product(x, weight)`, and RoPE's readable rotation, which
        inductor fuses into the step's loops (the complex one that decoding installs, complex_rope.py, has no C++
        kernel in the library and goes back to ATen). What was installed comes back after."""
        hooks = [(linear_, "matmul", product) for linear_ in self.fused]
        hooks += [(rope, "rotate", rotate_pairs) for rope in self.model.modules()
                  if isinstance(rope, RotaryPositionalEmbedding)]
        return swapped(hooks)


def _summed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x Wᵀ as the sum over the input features of x·W: (B, in) -> (B, out). Inductor writes it as one loop over W's
    rows (a matrix-vector product, vectorized and split across threads), with no (B, out, in) temporary."""
    return (x[..., None, :] * weight).sum(-1)


def _in_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x Wᵀ of bf16 x and W as a float32 product rounded back once. Frozen, W's float32 copy is a constant that
    inductor packs for oneDNN: without bf16 arithmetic, faster than its bf16 product (docs/benchmarks.md)."""
    return linear(x.float(), weight.float()).to(x.dtype)
