"""ModelConfig: the shape and architecture switches of a TransformerLM, plus named presets.

The config is the single source of truth for a model: the trainer saves it beside every checkpoint, and
`TransformerLM(config)` rebuilds the same model from it. Ablations are switches here, never forks of the
model code. Some fields may be derived: ``d_ff`` from the FFN kind, ``num_kv_heads`` (= ``num_heads``) and
``head_dim`` (= ``d_model / num_heads``) from the head count, and ``vocab_size``, which a training config may
leave out: train sets it to the tokenizer's vocabulary size (rounded up to ``pad_vocab_to``).

The switches that real pretrained checkpoints use default to off, so an old saved config (without them) loads
as the same model: grouped-query attention (``num_kv_heads`` < ``num_heads``; 1 is multi-query), a head size
independent of ``d_model`` (``head_dim``), q/k/v biases (``qkv_bias``) and Llama 3's RoPE frequency scaling
(``rope_scaling = "llama3"`` with its four ``rope_*`` parameters, read only then).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

NORMS = ("rmsnorm", "layernorm", "none")
NORM_POSITIONS = ("pre", "post")
POSITIONS = ("rope", "nope")
FFNS = ("swiglu", "silu", "relu2")
ROPE_SCALINGS = ("none", "llama3")
_ZERO_ALLOWED = {"norm_eps": ">= 0", "logit_softcap": ">= 0 (0: no cap)"}  # the other float fields must be > 0


def _is_finite_number(value: Any) -> bool:
    """A real int or float, not bool (True would pass as 1), nan or inf."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


def swiglu_hidden_size(d_model: int, multiple_of: int = 64) -> int:
    """≈ 8/3 · d_model rounded up to a multiple of 64: keeps SwiGLU's 3 matrices at the 2-matrix FFN's cost."""
    return round_up(math.ceil(8 * d_model / 3), multiple_of)


