"""lr_cosine_schedule at its boundaries; clip_gradients equal to torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from scratchlm.optim.clip import clip_gradients
from scratchlm.optim.schedule import lr_cosine_schedule

MAX_LR, MIN_LR, WARMUP, CYCLE = 1.0, 0.1, 7, 21


def test_schedule_matches_cs336_reference_values():
    expected = [0, 0.14285714285714285, 0.2857142857142857, 0.42857142857142855, 0.5714285714285714,
                0.7142857142857143, 0.8571428571428571, 1.0, 0.9887175604818206, 0.9554359905560885,
                0.9018241671106134, 0.8305704108364301, 0.7452476826029011, 0.6501344202803414,
                0.55, 0.44986557971965857, 0.3547523173970989, 0.26942958916356996, 0.19817583288938662,
                0.14456400944391146, 0.11128243951817937, 0.1, 0.1, 0.1, 0.1]
    actual = [lr_cosine_schedule(it, MAX_LR, MIN_LR, WARMUP, CYCLE) for it in range(25)]
    assert actual == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_schedule_boundaries():
    assert lr_cosine_schedule(0, MAX_LR, MIN_LR, WARMUP, CYCLE) == 0.0
    assert lr_cosine_schedule(WARMUP, MAX_LR, MIN_LR, WARMUP, CYCLE) == MAX_LR
    assert lr_cosine_schedule(CYCLE, MAX_LR, MIN_LR, WARMUP, CYCLE) == pytest.approx(MIN_LR)
    assert lr_cosine_schedule(10**9, MAX_LR, MIN_LR, WARMUP, CYCLE) == MIN_LR
    midpoint = (WARMUP + CYCLE) // 2
    assert lr_cosine_schedule(midpoint, MAX_LR, MIN_LR, WARMUP, CYCLE) == pytest.approx((MAX_LR + MIN_LR) / 2)
    assert lr_cosine_schedule(0, 3e-4, 3e-5, 0, 100) == 3e-4  # no warm-up starts at the peak
    assert lr_cosine_schedule(5, 3e-4, 3e-5, 5, 5) == 3e-4  # warm-up == cycle: no decay phase
    assert lr_cosine_schedule(6, 3e-4, 3e-5, 5, 5) == 3e-5


def test_schedule_is_monotone_after_warmup():
    values = [lr_cosine_schedule(it, MAX_LR, MIN_LR, WARMUP, CYCLE) for it in range(WARMUP, CYCLE + 5)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert all(math.isfinite(v) for v in values)


@pytest.mark.parametrize("args, match", [
    ((0, 1.0, 0.1, 30, 20), r"warmup_iters \(30\) must not exceed cosine_cycle_iters \(20\)"),
    ((0, 1.0, 0.1, -1, 20), "warmup_iters must be >= 0"),
    ((0, 0.1, 1.0, 1, 20), "min_lr <= max_lr"),
    ((-1, 1.0, 0.1, 1, 20), "iteration must be >= 0"),
])
def test_schedule_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        lr_cosine_schedule(*args)


def make_params(seed: int, grad_scale: float, with_missing_grad: bool = True) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(shape, generator=generator)) for shape in [(5, 3), (7,), (2, 2, 2), (4,)]]
    for index, param in enumerate(params):
        if with_missing_grad and index == 3:
            continue  # a parameter without a gradient must be skipped
        param.grad = torch.randn(param.shape, generator=generator) * grad_scale
    return params


@pytest.mark.parametrize("grad_scale", [1e-3, 1.0, 100.0])
@pytest.mark.parametrize("max_norm", [0.01, 1.0, 1e3])
@pytest.mark.parametrize("foreach", [None, True, False])
def test_clip_equals_clip_grad_norm(grad_scale, max_norm, foreach):
    ours, theirs = make_params(0, grad_scale), make_params(0, grad_scale)
    norm = clip_gradients(ours, max_norm)
    expected_norm = nn.utils.clip_grad_norm_(theirs, max_norm, foreach=foreach)
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0
    torch.testing.assert_close(norm, expected_norm, rtol=0, atol=0)
    for a, b in zip(ours, theirs):
        if b.grad is None:
            assert a.grad is None
        else:
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_clip_leaves_small_gradients_untouched_and_scales_large_ones():
    small = make_params(1, 1e-3)
    before = [p.grad.clone() for p in small if p.grad is not None]
    clip_gradients(small, 1.0)
    for a, b in zip([p.grad for p in small if p.grad is not None], before):
        assert torch.equal(a, b)
    large = make_params(1, 100.0)
    pre_norm = clip_gradients(large, 1.0)
    assert pre_norm.item() > 1.0
    post_norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in large if p.grad is not None]))
    assert post_norm.item() == pytest.approx(1.0, rel=1e-5)


def test_clip_without_any_gradient_and_bad_max():
    assert clip_gradients([nn.Parameter(torch.ones(3))], 1.0).item() == 0.0
    with pytest.raises(ValueError, match="max_l2_norm must be positive"):
        clip_gradients(make_params(0, 1.0), 0.0)


def test_clip_reports_non_finite_norm():
    params = make_params(2, 1.0)
    params[0].grad[0, 0] = float("inf")
    assert not torch.isfinite(clip_gradients(params, 1.0))
