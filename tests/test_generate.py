"""generate(): KV-cached decoding equals full recomputation, sampling filters equal simple references."""

from __future__ import annotations

import contextlib
import copy
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchlm.generate.decoding import generate, stream
from scratchlm.generate.sampling import draw, sample_next, top_k_filter, top_p_filter
from scratchlm.model import ModelConfig, TransformerLM, kernels
from scratchlm.model.kernels import packed_linear
from scratchlm.model.layers import linear

CONTEXT = 32  # the tiny preset's context_length


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def model() -> TransformerLM:
    torch.manual_seed(1234)
    model = TransformerLM(ModelConfig.preset("tiny"))
    with torch.no_grad():  # sharper logits than the init's: greedy paths then depend on every detail
        model.lm_head.weight.mul_(8)
    return model


@pytest.fixture(scope="module")
def gqa_model() -> TransformerLM:
    """The switches of pretrained checkpoints: 4 query heads sharing 2 KV heads of head_dim 24 (not 64/4), q/k/v
    biases (random: at 0 they could not show) and llama3 RoPE scaling."""
    torch.manual_seed(4321)
    model = TransformerLM(ModelConfig.preset("tiny", num_kv_heads=2, head_dim=24, qkv_bias=True,
                                             rope_scaling="llama3", rope_original_context=16))
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
        for layer in model.layers:
            for projection in (layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj):
                projection.bias.normal_()
    return model


def _random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


# --- KV cache vs full recomputation -------------------------------------------------------------------------

@pytest.mark.parametrize("which, lengths", [("model", [7]), ("model", [5, 12, 1]), ("gqa_model", [5, 12, 1]),
                                            ("gqa_model", [32, 3])])
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, top_p=0.9, top_k=50, seed=3)])
def test_the_engine_gives_the_recomputed_oracles_tokens_up_to_a_full_context(request, which, lengths, sampling):
    """The engine (KV cache, each prompt prefilled alone, rows joined into one batch) against the oracle that
    recomputes every row's whole sequence each step, greedy and sampled, until the longest row fills the context
    ([32, 3]: a prompt as long as the context, one new token)."""
    model = request.getfixturevalue(which)
    prompts = _random_prompts(lengths)
    steps = CONTEXT + 1 - max(lengths)
    cached = generate(model, prompts, steps, **sampling)
    assert cached == generate(model, prompts, steps, use_cache=False, **sampling)
    assert [len(row) for row in cached] == [steps] * len(prompts)


@pytest.mark.parametrize("use_cache", [True, False])
def test_what_does_not_fit_the_context_is_refused_before_any_work(model, use_cache):
    """No sliding window, in generate() as in the server: prompt + max_new_tokens - 1 must fit the context."""
    with pytest.raises(ValueError, match=f"prompt 1: the prompt has 4 tokens and max_tokens is {CONTEXT - 2}, more "
                                         f"than the model's context of {CONTEXT} tokens holds"):
        generate(model, [[1, 2], [1, 2, 3, 4]], CONTEXT - 2, use_cache=use_cache)  # prompt 0 fits: 2 + 29 tokens
    with pytest.raises(ValueError, match=f"prompt 0: the prompt has {CONTEXT + 1} tokens"):
        stream(model, [1] * (CONTEXT + 1), 1, use_cache=use_cache)
    assert len(generate(model, [1] * CONTEXT, 1, temperature=0, use_cache=use_cache)[0]) == 1


@pytest.mark.parametrize("which", ["model", "gqa_model"])
def test_batch_of_different_lengths_equals_each_prompt_alone(request, which):
    model = request.getfixturevalue(which)
    prompts = _random_prompts([1, 6, 13, 3])
    batch = generate(model, prompts, CONTEXT - 13, temperature=0)
    assert batch == [generate(model, p, CONTEXT - 13, temperature=0)[0] for p in prompts]


# --- stopping, seeds, arguments ------------------------------------------------------------------------------

def test_each_row_stops_at_eos_which_is_not_returned(model):
    prompts = _random_prompts([3, 8])
    free = generate(model, prompts, 20, temperature=0)
    eos = free[0][5]
    stop = free[0].index(eos)
    out = generate(model, prompts, 20, temperature=0, eos_id=eos)
    assert out[0] == free[0][:stop]
    assert out[1] == (free[1][:free[1].index(eos)] if eos in free[1] else free[1])


def test_stream_ends_when_every_row_stopped(model):
    prompt = _random_prompts([3])[0]
    first = generate(model, prompt, 1, temperature=0)[0][0]
    steps = list(stream(model, prompt, 20, temperature=0, eos_id=first))
    assert steps == [[None]]


