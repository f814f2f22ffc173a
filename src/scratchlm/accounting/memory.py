"""Training-memory estimate, the largest batch that fits, and time to train.

Memory of a training step = static state + activations saved for backward.

Static state, per parameter: fp32 weights 4 B, fp32 gradients 4 B, AdamW's two fp32 moments 8 B: 16 B.
With ``bf16`` (autocast, fp32 master weights) the static state is the same 16 B plus the bf16 copies of the
matmul weights that autocast caches for the duration of the forward pass (2 B per matmul weight).

Activations are counted per sequence of T tokens in elements, by two models (see `activation_elements`):
- ``cs336``: the CS336 assignment-1 accounting exercise: one tensor per listed op, per layer
  16·T·d + 2·h·T² (scores and softmax probabilities per head), plus T·d (final norm) + T·V (logits) + T (loss)
  (for multi-head attention with d_h = d/h; see `_cs336_counts` for the query and KV widths in general).
- ``scratchlm`` (default): what OUR implementation really keeps for backward, read from the code and checked
  exactly with ``torch.autograd.graph.saved_tensors_hooks`` in the tests. It also keeps the SwiGLU gate
  tensors, the float32 norm internals and the loss's shifted logits, plus a few batch-independent tensors
  (`step_constant_bytes`) and the logits gradient that exists before backward frees anything.
Activation bytes: 4 per element in fp32. Under bf16 autocast we charge 2 B for the matmul-side tensors and 4 B
for the norm internals and the loss (they run in float32) - an approximation: the tests check fp32 only.

Attention tensors scale with the query width q = H·d_h (d with multi-head attention and d_h = d/H) or the KV
width k = H_kv·d_h. Grouped-query attention saves no activations in our code: the attention core works on the
K/V heads repeated over their groups, and those (T·q) copies are what its backward keeps. It saves KV-cache
memory when decoding (params_flops.kv_cache_bytes_per_token).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from scratchlm.accounting.params_flops import attention_widths, count_params, forward_flops, qkv_bias_params
from scratchlm.model.config import ModelConfig

DTYPES = ("fp32", "bf16")
ACTIVATION_MODELS = ("scratchlm", "cs336")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_memory(text: str) -> int:
    """Bytes in '80GB' (10⁹), '80GiB' (2³⁰), '512MB', '1e9'; a clear ValueError for anything else."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"memory size {text!r} not understood; write e.g. 80GB (10^9 bytes) or 80GiB (2^30 bytes)")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return int(value)


@dataclass(frozen=True)
class ActivationElements:
    """Elements saved for backward for ONE sequence of `context` tokens, by component (all layers)."""

    norms: int  # per-layer norms: input and normalized copy (T·d each) and 1/rms (T)
    attention: int  # QKV input (T·d); Q, K, V and the output-projection input (T·q each, ours)
    attention_scores: int  # the h·T² terms: the softmax output, kept once (ours); scores + probs (cs336)
    ffn: int  # FFN input (T·d) and the T·d_ff-sized gate/up/SiLU tensors
    final_norm: int  # ln_final internals and the LM head input
    logits: int  # what the loss keeps: its T·V softmax and the targets (ours); logits + loss (cs336)

    @property
    def total(self) -> int:
        return sum(asdict(self).values())


def activation_elements(config: ModelConfig, context: int, model: str = "scratchlm") -> ActivationElements:
    if model not in ACTIVATION_MODELS:
        raise ValueError(f"activation model must be one of {ACTIVATION_MODELS}, got {model!r}")
    c = _cs336_counts(config) if model == "cs336" else _scratchlm_counts(config)
    t, d, f, h, v, layers = context, config.d_model, config.d_ff, config.num_heads, config.vocab_size, config.num_layers
    q, k = attention_widths(config)
    return ActivationElements(
        norms=layers * (c["norm_td"] * t * d + c["norm_t"] * t),
        attention=layers * (c["attn_td"] * t * d + c["attn_tq"] * t * q + c["attn_tk"] * t * k),
        attention_scores=layers * c["attn_htt"] * h * t * t,
        ffn=layers * (c["ffn_td"] * t * d + c["ffn_tf"] * t * f),
        final_norm=c["final_td"] * t * d + c["final_t"] * t,
        logits=c["logits_tv"] * t * v + c["logits_t"] * t,
    )


