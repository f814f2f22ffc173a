"""Parameter counts and forward/training FLOPs of a TransformerLM, by component, from closed formulas.

Everything here is arithmetic on a `ModelConfig`: nothing is built, so a GPT-2 XL plan costs microseconds.
The formulas follow the model exactly (tests compare them with `sum(p.numel())` of the built model and with
`torch.utils.flop_counter.FlopCounterMode` on a real forward pass):

Parameters (d = d_model, f = d_ff, V = vocab, L = layers, n = norm parameters per norm: d for RMSNorm,
2d for LayerNorm (weight + bias), 0 for none; q = H·d_h the query width and k = H_kv·d_h the key/value width,
for H heads, H_kv KV heads and head size d_h; q = k = d for multi-head attention with d_h = d/H):
    embeddings V·d;  per layer: attention 2dq + 2dk (Q and output d×q, K and V d×k; = 4d² for multi-head
    attention) plus q + 2k with q/k/v biases, FFN 3df (SwiGLU) or 2df (SiLU), 2 norms 2n (+ 2d_h with
    QK-norm); final norm n;  LM head V·d (0 when tied to the embeddings). RoPE scaling has no parameters.
    SwiGLU with f = 4d, RMSNorm, multi-head, untied: P = L(16d² + 2d) + 2Vd + d.

Forward matmul FLOPs for B sequences of T tokens (a matmul (m×k)·(k×n) costs 2mkn):
    attention projections 2BTd·(2q + 2k) per layer (8BTd² multi-head); attention scores QKᵀ 2BT²q; weighted
    values AV 2BT²q; FFN 6BTdf (SwiGLU) or 4BTdf (SiLU); LM head 2BTdV.
Grouped-query attention saves K/V projection work, not core work: each of the H query heads still scores
against its (shared) KV head. The causal mask does not halve the core: our attention computes the full T×T
scores, as most kernels without block skipping do. Elementwise work (norms, softmax, RoPE, SiLU, bias adds) is
O(BTd + BhT²), below 1% and left out, as FlopCounterMode does. Training ≈ 3 × forward (backward computes two
matmuls per forward matmul: the gradients with respect to the input and to the weight).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from scratchlm.model.config import ModelConfig

# AdamW update per parameter: m = β1·m + (1-β1)·g (3), v = β2·v + (1-β2)·g² (4),
# p -= lr·wd·p (2), p -= lr · m̂ / (√v̂ + ε) with bias corrections folded into scalars (5: sqrt, add, div, mul, sub).
ADAMW_FLOPS_PER_PARAM = 14


def norm_params(config: ModelConfig) -> int:
    """Parameters of one normalization layer."""
    return {"rmsnorm": config.d_model, "layernorm": 2 * config.d_model, "none": 0}[config.norm]


def attention_widths(config: ModelConfig) -> tuple[int, int]:
    """(q, k): the output width of the query projection, H·d_h, and of each key/value projection, H_kv·d_h."""
    return config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim


def qkv_bias_params(config: ModelConfig) -> int:
    """Bias parameters of one layer's q, k and v projections: q + 2k with qkv_bias, else 0."""
    q, k = attention_widths(config)
    return q + 2 * k if config.qkv_bias else 0


def kv_cache_bytes_per_token(config: ModelConfig, bytes_per_element: int = 4) -> int:
    """Bytes one token's keys and values take in the KV cache: 2 (K and V) · L · H_kv · d_h elements (fp32: 4 B
    each, bf16: 2 B); grouped-query attention divides it by H / H_kv."""
    return 2 * config.num_layers * attention_widths(config)[1] * bytes_per_element


def ffn_matrices(config: ModelConfig) -> int:
    """Weight matrices of size d_model × d_ff in one FFN: SwiGLU has w1, w2, w3; the SiLU FFN w1, w2."""
    return 3 if config.ffn == "swiglu" else 2


@dataclass(frozen=True)
class ParamCounts:
    """Trainable parameters by component (whole model, all layers)."""

    embeddings: int
    attention: int  # Q, K, V and output projections (and the q/k/v biases with qkv_bias)
    ffn: int
    norms: int  # the two norms of every block (and its q/k norms with QK-norm)
    final_norm: int
    lm_head: int  # 0 when tied to the embeddings

    @property
    def total(self) -> int:
        return sum(asdict(self).values())


def count_params(config: ModelConfig) -> ParamCounts:
    d, layers = config.d_model, config.num_layers
    q, k = attention_widths(config)
    return ParamCounts(
        embeddings=config.vocab_size * d,
        attention=layers * (2 * d * q + 2 * d * k + qkv_bias_params(config)),
        ffn=layers * ffn_matrices(config) * d * config.d_ff,
        norms=layers * (2 * norm_params(config) + (2 * config.head_dim if config.qk_norm else 0)),
        final_norm=norm_params(config),
        lm_head=0 if config.tie_embeddings else config.vocab_size * d,
    )


