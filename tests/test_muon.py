"""Muon equals torch.optim.Muon exactly on both paths; MuonAdamW equals torch's Muon + AdamW on its groups and
resumes from a state dict bit-identically; Newton-Schulz orthogonalises; bad parameters and settings are refused.

Exact equality (atol=0) holds for the batched path too: on a CPU ``baddbmm`` computes each matrix of the batch
with the same kernel as ``addmm``. A wrong rounding anywhere shows up as a bf16-ulp-sized step (~1e-4 here),
far above zero, so these tests would catch any deviation from torch's order of operations.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lockstep import take_steps
from scratchlm.optim import muon as muon_module
from scratchlm.optim.adamw import AdamW
from scratchlm.optim.hybrid import MuonAdamW
from scratchlm.optim.muon import Muon, newton_schulz

# square, wide, tall, two of one shape (one batch of 2 on the multi-tensor path), a row and a column vector
SHAPES = [(24, 24), (16, 40), (40, 16), (24, 24), (1, 20), (20, 1)]
COEFFICIENTS = (3.4445, -4.775, 2.0315)


def make_params(seed: int, shapes=SHAPES, dtype=torch.float32) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=generator, dtype=dtype) * 0.1) for shape in shapes]


def set_grads(params: list[nn.Parameter], step: int, seed: int, scale: float = 1.0, skip_index=None) -> None:
    generator = torch.Generator().manual_seed(seed * 1000 + step)
    for index, param in enumerate(params):
        grad = torch.randn(param.shape, generator=generator, dtype=param.dtype) * scale * 10.0 ** (index % 3 - 1)
        param.grad = None if index == skip_index and step % 3 == 0 else grad


def run_pair(ours_factory, theirs_factory, seed: int, steps: int, scale: float = 1.0, skip_index=None,
             shapes=SHAPES, lr_schedule=None):
    ours_params, theirs_params = make_params(seed, shapes), make_params(seed, shapes)
    ours, theirs = ours_factory(ours_params), theirs_factory(theirs_params)
    for step in range(steps):
        if lr_schedule is not None:
            for opt in (ours, theirs):
                for group in opt.param_groups:
                    group["lr"] = lr_schedule(step) * group.get("lr_scale", 1.0)
        set_grads(ours_params, step, seed, scale, skip_index)
        set_grads(theirs_params, step, seed, scale, skip_index)
        ours.step()
        theirs.step()
    return ours, theirs, ours_params, theirs_params


def assert_same(ours_params, theirs_params, ours=None, theirs=None):
    for a, b in zip(ours_params, theirs_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        if ours is not None and b in theirs.state:
            torch.testing.assert_close(ours.state[a]["momentum_buffer"], theirs.state[b]["momentum_buffer"],
                                       rtol=0, atol=0)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_trajectory_equals_torch(foreach, adjust_lr_fn, nesterov, weight_decay):
    settings = dict(lr=0.02, weight_decay=weight_decay, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ours, theirs, ours_params, theirs_params = run_pair(
        lambda p: Muon(p, foreach=foreach, **settings), lambda p: torch.optim.Muon(p, **settings),
        seed=1, steps=40, skip_index=2)
    assert_same(ours_params, theirs_params, ours, theirs)
    moved = [(p - q).abs().max().item() for p, q in zip(ours_params, make_params(1))]
    assert min(moved) > 1e-3  # every matrix took real steps: the comparison is not of two idle runs


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("settings", [
    dict(lr=0.05, momentum=0.0, ns_steps=1, eps=1e-3),
    dict(lr=0.01, momentum=0.5, ns_coefficients=(2.0, -1.5, 0.5), ns_steps=9, weight_decay=0.0),
])
def test_other_hyperparameters_equal_torch(foreach, settings):
    _, _, ours_params, theirs_params = run_pair(
        lambda p: Muon(p, foreach=foreach, **settings), lambda p: torch.optim.Muon(p, **settings), seed=2, steps=20)
    assert_same(ours_params, theirs_params)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("scale", [0.0, 1e-30, 1e-6, 1e6, 1e30])
def test_zero_tiny_and_huge_gradients_equal_torch_and_stay_finite(foreach, scale):
    # Past ~1e19 (or below ~1e-19) the squared Frobenius norm over/underflows float32 and torch's step is zero,
    # not NaN; we match it. Between, Muon is scale-invariant: the step does not depend on the gradient's size.
    _, _, ours_params, theirs_params = run_pair(
        lambda p: Muon(p, lr=0.02, foreach=foreach), lambda p: torch.optim.Muon(p, lr=0.02), seed=3, steps=10,
        scale=scale)
    assert_same(ours_params, theirs_params)
    assert all(torch.isfinite(p).all() for p in ours_params)


def test_step_does_not_depend_on_gradient_scale():
    _, _, small, _ = run_pair(lambda p: Muon(p, lr=0.02), lambda p: Muon(p, lr=0.02), seed=4, steps=5, scale=1e-3)
    _, _, large, _ = run_pair(lambda p: Muon(p, lr=0.02), lambda p: Muon(p, lr=0.02), seed=4, steps=5, scale=1e3)
    for a, b in zip(small, large):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)  # bf16 rounding of differently scaled inputs


def test_batches_cut_from_a_large_bucket_equal_torch(monkeypatch):
    monkeypatch.setattr(muon_module, "MAX_BATCH_ELEMENTS", 1000)  # 5 matrices of 320 elements: batches of 3 + 2
    shapes = [(16, 20)] * 5 + [(40, 30)]  # and one matrix larger than a batch: a batch of its own
    _, _, ours_params, theirs_params = run_pair(
        lambda p: Muon(p, lr=0.02, foreach=True), lambda p: torch.optim.Muon(p, lr=0.02), seed=12, steps=10,
        shapes=shapes)
    assert_same(ours_params, theirs_params)


def test_foreach_path_equals_single_tensor_path_with_mixed_dtypes():
    def mixed(seed):
        return make_params(seed) + make_params(seed + 1, dtype=torch.float64)

    a_params, b_params = mixed(5), mixed(5)
    a, b = Muon(a_params, lr=0.02, foreach=True), Muon(b_params, lr=0.02, foreach=False)
    take_steps(set_grads, range(15), 5, (a, a_params), (b, b_params))
    assert_same(a_params, b_params)


def test_newton_schulz_does_not_write_into_the_momentum_buffer():
    # torch.optim.Muon (2.13) divides a bf16 momentum buffer in place when nesterov=False (.bfloat16() of a bf16
    # tensor is the tensor itself); ours keeps the buffer an exponential average of the gradients.
    param = nn.Parameter(torch.ones(4, 6, dtype=torch.bfloat16))
    optimizer = Muon([param], lr=0.1, nesterov=False, momentum=0.9)
    grad = torch.linspace(1, 3, 24, dtype=torch.bfloat16).reshape(4, 6)
    param.grad = grad
    optimizer.step()
    torch.testing.assert_close(optimizer.state[param]["momentum_buffer"], torch.zeros_like(grad).lerp(grad, 0.1))


@pytest.mark.parametrize("shape", [(64, 64), (32, 96), (96, 32), (3, 64, 48)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_newton_schulz_output_has_singular_values_near_one(shape, dtype):
    # Input singular values spread over two decades (a condition number of 100, the reach documented for 5
    # steps), on random singular vectors; any scale.
    generator = torch.Generator().manual_seed(0)
    *batch, rows, cols = shape
    k = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(*batch, rows, k, generator=generator))
    V, _ = torch.linalg.qr(torch.randn(*batch, cols, k, generator=generator))
    G = U @ torch.diag_embed(torch.logspace(0, -2, k).expand(*batch, k)) @ V.mT * 37.0
    O = newton_schulz(G, COEFFICIENTS, 5, 1e-7, dtype).float()
    assert O.shape == G.shape
    singular_values = torch.linalg.svdvals(O)
    assert singular_values.min() > 0.6 and singular_values.max() < 1.25, singular_values
    cosine = (O * (U @ V.mT)).sum((-2, -1)) / (O.norm(dim=(-2, -1)) * (U @ V.mT).norm(dim=(-2, -1)))
    assert cosine.min() > 0.97  # and it points along U V^T: the singular vectors are kept


def test_float32_newton_schulz_is_torchs_bfloat16_one_up_to_bfloat16_rounding():
    generator = torch.Generator().manual_seed(1)
    G = torch.randn(4, 48, 80, generator=generator)
    fast, reference = newton_schulz(G, COEFFICIENTS, 5, 1e-7, "float32"), newton_schulz(G, COEFFICIENTS, 5, 1e-7)
    assert fast.dtype == torch.float32 and reference.dtype == torch.bfloat16
    torch.testing.assert_close(fast, reference.float(), rtol=0, atol=0.05)  # bf16 keeps 8 bits of ~1-sized entries


@pytest.mark.parametrize("foreach", [False, True])
def test_float32_newton_schulz_trains_like_torch(foreach):
    """The CPU speed choice (ns_dtype="float32") follows torch's bf16 trajectory closely, on both paths."""
    ours, theirs, ours_params, theirs_params = run_pair(
        lambda p: Muon(p, lr=0.02, foreach=foreach, ns_dtype="float32"), lambda p: torch.optim.Muon(p, lr=0.02),
        seed=3, steps=20)
    for a, b, start in zip(ours_params, theirs_params, make_params(3)):
        moved = (b - start).abs().max()  # 20 steps of lr 0.02
        assert (a - b).abs().max() < 0.03 * moved  # bf16 rounding in the reference, not a different update


