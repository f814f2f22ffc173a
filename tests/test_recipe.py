"""The modern recipe's pieces, each against a direct formula: ReLU² FFN, QK-norm, zero-initialised residual
projections, logit soft-capping, the WSD schedule, the per-role param groups, and their HF-export refusal."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from scratchlm.accounting.params_flops import count_params
from scratchlm.compat.hf import check_expressible
from scratchlm.config import RunConfig, load_config
from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.model.attention import MultiHeadSelfAttention
from scratchlm.model.kernels import cpu
from scratchlm.optim.groups import recipe_param_groups
from scratchlm.optim.schedule import lr_wsd_schedule
from scratchlm.train.setup import build_optimizer
from scratchlm.train.step import learning_rate

MODERN = dict(ffn="relu2", qk_norm=True, zero_init_residual=True, logit_softcap=15.0)


def tiny(**switches) -> ModelConfig:
    return ModelConfig.preset("tiny", **switches)


def test_relu2_ffn_is_w2_relu_squared_w1():
    torch.manual_seed(0)
    model = TransformerLM(tiny(ffn="relu2", d_ff=None))
    ffn = model.layers[0].ffn
    assert model.config.d_ff == 4 * model.config.d_model and not hasattr(ffn, "w3")
    x = torch.randn(3, 5, model.config.d_model)
    x[0, 0] = 0.0  # ReLU's kink
    expected = F.linear(F.relu(F.linear(x, ffn.w1.weight)) ** 2, ffn.w2.weight)
    torch.testing.assert_close(ffn(x), expected)


def test_qk_norm_normalises_each_heads_q_and_k_before_rope():
    torch.manual_seed(0)
    d, heads, T = 32, 4, 7
    attn = MultiHeadSelfAttention(ModelConfig(d_model=d, num_heads=heads, context_length=16, qk_norm=True))
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 2.0)
        attn.k_norm.weight.uniform_(0.5, 2.0)
    x = torch.randn(2, T, d) * 50  # large activations: the norm must make the scale irrelevant
    heads_of = lambda t: t.unflatten(-1, (heads, d // heads)).transpose(1, 2)  # noqa: E731
    q = F.rms_norm(heads_of(x @ attn.q_proj.weight.T), (d // heads,), attn.q_norm.weight, eps=1e-5)
    k = F.rms_norm(heads_of(x @ attn.k_proj.weight.T), (d // heads,), attn.k_norm.weight, eps=1e-5)
    q, k = attn.rope(q), attn.rope(k)
    out = F.scaled_dot_product_attention(q, k, heads_of(x @ attn.v_proj.weight.T), is_causal=True)
    expected = out.transpose(1, 2).flatten(-2) @ attn.output_proj.weight.T
    torch.testing.assert_close(attn(x), expected, rtol=1e-4, atol=1e-4)


def test_zero_init_residual_makes_every_block_the_identity_at_init():
    torch.manual_seed(0)
    model = TransformerLM(tiny(zero_init_residual=True))
    for layer in model.layers:
        assert not layer.attn.output_proj.weight.any() and not layer.ffn.w2.weight.any()
        assert layer.attn.q_proj.weight.any()
    ids = torch.randint(0, 256, (2, 9))
    logits = model(ids)
    expected = model.lm_head(model.ln_final(model.token_embeddings(ids)))
    torch.testing.assert_close(logits, expected)
    logits.square().mean().backward()  # the zero matrices still receive gradients: they can grow
    assert model.layers[0].attn.output_proj.weight.grad.abs().sum() > 0
    assert model.layers[0].ffn.w2.weight.grad.abs().sum() > 0


def test_logit_softcap_is_cap_tanh_of_the_raw_logits_and_bounds_them():
    torch.manual_seed(0)
    raw = TransformerLM(tiny())
    capped = TransformerLM(tiny(logit_softcap=2.0))
    capped.load_state_dict(raw.state_dict())
    with torch.no_grad():
        raw.lm_head.weight.mul_(100)  # huge logits
        capped.lm_head.weight.mul_(100)
    ids = torch.randint(0, 256, (2, 9))
    torch.testing.assert_close(capped(ids), 2.0 * torch.tanh(raw(ids) / 2.0))
    assert capped(ids).abs().max() <= 2.0


@pytest.mark.parametrize("switches", [MODERN, dict(qk_norm=True), dict(ffn="relu2", d_ff=None)])
def test_accounting_counts_the_modern_model_exactly(switches):
    config = ModelConfig.preset("tinystories-17m", **switches)
    assert count_params(config).total == TransformerLM(config, device="meta").num_parameters()


def test_modern_model_trains_its_gradients_are_finite():
    torch.manual_seed(0)
    model = TransformerLM(tiny(**MODERN))
    ids = torch.randint(0, 256, (2, 17))
    loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    assert math.isfinite(loss.item()) and all(p.grad is not None and p.grad.isfinite().all()
                                              for p in model.parameters())


def test_hf_export_refuses_what_llama_cannot_express():
    with pytest.raises(ValueError, match="qk_norm=True.*logit_softcap=15.0|ffn='relu2'"):
        check_expressible(tiny(**MODERN), "llama")
    check_expressible(tiny(zero_init_residual=True), "llama")  # only an initialisation: exports fine


@pytest.mark.parametrize("bad, message", [
    (dict(logit_softcap=-1.0), "model.logit_softcap must be a finite number >= 0"),
    (dict(logit_softcap=float("inf")), "model.logit_softcap must be a finite number >= 0"),
    (dict(qk_norm="yes"), "model.qk_norm must be true or false"),
    (dict(ffn="relu3"), "model.ffn must be one of"),
])
def test_bad_switches_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        tiny(**bad)


# --------------------------------------------------------------------------------------------------- schedule

def test_wsd_schedule_pinned_values():
    values = [lr_wsd_schedule(it, 1.0, 0.1, 2, 10, 0.4, "linear") for it in range(12)]
    assert values == pytest.approx([0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1])
    sqrt = [lr_wsd_schedule(it, 1.0, 0.0, 0, 10, 0.5, "1-sqrt") for it in (4, 5, 6, 9, 10)]
    assert sqrt == pytest.approx([1.0, 1.0, 1 - math.sqrt(0.2), 1 - math.sqrt(0.8), 0.0])


def test_wsd_schedule_is_what_the_trainer_uses():
    config = RunConfig().with_overrides(["optim.schedule=wsd", "optim.decay_fraction=0.4", "optim.warmup_iters=2",
                                         "train.max_steps=10", "optim.lr=1.0", "optim.min_lr=0.1"])
    assert [learning_rate(it, config) for it in range(10)] == [lr_wsd_schedule(it, 1.0, 0.1, 2, 10, 0.4)
                                                               for it in range(10)]


@pytest.mark.parametrize("overrides, message", [
    (["optim.schedule=linear"], "optim.schedule must be one of"),
    (["optim.decay_fraction=0"], "optim.decay_fraction must be in"),
    (["optim.decay_shape=cosine"], "optim.decay_shape must be one of"),
    (["optim.schedule=wsd", "optim.decay_fraction=1.0", "optim.warmup_iters=5", "train.max_steps=10"],
     "must end before the wsd decay starts"),
    (["optim.muon_params=("], "is not a regular expression"),
    (["optim.head_lr=-1"], "optim.head_lr must be positive"),
])
def test_bad_optim_settings_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        RunConfig().with_overrides(overrides)


# ----------------------------------------------------------------------------------------------- param groups

def groups_for(*overrides: str, **switches):
    config = RunConfig().with_overrides(["model.preset=tiny", *overrides])
    model = TransformerLM(ModelConfig.preset("tiny", **switches))
    return model, recipe_param_groups(model, config.optim)


def names(model, group) -> set[str]:
    ids = {id(p) for p in group["params"]}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest_each_parameter_once():
    model, groups = groups_for("optim.optimizer=muon", "optim.lr=0.01", "optim.muon_lr=0.02", "optim.head_lr=0.004",
                               "optim.embedding_lr=0.1", qk_norm=True)
    by_algorithm = {g["algorithm"] for g in groups}
    assert by_algorithm == {"muon", "adamw"}
    muon = [g for g in groups if g["algorithm"] == "muon"][0]
    assert names(model, muon) == {f"layers.{i}.{m}.weight" for i in range(2) for m in
                                  ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.output_proj", "ffn.w1",
                                   "ffn.w2", "ffn.w3")}
    assert muon["lr_scale"] == pytest.approx(2.0)
    scales = {frozenset(names(model, g)): g["lr_scale"] for g in groups}
    assert scales[frozenset({"lm_head.weight"})] == pytest.approx(0.4)
    assert scales[frozenset({"token_embeddings.weight"})] == pytest.approx(10.0)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    gains = [g for g in groups if g["weight_decay"] == 0.0][0]
    assert all(p.dim() == 1 for p in gains["params"]) and "layers.0.attn.q_norm.weight" in names(model, gains)


def test_muon_is_refused_a_gain_by_name():
    with pytest.raises(ValueError, match=r"selects layers\.0\.ln1\.weight of shape \(64,\): Muon takes 2-D"):
        groups_for("optim.optimizer=muon", "optim.muon_params=^layers")


@pytest.mark.parametrize("native_bf16, chosen", [(True, "bfloat16"), (False, "float32")])
def test_muons_newton_schulz_runs_in_bfloat16_only_where_the_cpu_has_bf16_arithmetic(monkeypatch, native_bf16,
                                                                                     chosen):
    # Emulated bf16 products made a tinystories-17m Muon step ~15x slower than float32 ones (docs/benchmarks.md).
    monkeypatch.setattr(cpu, "has_native_bf16", lambda: native_bf16)
    config = RunConfig.from_dict({"model": {"preset": "tiny"}, "optim": {"optimizer": "muon"}})
    optimizer = build_optimizer(TransformerLM(config.model), config)
    assert {group["ns_dtype"] for group in optimizer.param_groups if group["algorithm"] == "muon"} == {chosen}
    explicit = config.with_overrides(["optim.muon_ns_dtype=bfloat16"])
    optimizer = build_optimizer(TransformerLM(config.model), explicit)
    assert {group["ns_dtype"] for group in optimizer.param_groups if group["algorithm"] == "muon"} == {"bfloat16"}


def test_the_cs336_recipe_keeps_its_two_adamw_groups():
    model, groups = groups_for()
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0] and all("algorithm" not in g for g in groups)


# ---------------------------------------------------------------------------------------------------- recipes

RECIPES = Path(__file__).resolve().parents[1] / "configs" / "recipes"
ABLATIONS = {"no-muon": {"optim.optimizer"}, "no-qk-norm": {"model.qk_norm"}, "relu2": {"model.ffn", "model.d_ff"},
             "no-zero-init": {"model.zero_init_residual"}, "softcap": {"model.logit_softcap"},
             "shared-lr": {"optim.embedding_lr", "optim.head_lr"}, "cosine": {"optim.schedule", "optim.min_lr"},
             "fp32": {"train.dtype"}}


def flat(config: RunConfig) -> dict:
    return {f"{section}.{key}": value for section, table in config.to_dict().items() for key, value in table.items()
            if key != "run_dir"}


@pytest.mark.parametrize("name, changed", ABLATIONS.items())
def test_each_ablation_removes_exactly_one_piece_of_the_modern_recipe(name, changed):
    modern, ablation = flat(load_config(RECIPES / "modern.toml")), flat(load_config(RECIPES / "ablations" /
                                                                                     f"{name}.toml"))
    assert {key for key in modern if modern[key] != ablation[key]} == changed
    if name == "shared-lr":  # the same rate as the gains: optim.lr
        assert ablation["optim.embedding_lr"] == ablation["optim.head_lr"] == modern["optim.lr"]
    if name == "cosine":
        assert ablation["optim.min_lr"] == pytest.approx(modern["optim.lr"] / 10)


def test_every_ablation_file_is_in_the_table():
    assert {path.stem for path in (RECIPES / "ablations").glob("*.toml")} == set(ABLATIONS)