@dataclass(frozen=True)
class ForwardFlops:
    """Forward-pass matmul FLOPs by component for `batch` sequences of `context` tokens."""

    attention_proj: int  # Q, K, V and output projections
    attention_scores: int  # Q·Kᵀ
    attention_values: int  # softmax(QKᵀ)·V
    ffn: int
    lm_head: int

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def shares(self) -> dict[str, float]:
        """Fraction of the forward FLOPs spent in each component."""
        total = self.total
        return {name: value / total for name, value in asdict(self).items()}


def forward_flops(config: ModelConfig, context: int, batch: int = 1) -> ForwardFlops:
    if context <= 0 or batch <= 0:
        raise ValueError(f"context and batch must be positive, got context={context}, batch={batch}")
    d, layers, tokens = config.d_model, config.num_layers, batch * context
    q, k = attention_widths(config)
    return ForwardFlops(
        attention_proj=layers * 2 * tokens * d * (2 * q + 2 * k),
        attention_scores=layers * 2 * tokens * context * q,  # per head 2·T·T·d_h, times H query heads
        attention_values=layers * 2 * tokens * context * q,
        ffn=layers * 2 * tokens * d * config.d_ff * ffn_matrices(config),
        lm_head=2 * tokens * d * config.vocab_size,
    )


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one optimizer step: forward, backward (2 × forward) and the AdamW update."""

    forward: int
    backward: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.optimizer


def training_step_flops(config: ModelConfig, context: int, batch: int) -> StepFlops:
    fwd = forward_flops(config, context, batch).total
    return StepFlops(forward=fwd, backward=2 * fwd, optimizer=ADAMW_FLOPS_PER_PARAM * count_params(config).total)


@dataclass(frozen=True)
class MatrixCost:
    """One weight matrix or matmul of the model: its shape, parameters and forward FLOPs over all layers."""

    name: str
    shape: str  # the operand shapes, as the handout writes them
    per_layer: bool  # repeated in each of the L layers (the counts below are for all of them)
    params: int
    forward_flops: int


def matrix_table(config: ModelConfig, context: int, batch: int = 1) -> list[MatrixCost]:
    """Every matrix and matmul of the model, one row each (Q, K, V, O, QKᵀ, AV, W1, W2, W3, LM head), plus the
    FLOP-free rows that hold parameters (embeddings, norms), so that the rows add up to `count_params(...).total`
    and `forward_flops(...).total`: the handout's per-matrix accounting, by one shared set of formulas."""
    params, flops = count_params(config), forward_flops(config, context, batch)
    d, f, layers, v = config.d_model, config.d_ff, config.num_layers, config.vocab_size
    q, k = attention_widths(config)
    tokens = batch * context
    ffn_names = ("W1", "W2", "W3") if config.ffn == "swiglu" else ("W1", "W2")
    ffn_shapes = {"W1": f"d_ff×d = {f}×{d}", "W2": f"d×d_ff = {d}×{f}", "W3": f"d_ff×d = {f}×{d}"}
    dk, h = config.head_dim, config.num_heads
    bias = " + bias" if config.qkv_bias else ""
    rows = [MatrixCost("embeddings", f"V×d = {v}×{d}", False, params.embeddings, 0)]
    rows += [MatrixCost(name, f"{width_name}×d = {width}×{d}{bias}", True,
                        layers * (width * d + (width if config.qkv_bias else 0)), layers * 2 * tokens * d * width)
             for name, width_name, width in (("Q", "H·d_h", q), ("K", "H_kv·d_h", k), ("V", "H_kv·d_h", k))]
    rows += [MatrixCost("QKᵀ", f"{h} × (T×{dk})·({dk}×T)", True, 0, flops.attention_scores),
             MatrixCost("AV", f"{h} × (T×T)·(T×{dk})", True, 0, flops.attention_values),
             MatrixCost("O", f"d×H·d_h = {d}×{q}", True, layers * d * q, layers * 2 * tokens * d * q)]
    rows += [MatrixCost(name, ffn_shapes[name], True, layers * d * f, flops.ffn // len(ffn_names))
             for name in ffn_names]
    rows += [MatrixCost("norms", f"{norm_params(config)} per norm, 2L + 1 norms", True,
                        params.norms + params.final_norm, 0),
             MatrixCost("LM head" + (" (tied)" if config.tie_embeddings else ""), f"V×d = {v}×{d}", False,
                        params.lm_head, flops.lm_head)]
    return rows


def six_n_d_flops(params: int, tokens: float) -> float:
    """The rule-of-thumb training cost 6·N·D: 2 FLOPs per parameter per token forward, 4 backward. It leaves out
    the T² attention core and counts the embedding lookup as a matmul; `3 × forward` is the exact count."""
    return 6 * params * tokens