def test_newton_schulz_of_zero_is_zero():
    assert newton_schulz(torch.zeros(8, 5), COEFFICIENTS, 5, 1e-7).abs().max() == 0


def test_state_dict_interchanges_with_torch():
    theirs_params = make_params(6)
    theirs = torch.optim.Muon(theirs_params, lr=0.02)
    take_steps(set_grads, range(5), 6, (theirs, theirs_params))
    ours_params = [nn.Parameter(p.detach().clone()) for p in theirs_params]
    ours = Muon(ours_params, lr=0.02)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    take_steps(set_grads, range(5, 15), 6, (ours, ours_params), (theirs, theirs_params))
    assert_same(ours_params, theirs_params)


@pytest.mark.parametrize("optimizer", ["muon", "hybrid"])
def test_non_matrix_parameter_is_refused_by_name(optimizer):
    weight, gain = nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.ones(4))
    named = [("layers.0.attn.q_proj.weight", weight), ("layers.0.ln1.weight", gain)]
    make = (lambda params: Muon(params)) if optimizer == "muon" else \
        (lambda params: MuonAdamW([{"params": params, "algorithm": "muon"}]))
    message = r"parameter 'layers.0.ln1.weight' of param group 0 has shape \(4,\); .* give it to AdamW"
    with pytest.raises(ValueError, match=message):
        make(named)
    with pytest.raises(ValueError, match=r"parameter number 1 of param group 0 has shape \(4,\)"):
        make([weight, gain])
    with pytest.raises(ValueError, match=r"shape \(2, 2, 2\)"):
        make([nn.Parameter(torch.zeros(2, 2, 2))])
    opt = make([weight])
    with pytest.raises(ValueError, match="give it to AdamW"):
        opt.add_param_group({"params": [gain], "algorithm": "muon"})
    assert len(opt.param_groups) == 1  # the refused group left no trace


