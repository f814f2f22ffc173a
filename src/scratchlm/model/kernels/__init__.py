"""Speed paths for the model: faster implementations of the math in model/, switched on from outside.

model/ is the readable algorithm, and it is what runs unless something here is applied. Each module below
implements one of the model's swappable contracts, says on which hardware it wins, and is proven equal to the
readable path (values and gradients) in tests/test_kernels.py:

| module            | stands in for                                    | wins on                                   |
|-------------------|--------------------------------------------------|-------------------------------------------|
| chunked_attention | `MultiHeadSelfAttention.attention_core`          | CPU (cache blocking); elsewhere one chunk |
| fused_attention   | `MultiHeadSelfAttention.attention_core`          | CUDA (torch's fused SDPA); opt-in on CPU  |
| grouped_attention | `attention_core`, within `decoding`              | CPU decoding (KV heads not repeated)      |
| complex_rope      | `RotaryPositionalEmbedding.rotate`               | every device (1 pass over x, not 7)       |
| fused_swiglu      | `SwiGLU.hidden`                                  | every device (6 passes over d_ff, not 11) |
| few_rows_linear   | `Linear.matmul`                                  | CPU, float32, <= 16 rows (decoding)       |
| packed_linear     | `Linear.matmul`, within `decoding`               | CPU with oneDNN (bf16 packs: bf16 ISA)    |
| decode_step       | `TransformerLM.forward` of decoding and prefills | CPU decoding (fewer, larger ops)          |
| compiled_step     | decode_step's one-token steps, opt-in            | CPU: bf16 and float32, any batch          |

decode_step and compiled_step are built from the model's own pieces, so each piece of a block is computed in
one place, model/. The trainer applies them (`apply`, train/setup.py) and the generator decodes under
`decoding(model)`. A kernel checks its conditions on every call (device, dtype, oneDNN's ops, the ISA that cpu.py
allows) and otherwise computes the readable way; `readable(model)` puts every module back on the readable path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from scratchlm.model.attention import MultiHeadSelfAttention, RotaryPositionalEmbedding, causal_attention, rotate_pairs
from scratchlm.model.kernels import compiled_step, decode_step
from scratchlm.model.kernels.chunked_attention import chunked_causal_attention
from scratchlm.model.kernels.complex_rope import rotate_as_complex
from scratchlm.model.kernels.few_rows_linear import few_rows_linear
from scratchlm.model.kernels.fused_attention import fused_causal_attention
from scratchlm.model.kernels.fused_swiglu import fused_swiglu
from scratchlm.model.kernels.grouped_attention import grouped_causal_attention
from scratchlm.model.kernels.packed_linear import packed_weights
from scratchlm.model.kernels.swap import swapped
from scratchlm.model.layers import Linear, linear
from scratchlm.model.transformer import SwiGLU

# Each swappable contract: the module type, its attribute, and the readable function it holds by default.
_HOOKS = ((MultiHeadSelfAttention, "attention_core", causal_attention),
          (RotaryPositionalEmbedding, "rotate", rotate_pairs),
          (Linear, "matmul", linear),
          (SwiGLU, "hidden", SwiGLU.hidden))


def choices(device: torch.device | str, fused_attention: bool | None = None) -> dict[type, object]:
    """The fastest implementation of each contract on `device` for training. fused_attention None: torch's fused
    SDPA on CUDA, the chunked core elsewhere; True/False forces one or the other."""
    device = torch.device(device)
    if fused_attention is None:
        fused_attention = device.type == "cuda"
    core = fused_causal_attention if fused_attention else chunked_causal_attention
    return {MultiHeadSelfAttention: core, RotaryPositionalEmbedding: rotate_as_complex,
            Linear: few_rows_linear if device.type == "cpu" else linear, SwiGLU: fused_swiglu}


def apply(model: nn.Module, device: torch.device | str | None = None, *,
          fused_attention: bool | None = None) -> nn.Module:
    """Switch every attention core, RoPE, Linear and SwiGLU of `model` to the fastest path on `device` (default: where
    its parameters are); returns the model. State-dict names and results are unchanged."""
    _install(model, choices(device or _device_of(model), fused_attention))
    return model


def readable(model: nn.Module) -> nn.Module:
    """Put every module of `model` back on the readable path of model/; returns the model."""
    _install(model, {kind: default for kind, _, default in _HOOKS})
    return model


Step = Callable[..., torch.Tensor]  # (ids (B, T), kv_cache, attention_mask=None) -> last logits (B, 1, V)


@contextmanager
def decoding(model: nn.Module, compile: bool = False, batch: int | None = None) -> Iterator[Step]:
    """What generate() and the server decode under; yields the step to call instead of `model(ids,
    kv_cache=cache, attention_mask=mask, last_only=True)`: decode_step.py's fused step where the model has its
    shape (else the forward itself). Inside, `apply`'s choices for the model's device on each module still on
    the readable path (kernels the caller applied stay), then on CPU the step's weights packed for oneDNN
    (packed_linear.py) where steps of `batch` rows (None: any number) use the packs. With `compile`, one-token
    steps run compiled (compiled_step.py: bf16 and float32; other models and calls decode as without). Every
    module gets its previous implementation back on exit."""
    device = _device_of(model)
    chosen = choices(device)
    if device.type == "cpu":
        chosen[MultiHeadSelfAttention] = grouped_causal_attention
    step, packed, modules = forward_step(model), model, list(model.modules())
    if decode_step.supports(model) and decode_step.fused_bytes(model) <= decode_step.MAX_FUSED_BYTES:
        step = fused = decode_step.DecodeStep(model)
        packed = fused.linears
        modules = list(dict.fromkeys([*modules, *fused.linears]))  # and the step's concatenated copies
        if compile and compiled_step.supports(model):
            step = _with_compiled(compiled_step.compiled_for(model), fused)
    with swapped(_hooks(modules, chosen, only_readable=True)), packed_weights(packed, batch):
        yield step


def _with_compiled(compiled: compiled_step.CompiledStep, eager: Step) -> Step:
    """The compiled step for the calls it computes, `eager` for the others."""
    def step(ids: torch.Tensor, kv_cache, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if compiled.applies(ids, kv_cache, attention_mask):
            try:
                return compiled(ids, kv_cache)
            except compiled_step.CompileFailed as error:  # it failed before running: nothing written
                compiled.give_up(error)
        return eager(ids, kv_cache, attention_mask)

    return step


def forward_step(model: nn.Module) -> Step:
    """The model's own forward as a decoding Step."""
    def step(ids: torch.Tensor, kv_cache, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return model(ids, kv_cache=kv_cache, attention_mask=attention_mask, last_only=True)

    return step


def _install(model: nn.Module, chosen: dict[type, object]) -> None:
    for module, attribute, implementation in _hooks(model.modules(), chosen, only_readable=False):
        setattr(module, attribute, implementation)


def _hooks(modules: Iterable[nn.Module], chosen: dict[type, object],
           only_readable: bool) -> list[tuple[nn.Module, str, object]]:
    """(module, attribute, chosen[kind]) for each swappable contract of `modules`; with `only_readable`, only
    those still on the readable path."""
    return [(module, attribute, chosen[kind]) for module in modules for kind, attribute, default in _HOOKS
            if isinstance(module, kind) and (not only_readable or getattr(module, attribute) is default)]


def _device_of(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")