def _cs336_counts(config: ModelConfig) -> dict[str, int]:
    """One output tensor per op in the CS336 list: 2 RMSNorms, Q (T·q), K and V (T·k each), QKᵀ, softmax, AV
    (T·q), output projection (T·d), W1, SiLU, W2; final RMSNorm, output embedding (logits), cross-entropy
    (per-token losses). With d_ff = 4d and multi-head attention this is 16·T·d + 2·h·T² per layer."""
    norms = 0 if config.norm == "none" else 1
    return dict(norm_td=2 * norms, norm_t=0, attn_td=1, attn_tq=2, attn_tk=2, attn_htt=2, ffn_td=1, ffn_tf=2,
                final_td=norms, final_t=0, logits_tv=1, logits_t=1)


def _scratchlm_counts(config: ModelConfig) -> dict[str, int]:
    """What our code keeps (read from model/layers.py, attention.py, transformer.py and train/loss.py):
    - each RMSNorm/LayerNorm: its float32 input (or centered input), the normalized copy, and 1/rms (T);
    - attention: the Q/K/V projections' shared input (T·d), contiguous copies of Q, Kᵀ and V (the batched-matmul
      operands; K and V repeated over the query heads) and the output projection's input (heads merged): 4·T·q
      (5·T·d for multi-head attention); bias adds keep nothing; the softmax output: h·T², ONE tensor
      shared by the in-place softmax's backward and the probs @ V bmm (the mask and 1/√d_k ride along in the
      QKᵀ baddbmm, whose backward keeps Q and K, not the scores);
    - SwiGLU: its input, W1x and W3x (kernels/fused_swiglu.py's backward recomputes SiLU(W1x)) and the product:
      T·d + 3·T·d_ff (SiLU FFN: T·d + 2·T·d_ff; ReLU² FFN: W1x, its ReLU and the square, T·d + 3·T·d_ff);
    - ln_final internals (2·T·d + T) and the LM head input (T·d);
    - cross_entropy: its softmax (T·V) and the int64 targets (2·T), kept by its hand-written backward.
    """
    norm = config.norm != "none"
    return dict(norm_td=4 * norm, norm_t=2 * norm, attn_td=1, attn_tq=4, attn_tk=0, attn_htt=1,
                ffn_td=1, ffn_tf={"swiglu": 3, "silu": 2, "relu2": 3}[config.ffn],
                final_td=1 + 2 * norm, final_t=norm, logits_tv=1, logits_t=2)


