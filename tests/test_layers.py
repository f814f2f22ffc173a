"""Each from-scratch layer against its torch counterpart, on random and extreme inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

from scratchlm.model.attention import Llama3Scaling, RotaryPositionalEmbedding, scaled_dot_product_attention
from scratchlm.model.layers import Embedding, LayerNorm, Linear, RMSNorm, silu, softmax


def test_linear_matches_nn_linear_over_leading_dims():
    ours = Linear(24, 40)
    ref = nn.Linear(24, 40, bias=False)
    ref.weight.data.copy_(ours.weight.data)
    x = torch.randn(2, 3, 5, 24)
    assert_close(ours(x), ref(x))
    assert ours.weight.shape == (40, 24)


def test_linear_with_bias_matches_nn_linear_with_gradients():
    ours = Linear(24, 40, bias=True)
    assert_close(ours.bias, torch.zeros(40))  # starts at 0
    ref = nn.Linear(24, 40)
    ref.weight.data.copy_(ours.weight.data)
    ours.bias.data.normal_()
    ref.bias.data.copy_(ours.bias.data)
    x = torch.randn(2, 5, 24, requires_grad=True)
    y = ours(x)
    assert_close(y, ref(x))
    grad = torch.randn_like(y)
    assert_close(torch.autograd.grad(y, (x, ours.weight, ours.bias), grad),
                 torch.autograd.grad(ref(x), (x, ref.weight, ref.bias), grad))
    assert set(ours.state_dict()) == {"weight", "bias"} and set(Linear(24, 40).state_dict()) == {"weight"}


@pytest.mark.parametrize("rows", [(1,), (1, 1), (3,), (2, 8), (17,), (4, 10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("d_in,d_out", [(24, 40), (40, 24)])
def test_linear_few_and_many_rows_match_nn_linear_with_gradients(rows, dtype, d_in, d_out):
    """Any number of rows, any dtype, W wider or taller: nn.Linear's values and gradients (the few-row shapes are
    where kernels/few_rows_linear.py takes over; tests/test_kernels.py holds it to this)."""
    ours = Linear(d_in, d_out, dtype=dtype)
    ref = nn.Linear(d_in, d_out, bias=False, dtype=dtype)
    ref.weight.data.copy_(ours.weight.data)
    x = torch.randn(*rows, d_in, dtype=dtype, requires_grad=True)
    y = ours(x)
    assert y.shape == (*rows, d_out)
    assert_close(y, ref(x))
    grad = torch.randn_like(y)
    assert_close(torch.autograd.grad(y, (x, ours.weight), grad), torch.autograd.grad(ref(x), (x, ref.weight), grad))


def test_linear_init_is_truncated_normal_with_xavier_std():
    w = Linear(600, 400).weight.detach()
    sigma = math.sqrt(2 / 1000)
    assert w.abs().max() <= 3 * sigma + 1e-7
    assert abs(w.mean().item()) < 0.01 * sigma * 10
    # Truncation at ±3σ shrinks the std by ≈ 1.3%.
    assert w.std().item() == pytest.approx(sigma * 0.9866, rel=0.02)


def test_embedding_matches_nn_embedding_and_init():
    ours = Embedding(1000, 64)
    ref = nn.Embedding(1000, 64)
    ref.weight.data.copy_(ours.weight.data)
    ids = torch.randint(0, 1000, (3, 7))
    assert_close(ours(ids), ref(ids))
    w = ours.weight.detach()
    assert w.abs().max() <= 3.0 and w.std().item() == pytest.approx(0.9866, rel=0.03)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0, 1e4])
def test_rmsnorm_matches_nn_rmsnorm(scale):
    ours = RMSNorm(48, eps=1e-5)
    ours.weight.data.uniform_(0.5, 1.5)
    ref = nn.RMSNorm(48, eps=1e-5)
    ref.weight.data.copy_(ours.weight.data)
    x = torch.randn(4, 5, 48) * scale
    assert_close(ours(x), ref(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rmsnorm_half_precision_at_magnitude_300_does_not_overflow(dtype):
    norm = RMSNorm(512).to(dtype)
    x32 = torch.randn(2, 8, 512) * 300
    out = norm(x32.to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()
    expected = (x32.to(dtype).float() * torch.rsqrt(x32.to(dtype).float().pow(2).mean(-1, keepdim=True) + 1e-5))
    assert_close(out, expected.to(dtype))
    # The naive half-precision formula overflows: what the float32 computation is there to prevent.
    if dtype == torch.float16:
        assert not torch.isfinite(x32.to(dtype).pow(2).sum(-1)).all()


def test_layernorm_matches_nn_layernorm():
    ours = LayerNorm(32)
    ours.weight.data.uniform_(0.5, 1.5)
    ours.bias.data.normal_()
    ref = nn.LayerNorm(32)
    ref.weight.data.copy_(ours.weight.data)
    ref.bias.data.copy_(ours.bias.data)
    for scale, offset in ((1e-2, 0.0), (1.0, 5.0), (1e3, 5.0)):
        x = torch.randn(3, 6, 32) * scale + offset
        assert_close(ours(x), ref(x), rtol=1e-4, atol=1e-5)
    # Tiny spread around a large mean is ill-conditioned in float32: judge both against float64 there.
    x = torch.randn(3, 6, 32) * 1e-2 + 5
    exact = ref.double()(x.double()).float()
    assert (ours(x) - exact).abs().max() <= 2 * (ref.float()(x) - exact).abs().max() + 1e-6


def test_silu_matches_f_silu_values_and_grads():
    x = torch.cat([torch.randn(1000) * 5, torch.tensor([-1e4, -100.0, 0.0, 100.0, 1e4])]).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = silu(x), F.silu(x_ref)
    assert_close(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax_matches_torch_including_huge_logits(dim):
    x = torch.randn(5, 7, 9) * 3
    x[0, 0, 0], x[1, 1, 1], x[2, 2, 2] = 1e4, -1e4, 1e4
    x.requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = softmax(x, dim), torch.softmax(x_ref, dim)
    assert torch.isfinite(y).all()
    assert_close(y, y_ref)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("shape, dim", [((3, 0), -1), ((3, 0), 0), ((0, 4), 0), ((2, 0, 5), 1)])
def test_softmax_of_empty_inputs_is_empty_like_torch(shape, dim):
    x = torch.randn(shape, requires_grad=True)
    y = softmax(x, dim)
    assert_close(y, torch.softmax(x, dim))
    y.sum().backward()
    assert x.grad.shape == x.shape


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=1, max_size=20), st.floats(-1e3, 1e3))
def test_softmax_sums_to_one_and_ignores_shifts(values, shift):
    x = torch.tensor(values, dtype=torch.float64)
    y = softmax(x)
    assert_close(y.sum(), torch.tensor(1.0, dtype=torch.float64))
    assert_close(softmax(x + shift), y, atol=1e-9, rtol=1e-6)


@pytest.mark.parametrize("leading", [(), (3,), (2, 4), (2, 1, 3)])
def test_sdpa_matches_torch_with_and_without_masks(leading):
    Q, K, V = torch.randn(*leading, 6, 8), torch.randn(*leading, 9, 8), torch.randn(*leading, 9, 5)
    assert_close(scaled_dot_product_attention(Q, K, V), F.scaled_dot_product_attention(Q, K, V))
    mask = torch.rand(*leading, 6, 9) > 0.3
    mask[..., 0] = True  # every row attends to something (torch gives NaN for empty rows)
    assert_close(scaled_dot_product_attention(Q, K, V, mask), F.scaled_dot_product_attention(Q, K, V, mask))
    causal = torch.ones(6, 9, dtype=torch.bool).tril()
    assert_close(scaled_dot_product_attention(Q, K, V, causal), F.scaled_dot_product_attention(Q, K, V, causal))


@pytest.mark.parametrize("masked", ["none", "causal", "random"])
def test_sdpa_gradients_match_torch(masked):
    Q, K, V = (torch.randn(7, 2, t, d, dtype=torch.float64, requires_grad=True) for t, d in ((6, 8), (9, 8), (9, 5)))
    mask = {"none": None, "causal": torch.ones(6, 9, dtype=torch.bool).tril(),
            "random": torch.rand(7, 2, 6, 9) > 0.4}[masked]
    if masked == "random":
        mask[..., 0] = True  # torch gives NaN for rows that attend to nothing
    grad = torch.randn(7, 2, 6, 5, dtype=torch.float64)
    ours = torch.autograd.grad(scaled_dot_product_attention(Q, K, V, mask), (Q, K, V), grad)
    expected = torch.autograd.grad(F.scaled_dot_product_attention(Q, K, V, mask), (Q, K, V), grad)
    for got, want in zip(ours, expected):
        assert_close(got, want)


@pytest.mark.parametrize("b, t_q, t_k", [(0, 4, 4), (2, 0, 4), (2, 0, 0), (2, 3, 0)])
def test_sdpa_of_empty_inputs_has_the_right_shape(b, t_q, t_k):
    Q, K, V = torch.randn(b, t_q, 8, requires_grad=True), torch.randn(b, t_k, 8), torch.randn(b, t_k, 5)
    out = scaled_dot_product_attention(Q, K, V)
    assert out.shape == (b, t_q, 5)
    out.sum().backward()
    assert Q.grad.shape == Q.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
def test_sdpa_refuses_a_mask_that_is_not_bool(dtype):
    Q = K = V = torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match=f"attention mask must be a bool tensor.*got dtype {dtype}"):
        scaled_dot_product_attention(Q, K, V, torch.ones(4, 4).tril().to(dtype))


def test_sdpa_fully_masked_row_returns_zeros_and_finite_grads():
    Q, K, V = (torch.randn(2, 4, 3, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 4, 4, dtype=torch.bool)
    mask[0, 1] = False  # query 1 of batch 0 may attend to nothing
    out = scaled_dot_product_attention(Q, K, V, mask)
    assert torch.equal(out[0, 1], torch.zeros(3))
    assert_close(out[1], F.scaled_dot_product_attention(Q[1], K[1], V[1]))
    out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (Q, K, V))


def _saved_storages(fn, *inputs: torch.Tensor) -> list[int]:
    """Bytes of each storage autograd keeps for backward of fn(*inputs), inputs excluded, each counted once (a
    matmul keeps reshaped views: the storage, not the shape, tells what is kept)."""
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn(*inputs)
    for tensor in inputs:
        saved.pop(tensor.untyped_storage().data_ptr(), None)
    del out
    return sorted(saved.values())


def test_silu_keeps_only_its_input_for_backward_as_f_silu_does():
    x = torch.randn(4, 8, requires_grad=True)
    assert _saved_storages(silu, x) == _saved_storages(F.silu, x) == []  # x itself, excluded


@pytest.mark.parametrize("masked", ["causal", "with a fully masked row"])
def test_sdpa_keeps_one_scores_sized_tensor_for_backward(masked):
    """The softmax output, shared by softmax's backward and the product with V; the fully-masked-row rule zeroes
    the output rather than copying the weights."""
    Q, K, V = (torch.randn(2, 3, 5, 4, requires_grad=True) for _ in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    if masked != "causal":
        mask = mask.expand(2, 1, 5, 5).clone()
        mask[0, 0, 2] = False
    scores_sized = [n for n in _saved_storages(scaled_dot_product_attention, Q, K, V, mask) if n == 2 * 3 * 5 * 5 * 4]
    assert len(scores_sized) == 1


def _rope_via_complex(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Oracle: adjacent pairs as complex numbers multiplied by e^{i·pos·θ^(-2k/d)}."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    rot = torch.polar(torch.ones_like(freqs), positions.double()[..., None] * freqs)
    pairs = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * rot).flatten(-2).to(x.dtype)


def test_rope_matches_complex_rotation_with_batched_positions():
    rope = RotaryPositionalEmbedding(10_000.0, 16, 64)
    x = torch.randn(2, 3, 5, 16)
    positions = torch.randint(0, 64, (2, 3, 5))
    assert_close(rope(x, positions), _rope_via_complex(x, positions, 10_000.0), atol=1e-5, rtol=1e-5)
    shared = torch.arange(5)  # one position vector broadcast over the batch
    assert_close(rope(x, shared), _rope_via_complex(x, shared.expand(2, 3, 5), 10_000.0), atol=1e-5, rtol=1e-5)
    assert not rope.state_dict()  # the cos/sin tables are derived, never saved


def test_rope_preserves_relative_position_dot_products():
    rope = RotaryPositionalEmbedding(500.0, 8, 32)
    q, k = torch.randn(8), torch.randn(8)
    dots = [(rope(q[None], torch.tensor([p + 3])) @ rope(k[None], torch.tensor([p])).T).item() for p in (0, 7, 20)]
    assert dots == pytest.approx([dots[0]] * 3, rel=1e-4)


@pytest.mark.parametrize("head_dim, theta, factor, low, high, original", [
    (128, 500_000.0, 8.0, 1.0, 4.0, 8192),  # Llama 3.1
    (64, 500_000.0, 32.0, 1.0, 4.0, 8192),  # Llama 3.2 1B/3B
    (32, 10_000.0, 4.0, 0.5, 3.0, 256),  # a small model, all three bands in 16 frequencies
])
def test_llama3_inverse_frequencies_equal_transformers(head_dim, theta, factor, low, high, original):
    """Our readable rule against transformers' ROPE_INIT_FUNCTIONS["llama3"]; every band of the rule occurs."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                            max_position_embeddings=4 * original, rope_parameters={
                                "rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                "high_freq_factor": high, "original_max_position_embeddings": original,
                                "rope_theta": theta})
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    assert attention_factor == 1.0  # llama3 scales the frequencies only, never cos/sin
    scaling = Llama3Scaling(factor, low, high, original)
    rope = RotaryPositionalEmbedding(theta, head_dim, 64, scaling=scaling)
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ours = scaling(plain)
    assert_close(ours, expected, atol=0, rtol=1e-6)
    divided, kept = torch.isclose(ours, plain / factor), torch.isclose(ours, plain)
    assert divided.any() and kept.any() and (~divided & ~kept).any()  # long, short and in-between wavelengths
    assert_close(rope.cos, (torch.arange(64.0)[:, None] * expected).cos())
    assert_close(rope.sin, (torch.arange(64.0)[:, None] * expected).sin())
