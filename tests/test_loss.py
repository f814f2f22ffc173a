"""cross_entropy against F.cross_entropy on random and adversarial inputs; perplexity."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from scratchlm.train.loss import cross_entropy, perplexity


def oracle(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@pytest.mark.parametrize("shape", [(7, 11), (2, 5, 13), (2, 3, 4, 9), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_torch_on_random_inputs(shape, dtype):
    generator = torch.Generator().manual_seed(sum(shape))
    logits = torch.randn(shape, dtype=dtype, generator=generator) * 3
    targets = torch.randint(0, shape[-1], shape[:-1], generator=generator)
    torch.testing.assert_close(cross_entropy(logits, targets), oracle(logits, targets))


def test_huge_logits_stay_finite_and_match():
    logits = torch.tensor([[1e4, -1e4, 0.0], [-1e4, -1e4, -1e4], [1e4, 1e4, -1e4]])
    targets = torch.tensor([1, 2, 0])
    loss = cross_entropy(logits, targets)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, oracle(logits, targets))
    assert cross_entropy(torch.tensor([[1e4, 0.0]]), torch.tensor([0])).item() == 0.0


def test_gradient_matches_torch():
    logits = torch.randn(3, 4, 17, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 17, (3, 4))
    (ours,) = torch.autograd.grad(cross_entropy(logits, targets), logits)
    (theirs,) = torch.autograd.grad(oracle(logits, targets), logits)
    torch.testing.assert_close(ours, theirs)


def test_gradient_scales_with_the_upstream_gradient_and_survives_huge_logits():
    logits = (torch.randn(5, 11, dtype=torch.float64) * torch.tensor([1.0, 1e4])[torch.arange(5) % 2, None])
    logits.requires_grad_(True)
    targets = torch.randint(0, 11, (5,))
    upstream = torch.tensor(0.37, dtype=torch.float64)
    (ours,) = torch.autograd.grad(cross_entropy(logits, targets), logits, grad_outputs=upstream)
    (theirs,) = torch.autograd.grad(oracle(logits, targets), logits, grad_outputs=upstream)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, theirs)


def test_bfloat16_logits_are_upcast():
    logits = torch.randn(8, 1000).to(torch.bfloat16)
    targets = torch.randint(0, 1000, (8,))
    loss = cross_entropy(logits, targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, oracle(logits.float(), targets))


def test_single_class_vocab_has_zero_loss():
    assert cross_entropy(torch.randn(5, 1), torch.zeros(5, dtype=torch.long)).item() == 0.0


def test_shape_and_dtype_errors_are_clear():
    with pytest.raises(ValueError, match=r"targets shape \(4,\) must equal .* \(3,\)"):
        cross_entropy(torch.randn(3, 5), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer token ids"):
        cross_entropy(torch.randn(3, 5), torch.zeros(3))


def test_perplexity():
    assert perplexity(0.0) == 1.0
    assert perplexity(torch.tensor(math.log(10.0))) == pytest.approx(10.0)
    assert perplexity(1e6) == math.inf


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ignored_targets_match_torch(reduction):
    """Targets equal to IGNORED count for nothing, in the loss and its gradient, as F.cross_entropy's ignore_index."""
    from scratchlm.train.loss import IGNORED

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 6, 19, dtype=torch.float64, generator=generator, requires_grad=True)
    targets = torch.randint(0, 19, (4, 6), generator=generator)
    targets[torch.rand(4, 6, generator=generator) < 0.5] = IGNORED
    ours = cross_entropy(logits, targets, ignore_index=IGNORED, reduction=reduction)
    theirs = F.cross_entropy(logits.reshape(-1, 19), targets.reshape(-1), ignore_index=IGNORED, reduction=reduction)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(torch.autograd.grad(ours, logits)[0], torch.autograd.grad(theirs, logits)[0])


def test_all_targets_ignored_is_nan_as_torch():
    from scratchlm.train.loss import IGNORED

    targets = torch.full((3,), IGNORED)
    assert torch.isnan(cross_entropy(torch.randn(3, 5), targets, ignore_index=IGNORED))
    assert cross_entropy(torch.randn(3, 5), targets, ignore_index=IGNORED, reduction="sum").item() == 0.0