def step_constant_bytes(config: ModelConfig, context: int, model: str = "scratchlm") -> dict[str, int]:
    """Activations that do not grow with the batch (ours only): the RoPE rotations the complex multiply keeps
    (a complex64 slice of each layer's table buffer, T·d_head/2 · 8 bytes, shared by Q and K; the per-parameter
    static count leaves buffers out). The causal mask is the QKᵀ baddbmm's bias input, which autograd does not
    keep, and Q/K/V are three projections, so no concatenated weight copy is kept."""
    if model == "cs336":
        return {}
    rope = config.num_layers * context * config.head_dim * 4 if config.position == "rope" else 0
    return {"rope_tables": rope}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of one training step at `batch` × `context` tokens."""

    dtype: str
    batch: int
    context: int
    activation_model: str
    parameters: int
    gradients: int
    optimizer_state: int
    autocast_weights: int  # bf16 weight copies cached by autocast (0 in fp32)
    step_constant: dict[str, int]  # activations that do not scale with the batch
    activations: dict[str, int]  # bytes by component, whole batch (incl. the transient logits gradient)

    @property
    def static(self) -> int:
        """Bytes that do not depend on the batch size."""
        return (self.parameters + self.gradients + self.optimizer_state + self.autocast_weights
                + sum(self.step_constant.values()))

    @property
    def activation_total(self) -> int:
        return sum(self.activations.values())

    @property
    def total(self) -> int:
        return self.static + self.activation_total

    def breakdown(self) -> dict[str, int]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer_state": self.optimizer_state,
                "autocast_weights": self.autocast_weights, **self.step_constant,
                **{f"activations.{name}": value for name, value in self.activations.items()}}


def _activation_bytes(elements: ActivationElements, dtype: str) -> dict[str, int]:
    # bf16 autocast: matmul outputs and inputs are bf16; norms keep float32 copies, the loss runs in float32.
    wide = {"norms", "final_norm", "logits"}
    return {name: (4 if dtype == "fp32" or name in wide else 2) * value for name, value in asdict(elements).items()}


def estimate_memory(config: ModelConfig, context: int, batch: int, dtype: str = "fp32",
                    activation_model: str = "scratchlm") -> MemoryEstimate:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if context <= 0 or batch <= 0:
        raise ValueError(f"context and batch must be positive, got context={context}, batch={batch}")
    params = count_params(config)
    biases = config.num_layers * qkv_bias_params(config)  # added outside the matmuls: autocast caches no copy
    matmul_weights = params.attention - biases + params.ffn + (params.lm_head or params.embeddings)
    per_sequence = _activation_bytes(activation_elements(config, context, activation_model), dtype)
    if activation_model == "scratchlm":  # the logits gradient appears before backward frees anything
        per_sequence["logits_grad"] = 4 * context * config.vocab_size
    return MemoryEstimate(
        dtype=dtype, batch=batch, context=context, activation_model=activation_model,
        parameters=4 * params.total, gradients=4 * params.total, optimizer_state=8 * params.total,
        autocast_weights=2 * matmul_weights if dtype == "bf16" else 0,
        step_constant=step_constant_bytes(config, context, activation_model),
        activations={name: batch * value for name, value in per_sequence.items()},
    )


def max_batch_size(config: ModelConfig, context: int, memory_bytes: int, dtype: str = "fp32",
                   activation_model: str = "scratchlm") -> int:
    """Largest batch whose estimate fits in `memory_bytes` (0 when even the batch-independent part does not)."""
    one = estimate_memory(config, context, 1, dtype, activation_model)
    return max(0, (memory_bytes - one.static) // one.activation_total)


@dataclass(frozen=True)
class TrainingTime:
    tokens: float
    tokens_per_second: float
    seconds: float

    @property
    def days(self) -> float:
        return self.seconds / 86_400

    @property
    def years(self) -> float:
        return self.days / 365.25  # Julian years


def training_flops_per_token(config: ModelConfig, context: int) -> float:
    """3 × forward FLOPs per token (AdamW's per-step cost is amortized over a batch and left out)."""
    return 3 * forward_flops(config, context, batch=1).total / context


def time_to_train(config: ModelConfig, context: int, tokens: float, *, tokens_per_second: float | None = None,
                  peak_tflops: float | None = None, mfu: float | None = None) -> TrainingTime:
    """Wall time for `tokens` training tokens, at a measured throughput or at peak TFLOP/s × MFU."""
    if not 0 < tokens < math.inf:  # also refuses nan
        raise ValueError(f"tokens must be a finite positive number, got {tokens}")
    if tokens_per_second is None:
        if peak_tflops is None or mfu is None:
            raise ValueError("give either tokens_per_second or both peak_tflops and mfu")
        if peak_tflops <= 0 or not 0 < mfu <= 1:
            raise ValueError(f"need peak_tflops > 0 and 0 < mfu <= 1, got {peak_tflops} and {mfu}")
        tokens_per_second = peak_tflops * 1e12 * mfu / training_flops_per_token(config, context)
    if not 0 < tokens_per_second < math.inf:  # also refuses nan
        raise ValueError(f"tokens_per_second must be a finite positive number, got {tokens_per_second}")
    return TrainingTime(tokens=tokens, tokens_per_second=tokens_per_second, seconds=tokens / tokens_per_second)