def test_seed_makes_sampling_reproducible(model):
    prompts = _random_prompts([2, 5])
    options = dict(temperature=1.0, top_k=100, top_p=0.95)
    a = generate(model, prompts, 25, seed=7, **options)
    assert a == generate(model, prompts, 25, seed=7, **options)
    assert a != generate(model, prompts, 25, seed=8, **options)


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    prompt = _random_prompts([4])[0]
    greedy = generate(model, prompt, 20, temperature=0)
    assert generate(model, prompt, 20, top_k=1, seed=0) == greedy
    assert generate(model, prompt, 20, top_p=1e-6, seed=0) == greedy


def test_zero_new_tokens(model):
    assert generate(model, [[1], [2, 3]], 0) == [[], []]


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(prompt_ids=[]), "prompt_ids is empty"),
    (dict(prompt_ids=[[1], []]), "prompt 1 is empty"),
    (dict(prompt_ids=[[1, 2], [3, 256]]), r"prompt 1, position 1: token id 256 is outside the vocabulary \[0, 256\)"),
    (dict(prompt_ids=[-1]), "prompt 0, position 0: token id -1"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=0), "top_k must be a positive integer"),
    (dict(max_new_tokens=-1), "max_new_tokens must be a non-negative integer"),
    (dict(vocab_limit=0), r"vocab_limit must be an integer in \[1, 256\]"),
    (dict(vocab_limit=257), r"vocab_limit must be an integer in \[1, 256\].*got 257"),
    (dict(vocab_limit=True), r"vocab_limit must be an integer in \[1, 256\].*got True"),
])
def test_bad_arguments_are_clear_errors_at_call_time(model, kwargs, message):
    arguments = dict(prompt_ids=[1, 2], max_new_tokens=3) | kwargs
    with pytest.raises(ValueError, match=message):
        stream(model, **arguments)  # raises before the first step is requested


# --- the sampling filters against simple references ----------------------------------------------------------

def _reference_top_p(probs: list[float], p: float) -> set[int]:
    order = sorted(range(len(probs)), key=lambda i: -probs[i])  # stable: ties keep the lower id first
    kept, mass = set(), 0.0
    for i in order:
        if mass >= p:
            break
        kept.add(i)
        mass += probs[i]
    return kept


@settings(max_examples=300, deadline=None)
@given(counts=st.lists(st.integers(0, 16), min_size=1, max_size=12).filter(lambda c: sum(c) > 0),
       p_num=st.integers(1, 64))
def test_top_p_filter_matches_reference_on_exact_boundaries(counts, p_num):
    # Dyadic probabilities and thresholds: every cumulative sum is exact, so "mass reaches p" is tested at the
    # exact boundary, with ties among equal probabilities.
    scale = 1 << (sum(counts) - 1).bit_length()
    probs = [c / scale for c in counts] + [1 - sum(counts) / scale]
    p = p_num / 64
    kept = top_p_filter(torch.tensor(probs), p).nonzero().flatten().tolist()
    assert set(kept) == {i for i in _reference_top_p(probs, p) if probs[i] > 0}


def test_top_p_boundary_examples():
    probs = torch.tensor([0.125, 0.5, 0.25, 0.125])
    assert top_p_filter(probs, 0.5).tolist() == [0, 0.5, 0, 0]  # the top token alone reaches 0.5
    assert top_p_filter(probs, 0.5 + 1e-6).tolist() == [0, 0.5, 0.25, 0]
    assert top_p_filter(probs, 0.875).tolist() == [0.125, 0.5, 0.25, 0]  # tie at the boundary: lower id
    assert top_p_filter(probs, 1.0).tolist() == probs.tolist()


@settings(max_examples=200, deadline=None)
@given(logits=st.lists(st.integers(-4, 4), min_size=1, max_size=10), k=st.integers(1, 12))
def test_top_k_filter_matches_reference_with_ties(logits, k):
    kth = sorted(logits, reverse=True)[min(k, len(logits)) - 1]
    expected = [x if x >= kth else float("-inf") for x in logits]
    assert top_k_filter(torch.tensor(logits, dtype=torch.float32), k).tolist() == expected


def test_sample_next_only_draws_from_the_filtered_set():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).expand(4000, -1)
    gen = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, top_k=2, generator=gen).tolist()) == {0, 1}
    assert set(sample_next(logits, top_p=0.65, generator=gen).tolist()) == {0, 1}
    draws = sample_next(logits, generator=gen)
    frequencies = torch.bincount(draws, minlength=4) / draws.numel()
    torch.testing.assert_close(frequencies, torch.tensor([0.4, 0.3, 0.2, 0.1]), atol=0.03, rtol=0)
    cold = sample_next(logits, temperature=0.05, generator=gen)
    assert (cold == 0).float().mean() > 0.99


