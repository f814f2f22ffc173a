"""Accounting checked against the real model: parameter counts, matmul FLOPs, saved activations, CLI."""

from __future__ import annotations

import gc
import inspect
import json
import weakref

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from scratchlm.accounting.commands import accounting_report
from scratchlm.accounting.memory import (
    activation_elements,
    estimate_memory,
    max_batch_size,
    parse_memory,
    step_constant_bytes,
    time_to_train,
)
from scratchlm.accounting.op_study import time_interleaved
from scratchlm.accounting.params_flops import (
    count_params,
    forward_flops,
    kv_cache_bytes_per_token,
    matrix_table,
    six_n_d_flops,
    training_step_flops,
)
from scratchlm.cli import main
from scratchlm.model import KVCache, ModelConfig, TransformerLM, kernels
from scratchlm.train.loss import cross_entropy

BASE = dict(vocab_size=96, context_length=24, d_model=48, num_layers=2, num_heads=4, d_ff=80)
ABLATIONS = [
    {},
    dict(norm="layernorm"),
    dict(norm="none"),
    dict(norm_position="post"),
    dict(position="nope"),
    dict(ffn="silu", d_ff=None),
    dict(ffn="swiglu", d_ff=None),
    dict(tie_embeddings=True),
    dict(norm="layernorm", ffn="silu", tie_embeddings=True, position="nope", num_layers=3, num_heads=6),
    # The switches of pretrained checkpoints: grouped-query and multi-query attention, head_dim != d/h, biases.
    dict(num_kv_heads=2),
    dict(num_kv_heads=1, qkv_bias=True),
    dict(num_kv_heads=2, head_dim=16, qkv_bias=True, rope_scaling="llama3", rope_original_context=32),
]


def _config(overrides: dict) -> ModelConfig:
    return ModelConfig(**{**BASE, **overrides})


@pytest.mark.parametrize("overrides", ABLATIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "base")
def test_param_count_equals_built_model(overrides):
    config = _config(overrides)
    model = TransformerLM(config)
    assert count_params(config).total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset", ["tiny", "tinystories-17m", "gpt2-small", "gpt2-xl"])
def test_param_count_of_presets_on_meta_device(preset):
    config = ModelConfig.preset(preset)
    model = TransformerLM(config, device=torch.device("meta"))
    assert count_params(config).total == sum(p.numel() for p in model.parameters())


def test_non_embedding_count_leaves_out_only_the_untied_input_embeddings():
    """One definition for the model and the accounting report: ~17.6M for tinystories-17m, not 12.5M."""
    for tie in (False, True):
        cfg = ModelConfig.preset("tinystories-17m", tie_embeddings=tie)
        model = TransformerLM(cfg, device="meta")
        report = accounting_report(cfg, context=cfg.context_length, batch=1)
        assert report["params"]["non_embedding"] == model.num_parameters(non_embedding=True)
        assert report["params"]["total"] == model.num_parameters()
    assert report["params"]["non_embedding"] == report["params"]["total"]  # tied: the table is the output layer
    assert ModelConfig.preset("tinystories-17m").non_embedding_params(22_696_448) == 17_576_448


def test_closed_formula_for_swiglu_4d():
    config = ModelConfig.preset("gpt2-xl")
    L, d, V = config.num_layers, config.d_model, config.vocab_size
    assert count_params(config).total == L * (16 * d * d + 2 * d) + 2 * V * d + d
    assert count_params(config).total == pytest.approx(2.13e9, rel=0.005)


