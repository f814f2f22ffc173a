"""The continuously batched engine, without HTTP: every sequence gets what generate() gives it alone, however
the batch around it changes (joins between steps, leaves, padding, compaction at the context's end); the cache
row operations keep each row's keys, padding and positions; stop strings and UTF-8 as `generate` prints."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchlm.generate import batch_cache
from scratchlm.generate.decoding import generate
from scratchlm.generate.engine import Engine, Failed, Finished, PromptLogprobs, Sampling, Sequence, Token, _Row
from scratchlm.generate.sampling import sample_next
from scratchlm.generate.text import TextStream
from scratchlm.model import KVCache
from serve_helpers import CONTEXT, EOS, byte_tokenizer, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1234)


class Collector:
    """The events of one sequence."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.text = ""
        self.prompt: PromptLogprobs | None = None
        self.end: Finished | Failed | None = None
        self.done = threading.Event()

    def __call__(self, event) -> None:
        if isinstance(event, Token):
            self.tokens.append(event.id)
            self.text += event.text
        elif isinstance(event, PromptLogprobs):
            self.prompt = event
        else:
            self.end = event
            self.text += getattr(event, "text", "")
            self.done.set()


def _submit(engine: Engine, prompt: list[int], sampling: Sampling) -> Collector:
    collector = Collector()
    engine.submit([Sequence(prompt, sampling, collector)])
    return collector


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_staggered_sequences_each_get_what_generate_gives_them_alone(model, temperature):
    """Sequences join a running batch at different steps (and with different prompt lengths, so with padding and
    shifts), with max_tokens up to the context's end (compaction); each equals generate() alone, seed for seed."""
    lengths = [3, 17, 1, 40, 9, 64, 2, 25]
    prompts = _prompts(lengths)
    budgets = [CONTEXT + 1 - n if i % 3 == 0 else 20 + i for i, n in enumerate(lengths)]
    expected = [generate(model, p, b, temperature=temperature, top_p=0.9, eos_id=EOS, seed=100 + i)[0]
                for i, (p, b) in enumerate(zip(prompts, budgets))]
    engine = Engine(model, byte_tokenizer(), eos_id=EOS, max_batch=5).start()
    try:
        collectors = []
        for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
            collectors.append(_submit(engine, prompt, Sampling(budget, temperature, top_p=0.9, seed=100 + i)))
            time.sleep(0.002 * i)  # joins between the steps of the others
        for collector in collectors:
            assert collector.done.wait(60)
    finally:
        engine.close()
    assert [c.tokens for c in collectors] == expected
    for collector, tokens, budget in zip(collectors, expected, budgets):
        assert collector.end.reason == ("length" if len(tokens) == budget else "stop")
        assert collector.end.completion_tokens == len(tokens)


def test_cancelled_sequences_leave_and_the_others_are_unaffected(model):
    prompts = _prompts([5, 8, 13, 4])
    expected = [generate(model, p, 60, temperature=0, eos_id=EOS)[0] for p in prompts]
    engine = Engine(model, byte_tokenizer(), eos_id=EOS, max_batch=4)
    sequences = [Sequence(p, Sampling(60, 0.0), Collector()) for p in prompts]
    sequences[1].cancel()  # before it ever runs
    engine.submit(sequences)
    engine.start()
    try:
        while len(sequences[2].emit.tokens) < 3:
            time.sleep(0.001)
        sequences[2].cancel()  # mid-decoding
        for index in (0, 3):
            assert sequences[index].emit.done.wait(60)
        deadline = time.monotonic() + 10
        while engine.stats()["active"] and time.monotonic() < deadline:
            time.sleep(0.005)
        assert engine.stats()["active"] == 0
    finally:
        engine.close()
    assert [sequences[i].emit.tokens for i in (0, 3)] == [expected[0], expected[3]]
    assert sequences[1].emit.tokens == [] and sequences[1].emit.end is None
    assert sequences[2].emit.tokens == expected[2][:len(sequences[2].emit.tokens)]
    assert sequences[2].emit.end is None


