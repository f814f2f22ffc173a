"""The CS336 adapter surface: every function exists with the assignment's signature and agrees with torch."""

from __future__ import annotations

import inspect
import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from scratchlm.compat import cs336

# The assignment's adapter names and parameter lists, in order.
SIGNATURES = {
    "run_linear": ["d_in", "d_out", "weights", "in_features"],
    "run_embedding": ["vocab_size", "d_model", "weights", "token_ids"],
    "run_swiglu": ["d_model", "d_ff", "w1_weight", "w2_weight", "w3_weight", "in_features"],
    "run_scaled_dot_product_attention": ["Q", "K", "V", "mask"],
    "run_multihead_self_attention": ["d_model", "num_heads", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                                     "o_proj_weight", "in_features"],
    "run_multihead_self_attention_with_rope": ["d_model", "num_heads", "max_seq_len", "theta", "q_proj_weight",
                                               "k_proj_weight", "v_proj_weight", "o_proj_weight", "in_features",
                                               "token_positions"],
    "run_rope": ["d_k", "theta", "max_seq_len", "in_query_or_key", "token_positions"],
    "run_transformer_block": ["d_model", "num_heads", "d_ff", "max_seq_len", "theta", "weights", "in_features"],
    "run_transformer_lm": ["vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff",
                           "rope_theta", "weights", "in_indices"],
    "run_rmsnorm": ["d_model", "eps", "weights", "in_features"],
    "run_silu": ["in_features"],
    "run_softmax": ["in_features", "dim"],
    "run_get_batch": ["dataset", "batch_size", "context_length", "device"],
    "run_cross_entropy": ["inputs", "targets"],
    "run_gradient_clipping": ["parameters", "max_l2_norm"],
    "get_adamw_cls": [],
    "run_get_lr_cosine_schedule": ["it", "max_learning_rate", "min_learning_rate", "warmup_iters",
                                   "cosine_cycle_iters"],
    "run_save_checkpoint": ["model", "optimizer", "iteration", "out"],
    "run_load_checkpoint": ["src", "model", "optimizer"],
    "get_tokenizer": ["vocab", "merges", "special_tokens"],
    "run_train_bpe": ["input_path", "vocab_size", "special_tokens", "kwargs"],
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_adapter_signature(name):
    parameters = list(inspect.signature(getattr(cs336, name)).parameters)
    assert parameters == SIGNATURES[name]


def test_linear_embedding_rmsnorm_silu_softmax_match_torch():
    x = torch.randn(2, 5, 8)
    w = torch.randn(3, 8)
    torch.testing.assert_close(cs336.run_linear(8, 3, w, x), F.linear(x, w))
    table = torch.randn(11, 4)
    ids = torch.randint(0, 11, (2, 7))
    torch.testing.assert_close(cs336.run_embedding(11, 4, table, ids), F.embedding(ids, table))
    gain = torch.rand(8) + 0.5
    torch.testing.assert_close(cs336.run_rmsnorm(8, 1e-5, gain, x), F.rms_norm(x, (8,), gain, eps=1e-5))
    torch.testing.assert_close(cs336.run_silu(x), F.silu(x))
    torch.testing.assert_close(cs336.run_softmax(x, dim=1), torch.softmax(x, dim=1))


def test_swiglu_matches_formula():
    d_model, d_ff = 8, 16
    w1, w2, w3 = torch.randn(d_ff, d_model), torch.randn(d_model, d_ff), torch.randn(d_ff, d_model)
    x = torch.randn(3, d_model)
    expected = F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
    torch.testing.assert_close(cs336.run_swiglu(d_model, d_ff, w1, w2, w3, x), expected)


def test_attention_adapters_match_torch_sdpa():
    q, k, v = torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4)
    mask = torch.rand(2, 3, 6, 6) > 0.3
    mask[..., 0] = True  # no fully masked rows: torch returns NaN there
    torch.testing.assert_close(cs336.run_scaled_dot_product_attention(q, k, v, mask),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask))

    d_model, heads, seq = 12, 3, 7
    wq, wk, wv, wo = (torch.randn(d_model, d_model) / 4 for _ in range(4))
    x = torch.randn(2, seq, d_model)

    def split(t):
        return t.view(2, seq, heads, d_model // heads).transpose(1, 2)

    attended = F.scaled_dot_product_attention(split(F.linear(x, wq)), split(F.linear(x, wk)),
                                              split(F.linear(x, wv)), is_causal=True)
    expected = F.linear(attended.transpose(1, 2).reshape(2, seq, d_model), wo)
    got = cs336.run_multihead_self_attention(d_model, heads, wq, wk, wv, wo, x)
    torch.testing.assert_close(got, expected)


def test_rope_adapter_rotates_adjacent_pairs():
    d_k, theta = 4, 10_000.0
    x = torch.randn(1, 3, d_k)
    positions = torch.tensor([[0, 1, 5]])
    got = cs336.run_rope(d_k, theta, 8, x, positions)
    expected = torch.empty_like(x)
    for t, pos in enumerate(positions[0].tolist()):
        for i in range(d_k // 2):
            angle = pos / theta ** (2 * i / d_k)
            a, b = x[0, t, 2 * i], x[0, t, 2 * i + 1]
            expected[0, t, 2 * i] = a * np.cos(angle) - b * np.sin(angle)
            expected[0, t, 2 * i + 1] = a * np.sin(angle) + b * np.cos(angle)
    torch.testing.assert_close(got, expected)


def test_transformer_lm_and_block_take_reference_state_dict_names():
    from scratchlm.model import ModelConfig, TransformerLM

    config = ModelConfig.preset("tiny")
    model = TransformerLM(config)
    ids = torch.randint(0, config.vocab_size, (2, 9))
    weights = model.state_dict()
    got = cs336.run_transformer_lm(config.vocab_size, config.context_length, config.d_model, config.num_layers,
                                   config.num_heads, config.d_ff, config.rope_theta, weights, ids)
    torch.testing.assert_close(got, model(ids))
    block_weights = {k.removeprefix("layers.0."): v for k, v in weights.items() if k.startswith("layers.0.")}
    x = torch.randn(2, 9, config.d_model)
    got_block = cs336.run_transformer_block(config.d_model, config.num_heads, config.d_ff, config.context_length,
                                            config.rope_theta, block_weights, x)
    torch.testing.assert_close(got_block, model.layers[0](x))


def test_training_pieces_match_torch():
    logits, targets = torch.randn(4, 7, 10) * 30, torch.randint(0, 10, (4, 7))
    torch.testing.assert_close(cs336.run_cross_entropy(logits, targets),
                               F.cross_entropy(logits.reshape(-1, 10), targets.reshape(-1)))
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(2)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, t in zip(params, twins):
        p.grad = torch.randn_like(p) * 10
        t.grad = p.grad.clone()
    cs336.run_gradient_clipping(params, 1.0)
    torch.nn.utils.clip_grad_norm_(twins, 1.0)
    for p, t in zip(params, twins):
        torch.testing.assert_close(p.grad, t.grad)
    assert cs336.run_get_lr_cosine_schedule(0, 1.0, 0.1, 10, 100) == 0.0
    assert cs336.run_get_lr_cosine_schedule(200, 1.0, 0.1, 10, 100) == pytest.approx(0.1)


def test_adamw_class_matches_torch():
    ours_p = torch.nn.Parameter(torch.randn(6, 4))
    ref_p = torch.nn.Parameter(ours_p.detach().clone())
    ours = cs336.get_adamw_cls()([ours_p], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW([ref_p], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(20):
        grad = torch.randn(6, 4)
        for p, opt in ((ours_p, ours), (ref_p, ref)):
            p.grad = grad.clone()
            opt.step()
    torch.testing.assert_close(ours_p, ref_p)


def test_get_batch_and_checkpoint_round_trip():
    data = np.arange(100)
    x, y = cs336.run_get_batch(data, 4, 8, "cpu")
    assert x.shape == y.shape == (4, 8)
    assert torch.equal(y, x + 1)

    model = torch.nn.Linear(3, 2)
    optimizer = cs336.get_adamw_cls()(model.parameters(), lr=1e-3)
    model(torch.randn(1, 3)).sum().backward()
    optimizer.step()
    buffer = io.BytesIO()
    cs336.run_save_checkpoint(model, optimizer, 42, buffer)
    buffer.seek(0)
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = cs336.get_adamw_cls()(fresh.parameters(), lr=1e-3)
    assert cs336.run_load_checkpoint(buffer, fresh, fresh_opt) == 42
    torch.testing.assert_close(fresh.weight, model.weight)


def test_tokenizer_adapters(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("low lower lowest<|endoftext|>newer newest wider" * 20)
    vocab, merges = cs336.run_train_bpe(corpus, 270, ["<|endoftext|>"])
    assert len(vocab) == 270 and len(merges) == 270 - 257
    tokenizer = cs336.get_tokenizer(vocab, merges, ["<|endoftext|>"])
    text = "lowest newer<|endoftext|>wide"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert [vocab[i] for i in ids].count(b"<|endoftext|>") == 1  # the special token is one id, never split


# Defaults in the course file (every other parameter is required).
COURSE_DEFAULTS = {("run_scaled_dot_product_attention", "mask"): None,
                   ("run_multihead_self_attention_with_rope", "token_positions"): None,
                   ("get_tokenizer", "special_tokens"): None}


def _written_adapters(tmp_path, capsys):
    """`scratchlm cs336 adapters` to stdout, imported as a module from the file a student would write."""
    import importlib.util

    from scratchlm.cli import main

    assert main(["cs336", "adapters"]) == 0
    path = tmp_path / "adapters.py"
    path.write_text(capsys.readouterr().out)
    spec = importlib.util.spec_from_file_location("written_adapters", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_written_adapters_module_has_the_course_names_parameters_and_defaults(tmp_path, capsys):
    adapters = _written_adapters(tmp_path, capsys)
    written = {name for name, value in vars(adapters).items()
               if inspect.isfunction(value) and value.__module__ == adapters.__name__}
    assert written == set(SIGNATURES)
    for name, expected in SIGNATURES.items():
        parameters = inspect.signature(getattr(adapters, name)).parameters
        assert list(parameters) == expected, name
        for parameter in parameters.values():
            default = COURSE_DEFAULTS.get((name, parameter.name), inspect.Parameter.empty)
            assert parameter.default is default, (name, parameter.name)
    assert inspect.signature(adapters.run_train_bpe).parameters["kwargs"].kind is inspect.Parameter.VAR_KEYWORD


def test_written_adapters_run(tmp_path, capsys):
    from scratchlm.model import ModelConfig, TransformerLM

    adapters = _written_adapters(tmp_path, capsys)
    x, w = torch.randn(2, 5, 8), torch.randn(3, 8)
    torch.testing.assert_close(adapters.run_linear(8, 3, w, x), F.linear(x, w))
    logits = torch.randn(6, 11) * 20
    targets = torch.randint(0, 11, (6,))
    torch.testing.assert_close(adapters.run_cross_entropy(logits, targets), F.cross_entropy(logits, targets))
    config = ModelConfig.preset("tiny")
    model = TransformerLM(config)
    ids = torch.randint(0, config.vocab_size, (2, 9))
    got = adapters.run_transformer_lm(config.vocab_size, config.context_length, config.d_model, config.num_layers,
                                      config.num_heads, config.d_ff, config.rope_theta, model.state_dict(), ids)
    torch.testing.assert_close(got, model(ids))
    assert adapters.get_adamw_cls() is cs336.get_adamw_cls()


def test_adapters_out_writes_the_same_text(tmp_path, capsys):
    from scratchlm.cli import main

    main(["cs336", "adapters"])
    printed = capsys.readouterr().out
    assert main(["cs336", "adapters", "--out", str(tmp_path / "a.py")]) == 0
    assert (tmp_path / "a.py").read_text() == printed