@pytest.mark.parametrize("bad, match", [
    (dict(lr=-1e-3), "learning rate"), (dict(momentum=-0.1), "momentum"), (dict(momentum=1.0), "momentum"),
    (dict(weight_decay=-0.1), "weight_decay"), (dict(eps=-1e-7), "eps"),
    (dict(ns_coefficients=(1.0, 2.0)), "ns_coefficients"), (dict(ns_steps=0), "ns_steps"),
    (dict(ns_steps=100), "ns_steps"), (dict(ns_steps=2.5), "ns_steps"), (dict(adjust_lr_fn="rms"), "adjust_lr_fn"),
    (dict(lr=float("nan")), "learning rate"),
])
def test_invalid_hyperparameters(bad, match):
    params = make_params(0)
    with pytest.raises(ValueError, match=match):
        Muon(params, **bad)
    with pytest.raises(ValueError, match=match):  # a group's own value, in the constructor
        Muon([{"params": params[:1]}, {"params": params[1:], **bad}])
    opt = Muon(params[:1])
    with pytest.raises(ValueError, match=match):  # or added later
        opt.add_param_group({"params": params[1:], **bad})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match=match):  # and in the hybrid
        MuonAdamW([{"params": params, "algorithm": "muon", **bad}])


def test_hybrid_refuses_a_group_without_a_known_algorithm():
    params = make_params(0)
    with pytest.raises(ValueError, match=r"param group 1 has algorithm 'sgd'; .*'adamw', 'muon'"):
        MuonAdamW([{"params": params[:1], "algorithm": "muon"}, {"params": params[1:], "algorithm": "sgd"}])
    with pytest.raises(ValueError, match="param group 0 has algorithm None"):
        MuonAdamW(params)
    with pytest.raises(ValueError, match="beta1"):
        MuonAdamW([{"params": params, "algorithm": "adamw", "betas": (1.0, 0.9)}])