def test_prompt_logprobs_equal_the_models_log_softmax(model):
    prompt = _prompts([30])[0]
    engine = Engine(model, byte_tokenizer(), eos_id=EOS).start()
    try:
        collector = _submit(engine, prompt, Sampling(0, logprobs=3, prompt_logprobs=True))
        assert collector.done.wait(30)
    finally:
        engine.close()
    with torch.no_grad():
        scores = model(torch.tensor([prompt]))[0, :, :257].log_softmax(-1)  # (P, V), no cache, all at once
    expected = scores[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    got = collector.prompt
    assert got.logprobs[0] is None and got.top[0] is None
    torch.testing.assert_close(torch.tensor(got.logprobs[1:]), expected, rtol=0, atol=1e-5)
    top_values, top_ids = scores[:-1].topk(3, dim=-1)
    assert [list(t) for t in got.top[1:]] == top_ids.tolist()
    torch.testing.assert_close(torch.tensor([list(t.values()) for t in got.top[1:]]), top_values, rtol=0, atol=1e-5)
    assert collector.end == Finished("length") and collector.tokens == []


def test_check_refuses_what_the_context_or_vocabulary_cannot_hold(model):
    engine = Engine(model, byte_tokenizer(), eos_id=EOS)
    engine.check([1] * CONTEXT, 1)  # the last sampled token is never fed back: it fits
    with pytest.raises(ValueError, match="more than the model's context of 128"):
        engine.check([1] * CONTEXT, 2)
    with pytest.raises(ValueError, match=r"token id 257 is outside the vocabulary \[0, 257\)"):
        engine.check([1, 257], 1)
    with pytest.raises(ValueError, match="empty"):
        engine.check([], 1)


# --- the cache row operations -----------------------------------------------------------------------------

def _prefilled(model, prompt: list[int]) -> tuple[KVCache, torch.Tensor]:
    cache = KVCache.for_model(model, 1)
    logits = model(torch.tensor([prompt]), kv_cache=cache, last_only=True)[:, -1]
    return cache, logits


def test_a_long_row_leaving_takes_its_columns_with_it(model):
    """After the longest row ends, the cache shrinks to the longest row left (the steps attend over its length),
    and the row left still decodes what generate() gives it alone."""
    short, long = _prompts([3, 40])
    expected = generate(model, short, 30, temperature=0)[0]
    engine = Engine(model, byte_tokenizer(), eos_id=None, max_batch=2)
    sequences = [Sequence(long, Sampling(2, 0.0), Collector()), Sequence(short, Sampling(30, 0.0), Collector())]
    engine.submit(sequences)
    with torch.inference_mode():
        engine._step()  # both prefilled (the short one left-padded to 40) and one step decoded
        while len(engine._rows) == 2:
            engine._step()
        assert engine._batch.cache.length == len(short) + len(sequences[1].emit.tokens) - 1  # no padding column left
        while engine._rows:
            engine._step()
    assert sequences[1].emit.tokens == expected


def test_a_batch_of_mixed_settings_samples_each_row_as_it_would_alone():
    """One pass samples rows with different temperatures, top-k and top-p (greedy among them): each row draws the
    token sample_next draws for it alone from a generator of the same seed."""
    gen = torch.Generator().manual_seed(3)
    settings = [Sampling(1, 0.0), Sampling(1, 0.7, top_k=5), Sampling(1, 1.3, top_p=0.8), Sampling(1, 1.0),
                Sampling(1, 0.7, top_k=5, top_p=0.5), Sampling(1, 1e-30)]
    for trial in range(25):
        logits = torch.randn(len(settings), 300, generator=gen) * 4
        rows = [_Row(Sequence([1], Sampling(**{**vars(s), "seed": trial * 10 + i}), lambda e: None),
                     byte_tokenizer(), torch.device("cpu")) for i, s in enumerate(settings)]
        alone = [int(sample_next(logits[i:i + 1], temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                 generator=torch.Generator().manual_seed(trial * 10 + i)))
                 for i, s in enumerate(settings)]
        assert Engine._choose(rows, logits) == alone


@torch.no_grad()
def test_add_keep_compact_keep_every_rows_next_logits(model):
    """Rows added at different lengths (the longest last, so the others shift right), some dropped, the padding
    compacted: one batched step gives each row the logits it gets alone (the oracle: its own single-row cache)."""
    prompts = _prompts([7, 2, 11, 19])
    batch = batch_cache.BatchCache(model, capacity=5)
    for prompt in prompts:
        batch.add(_prefilled(model, prompt)[0])
    assert batch.cache.length == 19 and batch.rows == 4 and batch.cache.has_padding
    assert batch.keep([0, 1, 2]) == [0, 1, 2]  # the longest leaves: columns 0-7 are padding everywhere
    assert batch.compact() == 8 and batch.cache.length == 11
    nxt = torch.tensor([[5], [6], [7]])
    batched = model(nxt, kv_cache=batch.cache, last_only=True)[:, -1]
    for row in range(3):
        single, _ = _prefilled(model, prompts[row])
        expected = model(nxt[row:row + 1], kv_cache=single, last_only=True)[:, -1]
        torch.testing.assert_close(batched[row:row + 1], expected, rtol=1e-5, atol=1e-5)
    assert batch.keep([]) == [] and batch.cache is None and batch.rows == 0


@torch.no_grad()
def test_a_row_that_joins_where_another_left_sees_none_of_its_keys(model):
    """Rows leave from the middle and others join into their buffer rows: every row still gets its own logits
    (a joining row's padding columns are cleared, not the departed row's keys), and a full batch is refused."""
    prompts = _prompts([9, 4, 15, 6, 3], seed=1)
    batch = batch_cache.BatchCache(model, capacity=3)
    for prompt in prompts[:3]:
        batch.add(_prefilled(model, prompt)[0])
    with pytest.raises(ValueError, match="holds 3 rows"):
        batch.add(_prefilled(model, prompts[3])[0])
    assert batch.keep([0, 2]) == [0, 2]  # the row of 4 leaves from the middle; the row of 15 moves up
    for prompt in prompts[3:4]:
        batch.add(_prefilled(model, prompt)[0])
    assert batch.keep([1, 2]) == [2, 1]  # the first leaves: the last row takes its place
    batch.store.values[0][2] = float("nan")  # the free buffer row: what a departed row might have left
    batch.add(_prefilled(model, prompts[4])[0])
    assert batch.cache.length == 15
    nxt = torch.tensor([[5], [6], [7]])
    batched = model(nxt, kv_cache=batch.cache, last_only=True)[:, -1]
    for row, source in enumerate((3, 2, 4)):
        single, _ = _prefilled(model, prompts[source])
        expected = model(nxt[row:row + 1], kv_cache=single, last_only=True)[:, -1]
        torch.testing.assert_close(batched[row:row + 1], expected, rtol=1e-5, atol=1e-5)


# --- text: UTF-8 and stop strings --------------------------------------------------------------------------

def _stream(tokens: list[int], stop: tuple[str, ...]) -> tuple[list[str], bool]:
    text = TextStream(byte_tokenizer(), stop)
    pieces = []
    for token in tokens:
        pieces.append(text.add(token))
        if text.stopped:
            break
    pieces.append(text.finish())
    return pieces, text.stopped


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab\u00e9\U0001f600\n", max_size=30),
       st.lists(st.text(alphabet="ab\u00e9\n", min_size=1, max_size=4), max_size=3))