@pytest.mark.parametrize("temperature", [1e-40, 1e-50, 5e-324])  # 1e-50 rounds to 0 in float32
def test_tiny_temperature_is_greedy_not_nan(temperature):
    logits = torch.tensor([[1.0, 3.0, 2.0, -50.0], [0.5, -1.0, 0.25, 0.75]])
    drawn = sample_next(logits, temperature=temperature, top_k=2, generator=torch.Generator().manual_seed(0))
    assert drawn.tolist() == [1, 3]


def test_temperature_one_draws_exactly_what_plain_softmax_draws():
    logits = torch.randn(16, 300) * 4
    got = sample_next(logits, generator=torch.Generator().manual_seed(5))
    expected = torch.multinomial(logits.softmax(dim=-1), 1, generator=torch.Generator().manual_seed(5)).squeeze(-1)
    assert torch.equal(got, expected)


def test_draw_with_a_generator_per_row_draws_what_multinomial_draws_for_each_row_alone():
    probs = (torch.randn(6, 300) * 3).softmax(dim=-1)
    probs[2, 5:] = 0.0  # a filtered row (top-k): zeros are never drawn
    got = draw(probs, [torch.Generator().manual_seed(row) for row in range(6)])
    expected = [int(torch.multinomial(probs[row:row + 1], 1, generator=torch.Generator().manual_seed(row)))
                for row in range(6)]
    assert got.tolist() == expected and got[2] < 5


def test_vocab_limit_restricts_every_rule_to_the_first_ids():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0]]).expand(500, -1)  # ids 3 and 4 are the likeliest
    gen = torch.Generator().manual_seed(0)
    assert sample_next(logits, temperature=0, vocab_limit=3).tolist() == [2] * 500
    assert set(sample_next(logits, vocab_limit=3, generator=gen).tolist()) == {0, 1, 2}
    assert set(sample_next(logits, top_k=4, top_p=0.99, vocab_limit=3, generator=gen).tolist()) <= {0, 1, 2}


# --- the `scratchlm generate` command ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    """A run directory with a byte-level tokenizer (256 bytes + <|endoftext|>) and a tiny model."""
    from scratchlm.compat.commands import write_run
    from scratchlm.tokenizer import Tokenizer

    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size)).eval()
    run = tmp_path_factory.mktemp("gen") / "run"
    write_run(model, tokenizer, run)
    return run, model, tokenizer


def test_generate_command_prints_prompt_and_greedy_continuation(byte_run, capsys):
    from scratchlm.cli import main

    run, model, tokenizer = byte_run
    assert main(["generate", "--checkpoint", str(run), "--prompt", "Once", "--max-new-tokens", "20",
                 "--temperature", "0"]) == 0
    expected = generate(model, tokenizer.encode("Once"), 20, temperature=0, eos_id=256)[0]
    assert capsys.readouterr().out == "Once" + tokenizer.decode(expected) + "\n"


