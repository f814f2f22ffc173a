"""`scratchlm plan`: the sizing rule (repetition discount, Chinchilla ranking) and the command, on a fixed
measured step time so that nothing depends on this machine's speed."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from scratchlm.accounting.params_flops import count_params, training_step_flops
from scratchlm.accounting.sizing import (
    REPETITION_HALF_LIFE,
    candidate_shapes,
    effective_tokens,
    predicted_loss,
    rank_shapes,
)
from scratchlm.cli import main
from scratchlm.data.token_file import write_token_file
from scratchlm.model import ModelConfig
from scratchlm.train import budget as budget_module

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "recipes" / "modern.toml"


def test_fresh_data_counts_fully_and_repeats_count_less_and_less():
    assert effective_tokens(5e5, 1e6) == 5e5
    assert effective_tokens(1e6, 1e6) == 1e6
    four_epochs = effective_tokens(4e6, 1e6)
    assert 3.5e6 < four_epochs < 4e6  # a few epochs are nearly as good as fresh data
    assert effective_tokens(1e9, 1e6) == pytest.approx(1e6 * (1 + REPETITION_HALF_LIFE), rel=1e-6)  # saturates
    repeats = 9.0
    expected = 1e6 + 1e6 * REPETITION_HALF_LIFE * (1 - math.exp(-repeats / REPETITION_HALF_LIFE))
    assert effective_tokens(1e7, 1e6) == pytest.approx(expected)


def test_chinchilla_fit_falls_with_parameters_and_data():
    assert predicted_loss(1e8, 1e9) < predicted_loss(1e7, 1e9) and predicted_loss(1e8, 1e10) < predicted_loss(1e8, 1e9)
    assert predicted_loss(70e9, 1.4e12) == pytest.approx(1.69 + 406.4 / 70e9 ** 0.34 + 410.7 / 1.4e12 ** 0.28)


def test_candidates_keep_the_recipe_and_use_heads_of_about_64_dimensions():
    base = ModelConfig(vocab_size=4096, context_length=256, d_model=256, num_layers=4, num_heads=4, ffn="relu2",
                       qk_norm=True)
    shapes = candidate_shapes(base)
    assert all(s.ffn == "relu2" and s.qk_norm and s.vocab_size == 4096 and s.d_ff == 4 * s.d_model for s in shapes)
    assert all(s.num_heads == max(1, s.d_model // 64) for s in shapes)
    assert all(s.head_dim == 64 for s in shapes if s.d_model % 64 == 0)


def test_candidates_of_a_gqa_recipe_keep_its_group_and_rederive_head_dim():
    base = ModelConfig(vocab_size=4096, context_length=256, d_model=256, num_layers=4, num_heads=8, num_kv_heads=2,
                       head_dim=48)
    shapes = candidate_shapes(base)
    assert all(s.head_dim == s.d_model // s.num_heads for s in shapes)  # not the recipe's 48
    assert all(s.num_kv_heads == (s.num_heads // 4 if s.num_heads % 4 == 0 else s.num_heads) for s in shapes)
    assert {s.num_kv_heads for s in shapes if s.d_model == 512} == {2}


def test_more_compute_buys_a_larger_model_and_a_small_corpus_pushes_the_same_way():
    base = ModelConfig(vocab_size=4096, context_length=256, d_model=256, num_layers=4, num_heads=4)
    small = rank_shapes(base, 1e11, 300, unique_tokens=10**9, batch=16)[0]
    large = rank_shapes(base, 1e11, 30_000, unique_tokens=10**9, batch=16)[0]
    assert large.non_embedding_params > small.non_embedding_params
    repeated = rank_shapes(base, 1e11, 30_000, unique_tokens=10**6, batch=16)[0]
    assert repeated.epochs > 10 and repeated.non_embedding_params >= large.non_embedding_params
    step = training_step_flops(small.model, 256, 16)
    assert small.flops_per_token == (step.forward + step.backward) / (16 * 256)
    assert small.non_embedding_params == small.model.non_embedding_params(count_params(small.model).total)


def test_plan_command_prints_the_ranking_and_the_overrides(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(budget_module, "measure_step_seconds", lambda config, train_tokens, steps=5: 0.5)
    data = tmp_path / "train.tok"
    write_token_file(data, np.random.default_rng(0).integers(0, 300, 50_000).astype(np.uint16), vocab_size=300)
    assert main(["plan", "--budget", "5m", "--data", str(data), "--config", str(RECIPE), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "takes 0.500 s a step" in out and "the data holds 50,000 tokens" in out
    assert out.count("\n| ") == 1 + 3 and out.count("\n|---") == 1  # header, 3 shapes; the rule
    assert "best: scratchlm train --config" in out and "--budget 5m" in out


@pytest.mark.parametrize("argv, message", [
    (["--budget", "soon"], "budget 'soon' is not a positive duration"),
    (["--budget", "5m", "--top", "0"], "--top must be at least 1"),
    (["--budget", "5m", "--config", "{T}/missing.toml"], "recipe {T}/missing.toml not found"),
])
def test_plan_bad_input_is_one_line(tmp_path, capsys, argv, message):
    data = tmp_path / "train.tok"
    write_token_file(data, np.zeros(1000, dtype=np.uint16), vocab_size=300)
    argv = [a.replace("{T}", str(tmp_path)) for a in argv]
    assert main(["plan", "--data", str(data), *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message.replace("{T}", str(tmp_path)) in err
