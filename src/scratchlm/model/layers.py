"""The building blocks of the Transformer, from tensor primitives: Linear, Embedding, norms, silu, softmax.

Each layer mirrors its torch counterpart (`nn.Linear` without bias, `nn.Embedding`, `nn.RMSNorm`,
`nn.LayerNorm`, `F.silu`, `torch.softmax`); tests/test_layers.py proves the equality on random and extreme
inputs. Design choices:
- Weights are stored as the reference does (`Linear.weight` is (out, in)), so CS336 reference state dicts load
  without any remapping.
- Norms compute in float32 and cast back: squaring a bf16/fp16 activation of magnitude ~300 overflows fp16
  (300² · d > 65504) and loses all precision in bf16.
- `softmax` is an autograd.Function with a hand-written backward: it saves only its output (like
  `torch.softmax`) instead of the four intermediates a chain of primitives would keep alive, which matters
  for the (B, H, T, T) attention scores.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from scratchlm.model import packed_matmul


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """x upcast to float32 when it is narrower (fp16/bf16); float32 and float64 pass through without a copy."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _trunc_normal_(tensor: torch.Tensor, std: float) -> torch.Tensor:
    """Normal(0, std²) truncated at ±3·std, in place."""
    return nn.init.trunc_normal_(tensor, mean=0.0, std=std, a=-3 * std, b=3 * std)


_FEW_ROWS = 16  # float32 inputs with at most this many rows take the W xᵀ path of Linear.forward on CPU


class Linear(nn.Module):
    """y = x Wᵀ without bias; W is (out_features, in_features), init N(0, 2/(in+out)) truncated at ±3σ."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        _trunc_normal_(self.weight, math.sqrt(2.0 / (in_features + out_features)))
        # (weight version, oneDNN-packed weight) while `packed_for_decoding` is on; used only while the weight
        # is unchanged since it was packed.
        self.packed: tuple[int, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self._use_packed(x, rows):
            return packed_matmul.linear(x, self.packed[1])
        if not self._faster_as_w_xt(x, rows):
            return x @ self.weight.t()  # (..., in) @ (in, out) -> (..., out)
        flat = x.reshape(rows, self.in_features)
        columns = torch.cat((flat, flat)).t() if rows == 1 else flat.t()  # a single row is doubled (see below)
        return (self.weight @ columns).t()[:rows].reshape(*x.shape[:-1], self.out_features)

    def _faster_as_w_xt(self, x: torch.Tensor, rows: int) -> bool:
        """Whether (W xᵀ)ᵀ beats x Wᵀ: for a few float32 rows on CPU (decoding), measured here.

        BLAS runs x Wᵀ with a row-major W through matrix-vector kernels at a third of memory speed or less, while
        W xᵀ, (out, in) @ (in, rows), streams W through the matrix-matrix kernel: 2.1x decoding tokens/s at
        batch 1 (one row doubled to reach that kernel), 1.3x at batch 8. The exception: from 2 rows on, a W wider
        than tall (the FFN's down projection) is faster as x Wᵀ (+7% tokens/s at batch 8).
        """
        if rows > _FEW_ROWS or x.device.type != "cpu" or x.dtype != torch.float32:
            return False
        return rows == 1 or self.in_features <= self.out_features

    def _use_packed(self, x: torch.Tensor, rows: int) -> bool:
        return (self.packed is not None and rows >= packed_matmul.MIN_ROWS and x.dtype == torch.float32
                and not torch.is_grad_enabled() and self.packed[0] == self.weight._version)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


@contextmanager
def packed_for_decoding(model: nn.Module, rows: int) -> Iterator[None]:
    """Within the block, the model's Linear layers multiply inputs of >= 3 rows (decoding `rows` sequences at
    once) by oneDNN-packed copies of their weights, when that helps: float32 weights on CPU, a torch with oneDNN,
    at most `packed_matmul.MAX_PACKED_BYTES` of weights (see model/packed_matmul.py). The copies are dropped on
    exit; layers already packed by an enclosing block are left to it."""
    layers = [layer for layer in model.modules() if isinstance(layer, Linear) and layer.packed is None
              and layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32]
    size = sum(layer.weight.nbytes for layer in layers)
    if rows < packed_matmul.MIN_ROWS or size > packed_matmul.MAX_PACKED_BYTES or not packed_matmul.available():
        layers = []
    for layer in layers:
        layer.packed = (layer.weight._version, packed_matmul.pack(layer.weight))
    try:
        yield
    finally:
        for layer in layers:
            layer.packed = None


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


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · g over the last dim, computed in (at least) float32, cast back."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = _at_least_float32(x)
        inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (..., 1)
        return (x32 * inv_rms * self.weight.to(x32.dtype)).to(x.dtype)

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


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU(x) = x · sigmoid(x)."""
    return x * torch.sigmoid(x)


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