@dataclass
class ModelConfig:
    vocab_size: int | None = None  # None: the tokenizer's, filled in by train (train/tokenizer_identity.py)
    pad_vocab_to: int = 1  # vocab_size is rounded up to a multiple of this (64: faster GPU matmuls); 1: as is
    context_length: int = 256
    d_model: int = 512
    num_layers: int = 4
    num_heads: int = 16
    num_kv_heads: int | None = None  # None: num_heads; fewer (dividing it): grouped-query attention; 1: multi-query
    head_dim: int | None = None  # None: d_model / num_heads; given: any even size (Qwen3-0.6B: d 1024, 16 × 128)
    d_ff: int | None = None  # None: derived from `ffn` (SwiGLU ≈ 8/3·d rounded to 64; SiLU and ReLU² FFNs 4·d)
    rope_theta: float = 10_000.0
    rope_scaling: str = "none"  # none | llama3 (Llama 3.1's long-context rule on the RoPE frequencies)
    rope_scaling_factor: float = 8.0  # llama3: long wavelengths are divided by this
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original_context / this are scaled
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original_context / this are kept
    rope_original_context: int = 8192  # llama3: the context length the model was first trained at
    norm: str = "rmsnorm"  # rmsnorm | layernorm | none
    norm_position: str = "pre"  # pre | post
    position: str = "rope"  # rope | nope
    ffn: str = "swiglu"  # swiglu | silu | relu2 (squared ReLU, modded-nanogpt)
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    qk_norm: bool = False  # RMSNorm of each head's q and k before RoPE: bounds the attention logits
    qkv_bias: bool = False  # q, k and v projections add a bias (Qwen2); the output projection never does
    zero_init_residual: bool = False  # attention output and FFN down projections start at 0 (blocks start as identity)
    logit_softcap: float = 0.0  # logits -> cap · tanh(logits / cap); 0: no cap

    def __post_init__(self) -> None:
        for name in ("pad_vocab_to", "context_length", "d_model", "num_layers", "num_heads"):
            self._check_positive_int(name)
        if self.vocab_size is not None:
            self._check_positive_int("vocab_size")
            self.vocab_size = round_up(self.vocab_size, self.pad_vocab_to)
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        self._check_positive_int("num_kv_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_kv_heads ({self.num_kv_heads}) must divide model.num_heads "
                             f"({self.num_heads}): each KV head serves an equal group of query heads")
        if self.head_dim is None:
            if self.d_model % self.num_heads:
                raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.num_heads "
                                 f"({self.num_heads}), or give model.head_dim")
            self.head_dim = self.d_model // self.num_heads
        self._check_positive_int("head_dim")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got model.head_dim = {self.head_dim}")
        for name, allowed in (("norm", NORMS), ("norm_position", NORM_POSITIONS), ("position", POSITIONS),
                              ("ffn", FFNS), ("rope_scaling", ROPE_SCALINGS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"model.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.d_ff is None:
            self.d_ff = swiglu_hidden_size(self.d_model) if self.ffn == "swiglu" else 4 * self.d_model
        self._check_positive_int("d_ff")
        for name in ("rope_theta", "norm_eps", "rope_scaling_factor", "rope_low_freq_factor",
                     "rope_high_freq_factor", "logit_softcap"):
            value, bound = getattr(self, name), _ZERO_ALLOWED.get(name, "> 0")
            if not _is_finite_number(value) or value < 0 or (value == 0 and bound == "> 0"):
                raise ValueError(f"model.{name} must be a finite number {bound}, got {value!r}")
        if self.rope_high_freq_factor <= self.rope_low_freq_factor:  # the llama3 rule divides by their difference
            raise ValueError(f"model.rope_high_freq_factor ({self.rope_high_freq_factor}) must be greater than "
                             f"model.rope_low_freq_factor ({self.rope_low_freq_factor})")
        self._check_positive_int("rope_original_context")
        for name in ("tie_embeddings", "qk_norm", "qkv_bias", "zero_init_residual"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model.{name} must be true or false, got {getattr(self, name)!r}")

    def _check_positive_int(self, name: str) -> None:
        value = getattr(self, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"model.{name} must be a positive integer, got {value!r}")

    def non_embedding_params(self, total: int) -> int:
        """`total` parameters less the input token-embedding table (V·d): the one non-embedding count, used by
        `TransformerLM.num_parameters` and the accounting report. A table tied to lm_head is the output layer
        too and stays counted; an untied lm_head always counts (it is a matmul of every forward pass)."""
        return total if self.tie_embeddings else total - self.vocab_size * self.d_model

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; valid keys: {sorted(known)}")
        return cls(**values)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset, optionally with some fields overridden (an ablation = preset + a small diff)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})


_GPT2 = dict(vocab_size=50_257, context_length=1024)

PRESETS: dict[str, dict[str, Any]] = {
    # Small enough that a forward+backward takes milliseconds on a CPU: used by the tests.
    "tiny": dict(vocab_size=256, context_length=32, d_model=64, num_layers=2, num_heads=4, d_ff=128),
    # The CS336 assignment-1 TinyStories model (17.6M non-embedding parameters, 22.7M in all).
    "tinystories-17m": dict(vocab_size=10_000, context_length=256, d_model=512, num_layers=4, num_heads=16,
                            d_ff=1344, rope_theta=10_000.0),
    # GPT-2 shapes with this architecture (SwiGLU with d_ff = 4·d as in the CS336 accounting exercise).
    "gpt2-small": dict(**_GPT2, d_model=768, num_layers=12, num_heads=12, d_ff=4 * 768),
    "gpt2-medium": dict(**_GPT2, d_model=1024, num_layers=24, num_heads=16, d_ff=4 * 1024),
    "gpt2-large": dict(**_GPT2, d_model=1280, num_layers=36, num_heads=20, d_ff=4 * 1280),
    "gpt2-xl": dict(**_GPT2, d_model=1600, num_layers=48, num_heads=25, d_ff=4 * 1600),
}