def test_gqa_head_dim_and_bias_counts_by_hand():
    """d 48, 4 query heads and 2 KV heads of 16: q = 64, k = 32 wide, every weight counted by hand."""
    config = _config(dict(num_kv_heads=2, head_dim=16, qkv_bias=True))
    attention = 64 * 48 + 32 * 48 + 32 * 48 + 48 * 64 + (64 + 32 + 32)  # Q, K, V, O and the q/k/v biases
    assert count_params(config).attention == 2 * attention
    flops = forward_flops(config, context=10, batch=3)
    assert flops.attention_proj == 2 * 2 * 30 * 48 * (64 + 32 + 32 + 64)  # 2 layers, 30 tokens, 2mkn
    assert flops.attention_scores == flops.attention_values == 2 * 3 * 4 * (2 * 10 * 10 * 16)  # per head, all H
    rows = {row.name: row for row in matrix_table(config, 10, 3)}
    assert (rows["K"].params, rows["K"].forward_flops) == (2 * (32 * 48 + 32), 2 * 2 * 30 * 48 * 32)
    assert (rows["O"].params, rows["O"].shape) == (2 * 48 * 64, "d×H·d_h = 48×64")
    assert count_params(_config(dict(rope_scaling="llama3"))) == count_params(_config({}))  # no parameters


def test_llama_3_2_1b_shape_counts_its_published_parameters_and_kv_cache():
    """Llama 3.2 1B (GQA: 32 query heads, 8 KV heads of 64; tied embeddings): 1,235,814,400 parameters, and a
    KV cache of 2 · 16 layers · 8 heads · 64 · 2 B = 32 KiB per token in bf16."""
    config = ModelConfig(vocab_size=128_256, context_length=8192, d_model=2048, num_layers=16, num_heads=32,
                         num_kv_heads=8, d_ff=8192, tie_embeddings=True, rope_theta=500_000.0,
                         rope_scaling="llama3", rope_scaling_factor=32.0)
    assert count_params(config).total == 1_235_814_400
    assert count_params(config).total == sum(p.numel() for p in TransformerLM(config, device="meta").parameters())
    assert kv_cache_bytes_per_token(config, 2) == 32 * 1024
    assert kv_cache_bytes_per_token(ModelConfig(**{**config.to_dict(), "num_kv_heads": 32}), 2) == 4 * 32 * 1024


@pytest.mark.parametrize("overrides", [{}, dict(num_kv_heads=2), dict(num_kv_heads=1, head_dim=16)])
def test_kv_cache_bytes_per_token_equal_the_real_cache(overrides):
    config = _config(overrides)
    model = TransformerLM(config)
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        cache = KVCache.for_model(model.to(dtype), batch_size=3)
        held = sum(t.nbytes for t in cache.keys + cache.values)
        assert held == 3 * config.context_length * kv_cache_bytes_per_token(config, size)


def test_gqa_param_count_equals_hugging_face_llama():
    from transformers import LlamaForCausalLM

    from scratchlm.compat.hf import to_hf_config

    for overrides in (dict(num_kv_heads=2), dict(num_kv_heads=1, head_dim=16)):
        config = _config(overrides)
        with torch.device("meta"):
            hf = LlamaForCausalLM(to_hf_config(config, "llama"))
        assert count_params(config).total == sum(p.numel() for p in hf.parameters())


