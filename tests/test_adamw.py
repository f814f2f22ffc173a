"""AdamW trajectories equal torch.optim.AdamW exactly, on both paths, with groups and lr changes; state dicts."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lockstep import take_steps
from scratchlm.optim.adamw import AdamW, param_groups_for


def make_params(seed: int, dtype=torch.float32) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (8,), (3, 4, 5), (1,)]
    return [nn.Parameter(torch.randn(shape, generator=generator, dtype=dtype)) for shape in shapes]


def set_grads(params: list[nn.Parameter], step: int, seed: int, skip_index: int | None = None) -> None:
    generator = torch.Generator().manual_seed(seed * 1000 + step)
    for index, param in enumerate(params):
        scale = 10.0 ** (index - 2)  # gradients of very different magnitudes
        grad = torch.randn(param.shape, generator=generator, dtype=param.dtype) * scale
        param.grad = None if index == skip_index and step % 3 == 0 else grad


def run_pair(ours_factory, theirs_factory, seed: int, steps: int, lr_schedule=None, skip_index=None,
             dtype=torch.float32):
    ours_params, theirs_params = make_params(seed, dtype), make_params(seed, dtype)
    ours, theirs = ours_factory(ours_params), theirs_factory(theirs_params)
    for step in range(steps):
        for opt in (ours, theirs):
            if lr_schedule is not None:
                for group in opt.param_groups:
                    group["lr"] = lr_schedule(step)
        set_grads(ours_params, step, seed, skip_index)
        set_grads(theirs_params, step, seed, skip_index)
        ours.step()
        theirs.step()
    return ours, theirs, ours_params, theirs_params


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("settings", [
    dict(lr=1e-3, weight_decay=0.0),
    dict(lr=3e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6),
    dict(lr=1e-1, weight_decay=0.01, betas=(0.0, 0.5), eps=0.0),
])
def test_trajectory_equals_torch(foreach, seed, settings):
    ours, theirs, ours_params, theirs_params = run_pair(
        lambda p: AdamW(p, foreach=foreach, **settings),
        lambda p: torch.optim.AdamW(p, foreach=foreach, **settings), seed, steps=120, skip_index=1)
    for a, b in zip(ours_params, theirs_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(ours_params, theirs_params):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(ours.state[a][key], theirs.state[b][key], rtol=0, atol=0)


@pytest.mark.parametrize("foreach", [False, True])
def test_param_groups_and_lr_changed_every_step(foreach):
    def groups(params):
        return [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0, "lr": 5e-3}]

    ours, theirs, ours_params, theirs_params = run_pair(
        lambda p: AdamW(groups(p), lr=1e-2, foreach=foreach),
        lambda p: torch.optim.AdamW(groups(p), lr=1e-2, foreach=foreach), seed=7, steps=100,
        lr_schedule=lambda step: 1e-2 * (1 + step % 7) / 7)
    for a, b in zip(ours_params, theirs_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_foreach_path_equals_single_tensor_path_with_mixed_dtypes():
    def mixed(seed):
        return make_params(seed) + make_params(seed + 1, torch.float64)

    a_params, b_params = mixed(3), mixed(3)
    a, b = AdamW(a_params, lr=1e-2, foreach=True), AdamW(b_params, lr=1e-2, foreach=False)
    take_steps(set_grads, range(30), 3, (a, a_params), (b, b_params))
    for x, y in zip(a_params, b_params):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_state_dict_round_trip_continues_identically():
    params = make_params(5)
    opt = AdamW(params, lr=1e-2, weight_decay=0.1)
    take_steps(set_grads, range(10), 5, (opt, params))
    saved_params, saved_state = copy.deepcopy(params), copy.deepcopy(opt.state_dict())
    take_steps(set_grads, range(10, 20), 5, (opt, params))
    resumed = AdamW(saved_params, lr=1e-2, weight_decay=0.1)
    resumed.load_state_dict(saved_state)
    take_steps(set_grads, range(10, 20), 5, (resumed, saved_params))
    for x, y in zip(params, saved_params):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_torch_state_dict_loads_into_ours():
    ours_params, theirs_params = make_params(9), make_params(9)
    theirs = torch.optim.AdamW(theirs_params, lr=1e-2)
    take_steps(set_grads, range(5), 9, (theirs, theirs_params))
    ours_params = [nn.Parameter(p.detach().clone()) for p in theirs_params]
    ours = AdamW(ours_params, lr=1e-2)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))  # load_state_dict may alias the tensors
    take_steps(set_grads, range(5, 15), 9, (ours, ours_params), (theirs, theirs_params))
    for x, y in zip(ours_params, theirs_params):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_params_without_grad_get_no_state():
    params = make_params(0)
    opt = AdamW(params)
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    assert set(opt.state) == {params[0]}


@pytest.mark.parametrize("bad, match", [
    (dict(lr=-1.0), "learning rate"), (dict(betas=(1.0, 0.9)), "beta1"), (dict(betas=(0.9, -0.1)), "beta2"),
    (dict(eps=-1e-8), "eps"), (dict(weight_decay=-0.1), "weight_decay"),
    (dict(betas=(0.9,)), "betas must be a pair"), (dict(betas=(0.9, 0.99, 0.999)), "betas must be a pair"),
])
def test_invalid_hyperparameters(bad, match):
    with pytest.raises(ValueError, match=match):
        AdamW(make_params(0), **bad)
    params = make_params(0)
    with pytest.raises(ValueError, match=match):  # a group's own value, in the constructor
        AdamW([{"params": params[:1]}, {"params": params[1:], **bad}])
    opt = AdamW(params[:1])
    with pytest.raises(ValueError, match=match):  # or added later
        opt.add_param_group({"params": params[1:], **bad})
    assert len(opt.param_groups) == 1


def test_param_groups_for_splits_matrices_from_vectors():
    model = nn.Module()
    model.embedding = nn.Parameter(torch.zeros(10, 4))
    model.gain = nn.Parameter(torch.ones(4))
    model.proj = nn.Parameter(torch.zeros(4, 4))
    model.frozen = nn.Parameter(torch.zeros(4, 4), requires_grad=False)
    model.tied = model.proj  # a shared tensor appears once
    decay, no_decay = param_groups_for(model, weight_decay=0.1)
    assert [p is q for p, q in zip(decay["params"], [model.embedding, model.proj])] == [True, True]
    assert len(decay["params"]) == 2 and decay["weight_decay"] == 0.1
    assert no_decay["params"] == [model.gain] and no_decay["weight_decay"] == 0.0
    AdamW(param_groups_for(model, 0.1))  # accepted as-is