def hybrid_groups(params, algorithm_key: bool, foreach: bool | None = None):
    """Muon on the first four matrices, AdamW on the vectors (with decay) and a 3-D tensor (without)."""
    muon = {"params": params[:4], "lr": 0.02, "weight_decay": 0.1, "nesterov": True, "lr_scale": 1.0}
    decay = {"params": params[4:6], "lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1, "lr_scale": 0.1}
    no_decay = {"params": params[6:], "lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.0, "lr_scale": 0.1}
    if algorithm_key:
        muon, decay, no_decay = ({**g, "algorithm": a, "foreach": foreach}
                                 for g, a in ((muon, "muon"), (decay, "adamw"), (no_decay, "adamw")))
    return muon, [decay, no_decay]


def build_hybrid(params, foreach: bool | None = None) -> MuonAdamW:
    muon, adamw = hybrid_groups(params, algorithm_key=True, foreach=foreach)
    return MuonAdamW([muon, *adamw])


HYBRID_SHAPES = SHAPES[:4] + [(7,), (1,), (3, 4, 5)]


class TorchMuonPlusAdamW:
    """The oracle: torch.optim.Muon and torch.optim.AdamW side by side."""

    def __init__(self, params):
        muon, adamw = hybrid_groups(params, algorithm_key=False)
        self.optimizers = [torch.optim.Muon([muon]), torch.optim.AdamW(adamw)]
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]

    def step(self):
        for opt in self.optimizers:
            opt.step()


@pytest.mark.parametrize("foreach", [False, True])
def test_hybrid_equals_torch_muon_plus_torch_adamw(foreach):
    _, _, ours_params, theirs_params = run_pair(
        lambda p: build_hybrid(p, foreach), TorchMuonPlusAdamW, seed=8, steps=40, shapes=HYBRID_SHAPES, skip_index=5,
        lr_schedule=lambda step: 0.02 * (1 + step % 5) / 5)
    assert_same(ours_params, theirs_params)


def test_hybrid_group_defaults_are_the_optimizers_defaults():
    params = make_params(0, HYBRID_SHAPES)
    opt = MuonAdamW([{"params": params[:4], "algorithm": "muon"}, {"params": params[4:], "algorithm": "adamw"}])
    muon, adamw = opt.param_groups
    assert {k: muon[k] for k in Muon(params[:4]).defaults} == Muon(params[:4]).defaults
    assert {k: adamw[k] for k in AdamW(params[4:]).defaults} == AdamW(params[4:]).defaults


def test_hybrid_state_dict_resumes_bit_identically_and_keeps_extra_keys():
    def run(opt, params, steps):
        for step in steps:
            for group in opt.param_groups:
                group["lr"] = 0.01 * (1 + step % 4) * group["lr_scale"]
            set_grads(params, step, 9)
            opt.step()

    params = make_params(9, HYBRID_SHAPES)
    opt = build_hybrid(params)
    run(opt, params, range(10))
    saved_params, saved_state = copy.deepcopy(params), copy.deepcopy(opt.state_dict())
    run(opt, params, range(10, 25))
    resumed = build_hybrid(saved_params)
    for group in resumed.param_groups:  # the saved values must win over the fresh ones
        group["lr_scale"], group["lr"] = 123.0, 1.0
    resumed.load_state_dict(saved_state)
    assert [g["lr_scale"] for g in resumed.param_groups] == [1.0, 0.1, 0.1]
    assert [g["algorithm"] for g in resumed.param_groups] == ["muon", "adamw", "adamw"]
    run(resumed, saved_params, range(10, 25))
    for x, y in zip(params, saved_params):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert set(resumed.state[saved_params[0]]) == {"momentum_buffer"}
    assert set(resumed.state[saved_params[4]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_hybrid_resumes_through_the_checkpoint_manager(tmp_path):
    from scratchlm.train.checkpoint import CheckpointManager

    params = make_params(10, HYBRID_SHAPES)
    model = nn.Module()
    model.weights = nn.ParameterList(params)
    opt = build_hybrid(params)
    take_steps(set_grads, range(4), 10, (opt, params))
    manager = CheckpointManager(tmp_path)
    path = manager.save(4, model, opt, config={}, sampler_state={})
    restored_params = make_params(11, HYBRID_SHAPES)
    restored_model = nn.Module()
    restored_model.weights = nn.ParameterList(restored_params)
    restored = build_hybrid(restored_params)
    manager.load(path, restored_model, restored)
    assert [g["lr_scale"] for g in restored.param_groups] == [1.0, 0.1, 0.1]
    take_steps(set_grads, range(4, 10), 10, (opt, params), (restored, restored_params))
    assert_same(params, restored_params)
