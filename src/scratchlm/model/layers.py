"""The building blocks of the Transformer, from tensor primitives: Linear, Embedding, norms, silu, softmax.

Each mirrors its torch counterpart (`nn.Linear`, `nn.Embedding`, `nn.RMSNorm`, `nn.LayerNorm`, `F.silu`,
`torch.softmax`; tests/test_layers.py proves the equality). Design choices:
- Weights are stored as the reference does (`Linear.weight` is (out, in)): CS336 state dicts load as they are.
- Norms compute in float32 and cast back: squaring a bf16/fp16 activation of magnitude ~300 overflows fp16
  (300² · d > 65504) and loses all precision in bf16.
- `softmax` and `silu` have hand-written backwards that save only their output / input, as torch's do, not the
  intermediates a chain of primitives would keep alive (which matters for the (B, H, T, T) attention scores).
- `Linear` computes x Wᵀ through its `matmul` attribute, which model/kernels/ may swap for faster equivalents; the
  optional bias is added after `matmul`, so every kernel computes x Wᵀ alone.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """x upcast to float32 when it is narrower (fp16/bf16); float32 and float64 pass through without a copy."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _trunc_normal_(tensor: torch.Tensor, std: float) -> torch.Tensor:
    """Normal(0, std²) truncated at ±3·std, in place."""
    return nn.init.trunc_normal_(tensor, mean=0.0, std=std, a=-3 * std, b=3 * std)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (..., in) @ Wᵀ (in, out) -> (..., out), for W stored (out, in) as the reference stores it."""
    return x @ weight.t()


class Linear(nn.Module):
    """y = x Wᵀ (+ b with bias=True); W is (out_features, in_features), init N(0, 2/(in+out)) truncated at ±3σ;
    b (out_features,) starts at 0. Without bias there is no `bias` parameter (the state dict holds W only)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        _trunc_normal_(self.weight, math.sqrt(2.0 / (in_features + out_features)))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        self.matmul = linear  # model/kernels/ may swap in a faster x Wᵀ (a few rows on CPU, packed weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.weight)
        # In y's dtype: under bf16 autocast y is bf16 and a float32 bias would promote the sum to float32
        # (autocast casts nn.Linear's bias with its weight the same way).
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# The dtypes torch indexes rows with. uint8 would be taken as a boolean mask (`weight[ids]` selects the rows
# where ids != 0), and its comparisons against a vocabulary size of 256 wrap around; int8/int16 are refused by
# torch's indexing with a less helpful message.
INDEX_DTYPES = (torch.int64, torch.int32)


def check_index_dtype(name: str, tensor: torch.Tensor) -> None:
    """A clear error unless `tensor` can index rows (int64 or int32): O(1), no device sync."""
    if tensor.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be an int64 or int32 tensor (convert with .long()), got dtype {tensor.dtype}")


class Embedding(nn.Module):
    """Lookup table (num_embeddings, embedding_dim), init N(0, 1) truncated at ±3; ids are int64 or int32."""

    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        _trunc_normal_(self.weight, 1.0)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        check_index_dtype("token ids", token_ids)
        return self.weight[token_ids]  # (...) -> (..., embedding_dim)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) · g over the last dim, computed in (at least) float32, cast back."""
    x32 = _at_least_float32(x)
    inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)  # (..., 1)
    return (x32 * inv_rms * weight.to(x32.dtype)).to(x.dtype)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · g over the last dim (`rms_norm`), with a learned gain g (d_model,)."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) · g + b over the last dim (biased variance, as nn.LayerNorm), in float32."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = _at_least_float32(x)
        centered = x32 - x32.mean(dim=-1, keepdim=True)
        inv_std = torch.rsqrt(centered.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (..., 1)
        return (centered * inv_std * self.weight.to(x32.dtype) + self.bias.to(x32.dtype)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class Identity(nn.Module):
    """The `norm = "none"` ablation: a norm slot that does nothing and holds no parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def make_norm(kind: str, d_model: int, eps: float, device=None, dtype=None) -> nn.Module:
    """The norm named by ModelConfig.norm: rmsnorm | layernorm | none."""
    if kind == "rmsnorm":
        return RMSNorm(d_model, eps, device=device, dtype=dtype)
    if kind == "layernorm":
        return LayerNorm(d_model, eps, device=device, dtype=dtype)
    if kind == "none":
        return Identity()
    raise ValueError(f"unknown norm {kind!r}; expected rmsnorm, layernorm or none")


class _SiLU(torch.autograd.Function):
    """SiLU with a hand-written backward that keeps only its input: d/dx x·σ(x) = σ(x) · (1 + x · (1 - σ(x))),
    with σ(x) recomputed. Autograd through x * sigmoid(x) would keep both x and σ(x): a second (..., d_ff)
    tensor per FFN (torch's F.silu keeps only x too)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        sigmoid = torch.sigmoid(x)
        return grad_y * sigmoid * (1 + x * (1 - sigmoid))


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU(x) = x · sigmoid(x). Without autograd (decoding) the same two ops without the Function around them,
    whose call costs as much as they do at a decoding step's sizes."""
    return _SiLU.apply(x) if x.requires_grad else x * torch.sigmoid(x)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """ReLU(x)² = max(x, 0)²."""
    return x.clamp_min(0).square()


class _Softmax(torch.autograd.Function):
    """Softmax with a hand-written backward that keeps only the output alive: dx = y ⊙ (dy - Σ dy ⊙ y)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int) -> torch.Tensor:
        # Subtracting the row max makes exp() overflow-free (largest term is exp(0) = 1). An empty `dim` has no
        # max (amax raises) and gives an empty result, as torch.softmax does.
        y = (x - x.amax(dim=dim, keepdim=True) if x.shape[dim] else x.clone()).exp_()
        y /= y.sum(dim=dim, keepdim=True)
        ctx.dim = dim
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        (y,) = ctx.saved_tensors
        return softmax_backward(y, grad_y, ctx.dim), None


def softmax_backward(y: torch.Tensor, grad_y: torch.Tensor, dim: int) -> torch.Tensor:
    """dx of y = softmax(x): y ⊙ dy - y ⊙ (Σ y ⊙ dy), with one full-size allocation instead of three."""
    grad_x = grad_y * y
    dot = grad_x.sum(dim=dim, keepdim=True)
    return grad_x.addcmul_(y, dot, value=-1.0)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Numerically stable softmax along `dim`. A row that is entirely -inf gives NaN, as torch.softmax does;
    attention handles fully masked rows itself (see attention.scaled_dot_product_attention)."""
    return _Softmax.apply(x, dim)