def _counted_matmul_flops(model: TransformerLM, tokens: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        model(tokens)
    counts = counter.get_flop_counts()["Global"]
    aten = torch.ops.aten
    matmuls = {aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.matmul}
    assert set(counts) <= matmuls, f"unexpected counted ops {set(counts) - matmuls}"
    return sum(counts.values())


@pytest.mark.parametrize("overrides", ABLATIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "base")
def test_forward_flops_equal_flop_counter(overrides):
    config = _config(overrides)
    model = TransformerLM(config)
    for batch, context in ((1, config.context_length), (3, 7)):
        tokens = torch.randint(0, config.vocab_size, (batch, context))
        assert forward_flops(config, context, batch).total == _counted_matmul_flops(model, tokens)


def test_gpt2_xl_flops_and_context_scaling():
    config = ModelConfig.preset("gpt2-xl")
    at_1k = forward_flops(config, 1024).total
    assert at_1k == pytest.approx(4.5e12, rel=0.01)
    assert forward_flops(config, 16384).total / at_1k == pytest.approx(33, rel=0.01)
    assert forward_flops(config, 1024).shares()["attention_scores"] < forward_flops(config, 16384).shares()[
        "attention_scores"]
    step = training_step_flops(config, 1024, 4)
    assert step.backward == 2 * step.forward and step.optimizer == 14 * count_params(config).total


class _Held:
    """Box for a saved tensor: alive exactly as long as autograd keeps the saved tensor."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()  # detached: holding an op's own output must not keep its node alive


def _saved_bytes(config: ModelConfig, batch: int) -> int:
    """Bytes autograd keeps for backward after model forward + cross-entropy, tensors sharing storage counted
    once, parameters left out: the model as the trainer runs it (its CPU kernels applied, see build_model)."""
    model = kernels.apply(TransformerLM(config), "cpu", fused_attention=False)
    tokens = torch.randint(0, config.vocab_size, (batch, config.context_length))
    boxes: list[weakref.ref] = []

    def pack(tensor: torch.Tensor) -> _Held:
        box = _Held(tensor)
        boxes.append(weakref.ref(box))
        return box

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.tensor):
        loss = cross_entropy(model(tokens), tokens)
    gc.collect()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}
    for ref in boxes:
        box = ref()
        if box is not None and box.tensor.untyped_storage().data_ptr() not in parameters:
            storage = box.tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    del loss
    return sum(storages.values())


@pytest.mark.parametrize("overrides", ABLATIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "base")
def test_activation_estimate_matches_saved_tensors(overrides):
    config = _config(overrides)
    batch, context = 3, config.context_length
    estimate = (batch * 4 * activation_elements(config, context).total
                + sum(step_constant_bytes(config, context).values()))
    ratio = estimate / _saved_bytes(config, batch)
    # Band: our formula is an exact reading of the code; 2% leaves room for tiny bookkeeping tensors.
    assert 0.98 <= ratio <= 1.02, f"estimate/measured = {ratio:.3f}"


def test_textbook_model_underestimates_our_saved_tensors():
    config = _config({})
    measured = _saved_bytes(config, 3)
    textbook = 3 * 4 * activation_elements(config, config.context_length, "cs336").total
    assert textbook < measured


def test_gpt2_xl_max_batch_on_80gb():
    config = ModelConfig.preset("gpt2-xl")
    memory = parse_memory("80GB")
    assert max_batch_size(config, 1024, memory, activation_model="cs336") == 3
    # Ours keeps ONE h·T² tensor per layer (the exercise counts two) and one T·V tensor in the loss, but also the
    # SwiGLU's W3x and gated product, the norm internals and the logits gradient: 12.39 GB a sequence, 3 fit in 80 GB.
    assert max_batch_size(config, 1024, memory) == 3
    ours = estimate_memory(config, 1024, 1)
    assert ours.activation_total == pytest.approx(12.386e9, rel=0.001)
    assert ours.static + 3 * ours.activation_total == pytest.approx(71.20e9, rel=0.001)
    cs336 = estimate_memory(config, 1024, 1, activation_model="cs336")
    assert cs336.static == 16 * count_params(config).total
    assert cs336.activation_total == pytest.approx(15.31e9, rel=0.001)


def test_parse_memory_units_and_errors():
    assert parse_memory("80GB") == 80 * 10**9
    assert parse_memory("80GiB") == 80 * 2**30
    assert parse_memory("1.5e9") == 1_500_000_000
    for bad in ("80 parsecs", "", "-1GB", "GB"):
        with pytest.raises(ValueError, match="memory size"):
            parse_memory(bad)


def test_time_to_train():
    config = ModelConfig.preset("gpt2-small")
    by_rate = time_to_train(config, 1024, 1e9, tokens_per_second=1e5)
    assert by_rate.seconds == pytest.approx(1e4)
    by_mfu = time_to_train(config, 1024, 1e9, peak_tflops=100, mfu=0.5)
    flops_per_token = 3 * forward_flops(config, 1024).total / 1024
    assert by_mfu.seconds == pytest.approx(1e9 * flops_per_token / 50e12)
    with pytest.raises(ValueError, match="mfu"):
        time_to_train(config, 1024, 1e9, peak_tflops=100, mfu=1.5)
    with pytest.raises(ValueError, match="either"):
        time_to_train(config, 1024, 1e9)
    for bad in (float("nan"), float("inf"), 0.0):
        with pytest.raises(ValueError, match="tokens must be a finite positive number"):
            time_to_train(config, 1024, bad, tokens_per_second=1e5)
        with pytest.raises(ValueError, match="tokens_per_second must be a finite positive number"):
            time_to_train(config, 1024, 1e9, tokens_per_second=bad)


def test_cli_table_and_json(capsys):
    argv = ["accounting", "--preset", "gpt2-xl", "--context", "1024", "--batch", "4", "--memory", "80GB",
            "--tflops", "989", "--mfu", "0.4", "--tokens", "10e9"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "2,127,057,600" in table and "largest batch in 80.00 GB: 3" in table and "days" in table
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["params"]["total"] == 2_127_057_600
    assert report["forward_flops"]["total"] == 4 * forward_flops(ModelConfig.preset("gpt2-xl"), 1024).total
    assert report["max_batch"] == {"memory_bytes": 80 * 10**9, "scratchlm": 3, "cs336": 3}
    assert report["kv_cache_bytes"] == {"per_token_fp32": 2 * 48 * 1600 * 4, "per_token_bf16": 2 * 48 * 1600 * 2,
                                        "batch_context_fp32": 4 * 1024 * 2 * 48 * 1600 * 4}
    assert "KV cache when decoding: 614.40 kB per token in fp32" in table
    assert report["time_to_train"]["days"] == pytest.approx(3.87, rel=0.01)


def test_cli_overrides_change_the_model(capsys):
    assert main(["accounting", "--preset", "tiny", "--set", "model.num_layers=5", "--set", "model.ffn=silu",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    expected = ModelConfig.preset("tiny", num_layers=5, ffn="silu")
    assert report["params"]["total"] == count_params(expected).total


@pytest.mark.parametrize("argv, message", [
    (["--preset", "gpt5"], "unknown model preset 'gpt5'"),
    (["--set", "model.d_model=77"], "divisible"),
    (["--set", "optim.lr=1"], "only takes model.* overrides"),
    (["--set", "model.widthh=3"], "widthh"),
    (["--memory", "80parsecs"], "memory size '80parsecs'"),
    (["--tokens", "1e9", "--tflops", "-1"], "peak_tflops > 0"),
    (["--tokens", "1e9", "--steps", "10"], "not both"),
    (["--steps", "0"], "--steps must be positive"),
    (["--tokens", "nan"], "--tokens must be a finite positive number"),
    (["--batch", "0"], "positive"),
])
def test_cli_errors_are_one_line(capsys, argv, message):
    assert main(["accounting", *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bench_ops_runs_small_shape(capsys):
    argv = ["bench", "ops", "--d-model", "32", "--context", "16", "--batch", "2", "--heads", "2", "--repeats", "1"]
    assert main([*argv, "--json"]) == 0
    study = json.loads(capsys.readouterr().out)
    assert [row["op"] for row in study["ours_vs_torch"]][:3] == ["Linear", "RMSNorm", "LayerNorm"]
    assert sum(row["flop_share"] for row in study["block"]) == pytest.approx(1.0)
    block_ops = [row["op"] for row in study["block"]]  # as the model runs them: 3 projections, mask in QK^T
    assert "Q, K, V projections" in block_ops and "QK^T + causal mask" in block_ops and "causal mask" not in block_ops
    norms = [row for row in study["block"] if "RMSNorm" in row["op"]]
    assert all(row["flop_share"] < 0.01 for row in norms)
    assert {row["ffn"] for row in study["ffn_variants"]} == {"SwiGLU", "ReLU FFN", "GELU FFN", "SiLU FFN"}
    assert main(["bench", "ops", "--heads", "3"]) == 1


def test_bench_ops_help_states_the_warmup_that_time_interleaved_uses(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "ops", "--help"])
    warmup = inspect.signature(time_interleaved).parameters["warmup"].default
    assert f"after {warmup} warm-up round" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("overrides", ABLATIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "base")
def test_matrix_table_adds_up_to_the_totals(overrides):
    config = _config(overrides)
    for batch, context in ((1, config.context_length), (3, 7)):
        rows = matrix_table(config, context, batch)
        assert sum(row.params for row in rows) == count_params(config).total
        assert sum(row.forward_flops for row in rows) == forward_flops(config, context, batch).total
    names = [row.name for row in rows]
    expected_ffn = ["W1", "W2", "W3"] if config.ffn == "swiglu" else ["W1", "W2"]
    assert [n for n in names if n.startswith("W")] == expected_ffn
    assert {"Q", "K", "V", "O", "QKᵀ", "AV"} <= set(names) and names[-1].startswith("LM head")


def test_matrix_table_rows_follow_the_matrix_shapes():
    """Each row against its own formula: a d×d projection is d² parameters per layer and 2·B·T·d² FLOPs."""
    config = ModelConfig.preset("gpt2-small")
    batch, context = 2, 512
    rows = {row.name: row for row in matrix_table(config, context, batch)}
    L, d, f, V, h = config.num_layers, config.d_model, config.d_ff, config.vocab_size, config.num_heads
    tokens = batch * context
    for name in "QKVO":
        assert (rows[name].params, rows[name].forward_flops) == (L * d * d, L * 2 * tokens * d * d)
    for name in ("W1", "W2", "W3"):
        assert (rows[name].params, rows[name].forward_flops) == (L * d * f, L * 2 * tokens * d * f)
    per_head = 2 * context * context * (d // h)  # (T×d_k)·(d_k×T), one sequence, one head
    assert rows["QKᵀ"].forward_flops == rows["AV"].forward_flops == L * batch * h * per_head
    assert (rows["LM head"].params, rows["LM head"].forward_flops) == (V * d, 2 * tokens * d * V)
    tied = {row.name: row for row in matrix_table(ModelConfig.preset("gpt2-small", tie_embeddings=True), 8)}
    assert tied["LM head (tied)"].params == 0 and tied["LM head (tied)"].forward_flops == 2 * 8 * d * V


def test_six_n_d_against_the_direct_formula_and_the_exact_count(capsys):
    config = ModelConfig.preset("gpt2-xl")
    steps, batch, context = 400_000, 1024, 1024
    assert main(["accounting", "--preset", "gpt2-xl", "--batch", str(batch), "--steps", str(steps),
                 "--tflops", "19.5", "--mfu", "0.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    compute, tokens = report["training_compute"], steps * batch * context
    n = 2_127_057_600
    assert compute["tokens"] == tokens and six_n_d_flops(n, tokens) == 6 * n * tokens
    assert compute["six_n_d_flops"] == pytest.approx(6 * n * tokens, rel=1e-12)
    assert compute["six_n_d_non_embedding_flops"] == pytest.approx(6 * (n - 50257 * 1600) * tokens, rel=1e-12)
    assert compute["exact_flops"] == pytest.approx(3 * forward_flops(config, context, batch).total * steps, rel=1e-12)
    # 6N·D leaves out the T² attention core and charges the embedding lookup: within a few % at 1024 tokens
    assert 0.9 < compute["six_n_d_flops"] / compute["exact_flops"] < 1.0
    timing = report["time_to_train"]
    assert timing["seconds"] == pytest.approx(compute["exact_flops"] / (19.5e12 * 0.5), rel=1e-9)
    assert timing["years"] == pytest.approx(timing["days"] / 365.25)
    assert sum(row["param_share"] for row in report["matrices"]) == pytest.approx(1.0)
    assert sum(row["flop_share"] for row in report["matrices"]) == pytest.approx(1.0)


def test_tokens_without_a_throughput_give_the_compute_only(capsys):
    assert main(["accounting", "--preset", "tiny", "--tokens", "1e6"]) == 0
    out = capsys.readouterr().out
    assert "6·N·D" in out and "time to train" not in out and "W3 ×L" in out