def test_generate_command_samples_are_reproducible(byte_run, capsys):
    from scratchlm.cli import main

    run, _, _ = byte_run
    argv = ["generate", "--checkpoint", str(run), "--num-samples", "2", "--seed", "3", "--max-new-tokens", "10"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first and first.count("--- sample") == 2


def test_generate_command_decodes_several_prompts_together_each_as_alone(byte_run, capsys):
    """Every sample of every --prompt in one batch, row r seeded seed + r: each equals that prompt alone."""
    from scratchlm.cli import main

    run, model, tokenizer = byte_run
    argv = ["generate", "--checkpoint", str(run), "--prompt", "Once", "--prompt", "The cat sat", "--num-samples",
            "2", "--seed", "5", "--max-new-tokens", "8", "--temperature", "1.0", "--top-p", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    eos = tokenizer.special_id("<|endoftext|>")
    for row, (text, sample) in enumerate([("Once", 1), ("Once", 2), ("The cat sat", 1), ("The cat sat", 2)]):
        alone = generate(model, tokenizer.encode(text), 8, temperature=1.0, seed=5 + row, eos_id=eos,
                         vocab_limit=tokenizer.vocab_size)[0]
        header = f"--- prompt {1 + row // 2}, sample {sample}/2 ---"
        assert f"{header}\n{text}{tokenizer.decode(alone)}\n" in out


def test_generate_command_in_bf16_follows_the_bf16_model(byte_run, capsys):
    from scratchlm.cli import main

    run, model, tokenizer = byte_run
    assert main(["generate", "--checkpoint", str(run), "--prompt", "Once", "--max-new-tokens", "12",
                 "--temperature", "0", "--dtype", "bf16"]) == 0
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    expected = generate(bf16_model, tokenizer.encode("Once"), 12, temperature=0, eos_id=256)[0]
    assert capsys.readouterr().out == "Once" + tokenizer.decode(expected) + "\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["--checkpoint", "/nonexistent/run"], "/nonexistent/run"),
    (["--tokenizer", "/nonexistent/tok"], "tokenizer directory /nonexistent/tok not found"),
    (["--num-samples", "0"], "--num-samples must be at least 1"),
    (["--top-p", "2"], "top_p must be in"),
])
def test_generate_command_errors_are_one_clear_line(byte_run, capsys, argv, message):
    from scratchlm.cli import main

    run, _, _ = byte_run
    assert main(["generate", "--checkpoint", str(run), *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def padded_run(tmp_path_factory):
    """A run whose model has 320 ids for a 257-id tokenizer, the padding ids made the likeliest ones."""
    from scratchlm.compat.commands import write_run
    from scratchlm.tokenizer import Tokenizer

    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.preset("tiny", vocab_size=320)).eval()
    with torch.no_grad():
        model.lm_head.weight[tokenizer.vocab_size:].mul_(50)
    run = tmp_path_factory.mktemp("gen") / "padded"
    write_run(model, tokenizer, run)
    return run, model, tokenizer


def test_generate_command_never_samples_padding_ids(padded_run, capsys):
    from scratchlm.cli import main

    run, model, tokenizer = padded_run
    prompt = tokenizer.encode("Once")
    assert max(generate(model, prompt, 20, temperature=0)[0]) >= tokenizer.vocab_size  # unrestricted: padding
    assert main(["generate", "--checkpoint", str(run), "--prompt", "Once", "--max-new-tokens", "20",
                 "--temperature", "0"]) == 0
    expected = generate(model, prompt, 20, temperature=0, eos_id=256, vocab_limit=tokenizer.vocab_size)[0]
    assert capsys.readouterr().out == "Once" + tokenizer.decode(expected) + "\n"
    assert main(["generate", "--checkpoint", str(run), "--max-new-tokens", "32", "--seed", "0",
                 "--temperature", "1", "--top-p", "1"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("device", "message"), [
    ("bogus", "device 'bogus' is not one of auto, cpu, mps, cuda or cuda:N"),
    pytest.param("cuda", "device 'cuda': CUDA is not available", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_generate_command_rejects_a_bad_device_in_one_line(byte_run, capsys, device, message):
    from scratchlm.cli import main

    run, _, _ = byte_run
    assert main(["generate", "--checkpoint", str(run), "--device", device]) == 1
    err = capsys.readouterr().err
    assert message in err and "train.device" not in err and len(err.strip().splitlines()) == 1


def test_select_device_validates_the_name(monkeypatch):
    from scratchlm.train.setup import select_device

    assert select_device("cpu") == torch.device("cpu")
    for bad in ("bogus", "cpu\n", "cuda:x", "cuda:"):
        with pytest.raises(ValueError, match=re.escape(f"device {bad!r} is not one of")):
            select_device(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert select_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"device 'cuda:2': this machine has 2 CUDA device\(s\)"):
        select_device("cuda:2")


def test_stream_writer_holds_back_partial_utf8_characters():
    import io

    from scratchlm.generate.commands import write_stream
    from scratchlm.tokenizer import Tokenizer

    text = "a🐱é日"
    data = text.encode()
    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [])

    class Recorder(io.StringIO):
        writes: list[str] = []

        def write(self, s):
            self.writes.append(s)
            return super().write(s)

    out = Recorder()
    write_stream("P:", list(data) + [None, 65], tokenizer, out)  # None: the row stopped; 65 must not print
    assert out.getvalue() == "P:" + text + "\n"
    assert all("\ufffd" not in w for w in out.writes)  # never a replacement char for a split character
    out = Recorder()
    write_stream("", list(data[:-1]), tokenizer, out)  # cut inside the last character: flushed as U+FFFD
    assert out.getvalue() == "a🐱é\ufffd\n"


def test_batched_decoding_packed_or_not_matches_the_readable_model_and_drops_the_copies(model, monkeypatch):
    """With the weights packed for oneDNN (where this torch can) or not, the greedy tokens are the readable
    model's."""
    prompts = _random_prompts([5, 9, 2, 7])
    steps = stream(model, prompts, CONTEXT - 8, temperature=0)
    next(steps)
    assert model.lm_head.matmul is not linear  # few_rows_linear, or a packed copy over it
    steps.close()  # a caller that stops early
    assert model.lm_head.matmul is linear  # the model is back on the readable path
    decoding = kernels.decoding
    monkeypatch.setattr(kernels, "decoding",  # the readable model
                        lambda m, compile=False, batch=None: contextlib.nullcontext(kernels.forward_step(m)))
    want = generate(model, prompts, CONTEXT - 8, temperature=0)
    monkeypatch.setattr(kernels, "decoding", decoding)
    assert generate(model, prompts, CONTEXT - 8, temperature=0) == want
    assert model.lm_head.matmul is linear
    monkeypatch.setattr(packed_linear, "available", lambda: False)
    assert generate(model, prompts, CONTEXT - 8, temperature=0) == want