def test_text_stream_cuts_at_the_first_stop_string_and_never_shows_part_of_one(text, stops):
    pieces, stopped = _stream(list(text.encode()), tuple(stops))
    joined = "".join(pieces)
    # Decoding stops as soon as a stop string is complete: at the shortest prefix holding one, cut before the
    # earliest stop string in that prefix.
    prefix = next((text[:k] for k in range(1, len(text) + 1) if any(s in text[:k] for s in stops)), None)
    cut = None if prefix is None else min(i for s in stops if (i := prefix.find(s)) >= 0)
    assert joined == (text if cut is None else text[:cut])
    assert stopped == (cut is not None)
    shown = ""
    for piece in pieces[:-1]:  # what a client has seen before the end never holds a stop string
        shown += piece
        assert not any(s in shown for s in stops)


def test_text_stream_holds_back_partial_utf8_and_flushes_a_dangling_byte():
    pieces, _ = _stream(list("é".encode()) + [0xF0], ())
    assert pieces == ["", "é", "", "\ufffd"]


def test_a_compiling_engine_gives_a_sequence_alone_what_generate_compile_gives_it(model):
    """`scratchlm serve --compile` (a bf16 model): a sequence alone gets generate(..., compile=True)'s tokens, seed for
    seed; beside another (the batch graph: two rows and up), both run to their ends."""
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    prompt, other = _prompts([7, 12], seed=3)
    expected = generate(bf16, prompt, 30, temperature=1.0, eos_id=EOS, seed=5, compile=True)[0]
    engine = Engine(bf16, byte_tokenizer(), eos_id=EOS, max_batch=4, compile=True).start()
    try:
        alone = _submit(engine, prompt, Sampling(30, 1.0, seed=5))
        assert alone.done.wait(120)
        pair = [_submit(engine, p, Sampling(25, 1.0, seed=6)) for p in (prompt, other)]
        for collector in pair:
            assert collector.done.wait(120)
    finally:
        engine.close()
    assert alone.tokens == expected
    assert all(c.end.reason in ("length", "stop") and c.end.completion_tokens == len(c.tokens) for c in pair)


def test_an_engine_that_cannot_decode_fails_its_start_and_every_request_with_the_reason(model, monkeypatch):
    """A server whose engine died must not look healthy: start() raises the reason (`serve` exits with it), and
    the engine refuses what is submitted after."""
    from scratchlm.generate import engine as engine_module

    def broken_decoding(m, compile=False, batch=None):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(engine_module.kernels, "decoding", broken_decoding)
    engine = Engine(model, byte_tokenizer(), eos_id=EOS, max_batch=4)
    try:
        with pytest.raises(RuntimeError, match="the decoding engine failed: RuntimeError: mkldnn_reorder"):
            engine.start()
        assert engine.failed and "avx512bw" in engine.failure
        with pytest.raises(RuntimeError, match="the decoding engine failed"):
            _submit(engine, [1, 2, 3], Sampling(max_tokens=3, temperature=0))
    finally:
        engine.close()
