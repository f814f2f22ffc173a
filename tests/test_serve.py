"""`scratchlm serve`'s HTTP side against real clients: the official `openai` client (completions, streaming,
errors) and httpx for what it cannot send (malformed bodies). Every bad request in the table gets its status and
message, and the server keeps serving; a client that disconnects mid-stream frees its slot; the same request and
seed alone on the server gives the text `scratchlm generate --seed` prints."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from scratchlm.generate.decoding import generate
from scratchlm.generate.engine import Sampling, Sequence
from scratchlm.model import TransformerLM
from scratchlm.serve.commands import off_the_main_thread
from serve_helpers import CONTEXT, EOS, MODEL_NAME, byte_tokenizer, httpx, serving, tiny_model, wait_until_idle

openai = pytest.importorskip("openai", reason="the test extra's openai client is not installed")


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def server(model):
    with serving(model, max_body_bytes=20_000, max_tokens=500) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=60)


def _text(ids: list[int]) -> str:
    return byte_tokenizer().decode(ids)


def test_a_greedy_completion_is_generates_continuation(client, model):
    response = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=20, temperature=0)
    expected = generate(model, list(b"Once upon"), 20, temperature=0, eos_id=EOS)[0]
    (choice,) = response.choices
    assert choice.text == _text(expected)
    assert choice.finish_reason == ("length" if len(expected) == 20 else "stop")
    assert response.usage.prompt_tokens == 9 and response.usage.completion_tokens == len(expected)
    assert response.model == MODEL_NAME and response.object == "text_completion"


def test_seeded_sampling_equals_the_generate_command(client, server, tmp_path, capsys):
    """The same prompt, settings and seed through `scratchlm generate` and through the server: the same text."""
    from scratchlm.cli import main
    from scratchlm.compat.commands import write_run

    engine = server[1]
    write_run(engine.model, byte_tokenizer(), tmp_path / "run")
    argv = ["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "Lily saw", "--max-new-tokens", "40",
            "--temperature", "0.9", "--top-p", "0.8", "--top-k", "50", "--seed", "7", "--num-samples", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    response = client.completions.create(model=MODEL_NAME, prompt="Lily saw", max_tokens=40, temperature=0.9,
                                         top_p=0.8, seed=7, n=2, extra_body={"top_k": 50})
    texts = [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    assert printed == "".join(f"--- sample {i + 1}/2 ---\nLily saw{text}\n" for i, text in enumerate(texts))
    assert texts[0] != texts[1]


def test_streaming_yields_the_same_text_in_pieces_and_ends(client):
    settings = dict(model=MODEL_NAME, prompt="The cat", max_tokens=60, temperature=0.7, seed=3)
    whole = client.completions.create(**settings).choices[0]
    chunks = list(client.completions.create(**settings, stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 2
    assert "".join(c.choices[0].text for c in text_chunks) == whole.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == whole.finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage.completion_tokens > 0


def test_the_stream_ends_with_done(server):
    with httpx.stream("POST", f"{server[0]}/v1/completions", json={"prompt": "a", "max_tokens": 5,
                                                                   "stream": True}) as response:
        events = [line for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_stop_strings_cut_the_completion(client, model):
    full = _text(generate(model, list(b"ab"), 60, temperature=0, eos_id=EOS)[0])
    stop = full[5:7]
    response = client.completions.create(model=MODEL_NAME, prompt="ab", max_tokens=60, temperature=0, stop=[stop])
    assert response.choices[0].text == full[:full.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_a_list_of_prompts_and_n_give_one_choice_each_in_order(client, model):
    for prompts in (["x", "yy", "zzz"], [list(b"x"), list(b"yy"), [5, 6, 7]]):
        response = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=8, temperature=0, n=2)
        assert [c.index for c in response.choices] == list(range(6))
        for index, prompt in enumerate(prompts):
            ids = list(prompt.encode()) if isinstance(prompt, str) else prompt
            expected = _text(generate(model, ids, 8, temperature=0, eos_id=EOS)[0])
            assert [c.text for c in response.choices[2 * index:2 * index + 2]] == [expected, expected]


def test_echo_with_logprobs_gives_the_prompts_log_likelihood(client, model):
    """What lm-eval's local-completions asks for a log-likelihood: echo, max_tokens 0, logprobs 1."""
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                         temperature=0)
    choice = response.choices[0]
    with torch.no_grad():
        scores = model(torch.tensor([prompt]))[0, :-1, :257].log_softmax(-1)
    expected = scores.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert choice.text == _text(prompt) and choice.logprobs.token_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(choice.logprobs.token_logprobs[1:]), expected, rtol=0, atol=1e-5)
    assert choice.logprobs.tokens == [_text([t]) for t in prompt]
    greedy = scores.argmax(-1).tolist()
    assert [max(top, key=top.get) for top in choice.logprobs.top_logprobs[1:]] == [_text([t]) for t in greedy]


def _eos_after(prompt: list[int], seed: int = 1) -> TransformerLM:
    """A tiny model whose greedy token after `prompt` is <|endoftext|>: its output row is the final hidden state
    there, scaled up (every other position keeps its own likeliest token, mostly)."""
    model = tiny_model(seed)
    seen = []
    handle = model.lm_head.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0]))
    with torch.no_grad():
        model(torch.tensor([prompt]))
        handle.remove()
        model.lm_head.weight[EOS] = seen[0][0, -1] * 100
        assert model(torch.tensor([prompt]))[0, -1].argmax().item() == EOS
    return model


def test_lm_evals_loglikelihood_requests_read_every_continuation_token():
    """lm-eval 0.4.13's local-completions, as lm_eval/models/openai_completions.py builds and reads it: a batch of
    token-id prompts (context + continuation), echo, max_tokens 1, logprobs 1, temperature 0; the log-likelihood is
    sum(token_logprobs[ctxlen:-1]) (the last entry being the sampled token) and the request is greedy when each of
    those equals max(top_logprobs[i].values()). So a sampled <|endoftext|> must have its entry too."""
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (length,), generator=generator).tolist() for length in (9, 30, 2)]
    model = _eos_after(prompts[0])
    ctxlens = [4, 29, 1]
    payload = {"model": MODEL_NAME, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
               "seed": 1234, "echo": True}
    with serving(model) as (url, _):
        response = httpx.post(f"{url}/v1/completions", json=payload, timeout=60)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    sampled = []  # the greedy token after each prompt
    for prompt, ctxlen, choice in zip(prompts, ctxlens, choices):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == len(prompt) + 1
        with torch.no_grad():
            scores = model(torch.tensor([prompt]))[0, :, :257].log_softmax(-1)  # position i predicts token i + 1
        wanted = torch.tensor(prompt[ctxlen:])
        expected = scores[ctxlen - 1:-1].gather(-1, wanted[:, None])[:, 0]
        greedy = bool((scores[ctxlen - 1:-1].argmax(-1) == wanted).all())
        token_logprobs, top = logprobs["token_logprobs"][ctxlen:-1], logprobs["top_logprobs"][ctxlen:-1]
        assert sum(token_logprobs) == pytest.approx(expected.sum().item(), rel=1e-6)  # sharp: ~-200 a token
        assert all(t == max(alternatives.values()) for t, alternatives in zip(token_logprobs, top)) == greedy
        sampled.append(scores[-1].argmax().item())
        assert logprobs["tokens"][-1] == ("<|endoftext|>" if sampled[-1] == EOS else _text(sampled[-1:]))
        # (the server decodes through the fused kernels, the model above reads as model/ does: float32 round-off,
        # which this sharp model's logits carry to ~1e-5)
        assert logprobs["token_logprobs"][-1] == pytest.approx(scores[-1].max().item(), rel=1e-6, abs=1e-4)
        assert choice["finish_reason"] == ("stop" if sampled[-1] == EOS else "length")
        # the end of text is no part of the text
        assert choice["text"] == _text(prompt + ([] if sampled[-1] == EOS else sampled[-1:]))
    assert sampled[0] == EOS and any(token != EOS for token in sampled)  # both cases were asked


def test_a_sampled_end_of_text_has_its_logprobs_entry_when_streaming_too():
    prompt = list(b"Once upon")
    with serving(_eos_after(prompt)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0,
                                                logprobs=0, stream=True))
        plain = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0)
    tokens = [token for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
              for token in chunk.choices[0].logprobs.tokens]
    assert tokens == ["<|endoftext|>"] and "".join(c.choices[0].text for c in chunks if c.choices) == ""
    assert chunks[-1].choices[0].finish_reason == "stop" and plain.choices[0].logprobs is None
    assert plain.choices[0].text == "" and plain.usage.completion_tokens == 0


def test_sampled_tokens_carry_their_logprobs(client, model):
    response = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=6, temperature=0, logprobs=2)
    logprobs = response.choices[0].logprobs
    ids = list(b"Hi")
    generated = generate(model, ids, 6, temperature=0, eos_id=EOS)[0]
    assert logprobs.tokens == [_text([t]) for t in generated]
    with torch.no_grad():
        for token_id, logprob, top in zip(generated, logprobs.token_logprobs, logprobs.top_logprobs):
            scores = model(torch.tensor([ids]))[0, -1, :257].log_softmax(-1)  # the oracle: no cache, no batch
            assert logprob == pytest.approx(scores[token_id].item(), abs=1e-5) and len(top) <= 2
            assert max(top.values()) == pytest.approx(scores.max().item(), abs=1e-5)
            ids.append(token_id)


def test_models_and_health(client, server):
    (model,) = client.models.list().data
    assert model.id == MODEL_NAME
    health = httpx.get(f"{server[0]}/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL_NAME


def test_the_official_client_raises_the_right_errors(client):
    with pytest.raises(openai.BadRequestError, match="temperature must be a finite number >= 0, got -1"):
        client.completions.create(model=MODEL_NAME, prompt="a", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="model \"gpt-4\" not found"):
        client.completions.create(model="gpt-4", prompt="a")
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL_NAME, prompt="x" * (CONTEXT + 1))
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "prompt"


BIG = 10**30
BAD_REQUESTS = [  # (body: bytes or a JSON value, status, the message's telling part)
    (b'{"prompt": "a", ', 400, "not valid JSON"),
    (b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8 (byte 12: 0xff)"),
    (b'[1, 2]', 400, "must be a JSON object, got list"),
    (b'{"prompt": "a", "temperature": NaN}', 400, "NaN is not a JSON number"),
    (b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b'}', 400, "not valid JSON"),
    (b'{"prompt": ' + b"[" * 9000 + b"]" * 9000 + b"}", 400, "not valid JSON"),
    (b"x" * 30_000, 413, "larger than the server's limit of 20000 bytes"),
    ({"prompt": "a", "max_tokens": -1}, 400, "max_tokens must be an integer in [0, 500], got -1"),
    ({"prompt": "a", "max_tokens": BIG}, 400, f"max_tokens must be an integer in [0, 500], got {BIG}"),
    ({"prompt": "a", "max_tokens": 2.5}, 400, "max_tokens must be an integer in [0, 500], got 2.5"),
    ({"prompt": "a", "max_tokens": True}, 400, "max_tokens must be an integer in [0, 500], got true"),
    ({"prompt": "a", "max_tokens": 1e308 * 10}, 400, "Infinity is not a JSON number"),
    (b'{"prompt": "a", "temperature": 1e999}', 400, "temperature must be a finite number >= 0, got Infinity"),
    ({"prompt": "a", "temperature": "hot"}, 400, 'temperature must be a finite number >= 0, got "hot"'),
    ({"prompt": "a", "top_p": 0}, 400, "top_p must be in (0, 1], got 0"),
    ({"prompt": "a", "top_p": 1.5}, 400, "top_p must be in (0, 1], got 1.5"),
    ({"prompt": "a", "top_k": 0}, 400, "top_k must be an integer >= 1, got 0"),
    ({"prompt": "a", "n": 0}, 400, "n must be an integer in [1, 16], got 0"),
    ({"prompt": ["a"] * 9, "n": 2}, 400, "9 prompts x n=2 is 18 choices"),
    ({"prompt": "a", "logprobs": 21}, 400, "logprobs must be an integer in [0, 20], got 21"),
    ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop must be a non-empty string or a list of at"),
    ({"prompt": "a", "stop": ""}, 400, "stop must be a non-empty string"),
    ({"prompt": "a", "seed": -1}, 400, "seed must be an integer in [0,"),
    ({"prompt": "a", "stream": "yes"}, 400, 'stream must be true or false, got "yes"'),
    ({"prompt": "a", "echo": 1}, 400, "echo must be true or false, got 1"),
    ({"prompt": "a", "temprature": 0}, 400, "unknown field 'temprature'"),
    ({"prompt": "a", "frequency_penalty": 1}, 400, "frequency_penalty is not supported (only 0), got 1"),
    ({"prompt": "a", "best_of": 3}, 400, "best_of must equal n (1)"),
    ({"max_tokens": 3}, 400, "prompt is required"),
    ({"prompt": []}, 400, "prompt must be a string, a non-empty list"),
    ({"prompt": 5}, 400, "prompt must be a string, a non-empty list"),
    ({"prompt": [1, "a"]}, 400, "prompt must be a string, a non-empty list"),
    ({"prompt": [[1], []]}, 400, "prompt must be a string, a non-empty list"),
    ({"prompt": [1, 257]}, 400, "token id 257 is outside the vocabulary [0, 257)"),
    ({"prompt": [-1]}, 400, "token id -1 is outside the vocabulary"),
    ({"prompt": "x" * (CONTEXT + 1), "max_tokens": 0}, 400, "the prompt has 129 tokens and max_tokens is 0"),
    ({"prompt": "x" * 100, "max_tokens": 30}, 400, "more than the model's context of 128 tokens holds"),
    ({"prompt": "a", "stream": True, "echo": True, "logprobs": 1}, 400, "not available when streaming"),
    ({"prompt": "a", "model": "other"}, 404, 'model "other" not found'),
]


@pytest.mark.parametrize(("body", "status", "message"), BAD_REQUESTS,
                         ids=[f"{i}-{status}" for i, (_, status, _) in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_their_status_and_message_and_the_server_keeps_serving(server, body, status, message):
    url = server[0]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{url}/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and set(error) == {"message", "type", "param", "code"}
    if isinstance(body, dict) and status == 400 and error["param"] is not None:
        assert error["param"] in body or error["param"] == "prompt"
    good = httpx.post(f"{url}/v1/completions", json={"prompt": "ok", "max_tokens": 3, "temperature": 0})
    assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/v1/completions", 405), ("GET", "/v2/x", 404),
                                                         ("POST", "/v1/models", 405)])
def test_unknown_routes_and_methods_get_openai_error_objects(server, method, path, status):
    response = httpx.request(method, f"{server[0]}{path}")
    assert response.status_code == status and path in response.json()["error"]["message"]


def test_disconnecting_mid_stream_frees_the_slot_every_time(model):
    """Hundreds of clients leave mid-stream: the batch empties each time, and threads and memory stay put."""
    psutil = pytest.importorskip("psutil")
    slow = tiny_model()
    slow.lm_head.register_forward_pre_hook(lambda *_: time.sleep(0.002))  # every request still decodes when it leaves
    with serving(slow, max_tokens=100) as (url, engine), httpx.Client(timeout=30) as http:
        request = {"prompt": "tell me", "max_tokens": 100, "stream": True, "temperature": 0.8}

        def leave_after_two_chunks() -> None:
            with http.stream("POST", f"{url}/v1/completions", json=request) as response:
                events = (line for line in response.iter_lines() if line)
                next(events), next(events)

        leave_after_two_chunks()
        assert wait_until_idle(url)["active"] == 0
        threads, rss = threading.active_count(), psutil.Process().memory_info().rss
        for _ in range(200):
            leave_after_two_chunks()
        health = wait_until_idle(url)
        assert (health["active"], health["waiting"]) == (0, 0)
        assert engine.sampled < 201 * 25  # each stream stopped decoding long before its 100 tokens
        assert threading.active_count() <= threads + 1
        assert psutil.Process().memory_info().rss - rss < 64 * 2**20


def test_a_full_queue_gets_429_with_retry_after_and_a_late_request_504():
    with serving(start_engine=False, max_queue=2, request_timeout=0.5) as (url, engine):
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "n": 3})
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        assert "queue limit 2" in response.json()["error"]["message"]
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "a"})  # queued, never decoded (no engine)
        assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
        engine.submit([Sequence([1], Sampling(1), lambda event: None)] * 2)
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "a"}).status_code == 429


def test_an_engine_that_fails_while_serving_makes_health_and_every_request_503(model, monkeypatch):
    """A server whose engine thread ended on an error says so: /health is 503 with the reason, and so is every
    completion, rather than a healthy server whose requests hang."""
    with serving(model) as (url, engine):
        def broken(*args, **kwargs):
            raise MemoryError("the engine ran out of memory")

        monkeypatch.setattr(engine, "_fail_all", broken)  # the engine's own recovery fails: the thread ends
        engine.request_stop()
        engine._thread.join(10)
        engine.stopping = False  # not a shutdown: a failure
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "MemoryError: the engine ran out of memory" in health.json()["error"]
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "a"})
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_failed"
        assert "the decoding engine failed: MemoryError" in response.json()["error"]["message"]


def test_the_api_key_is_required_and_compared_exactly():
    with serving(api_key="s3cret-key") as (url, _):
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret-key", max_retries=0)
        assert good.completions.create(model=MODEL_NAME, prompt="a", max_tokens=2).choices
        assert good.models.list().data[0].id == MODEL_NAME
        for key in ("s3cret-kez", "s3cret-key-and-more", "s3cret"):
            with pytest.raises(openai.AuthenticationError, match="invalid API key"):
                openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0).completions.create(
                    model=MODEL_NAME, prompt="a")
        missing = httpx.post(f"{url}/v1/completions", json={"prompt": "a"})
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
        assert "s3cret" not in missing.text
        assert httpx.get(f"{url}/health").status_code == 200  # health and the page need no key
        assert httpx.get(f"{url}/").status_code == 200


def test_the_playground_page_is_served(server):
    response = httpx.get(f"{server[0]}/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert 'id="generate"' in response.text and "/v1/completions" in response.text


def test_the_model_loads_on_a_thread_that_ends_and_its_errors_reach_the_caller():
    """serve loads the model off the main thread, so that thread's OpenMP team ends with it (commands.py)."""
    loaders: list[threading.Thread] = []

    def load() -> str:
        loaders.append(threading.current_thread())
        return "model"

    assert off_the_main_thread(load) == "model"
    assert loaders[0] is not threading.main_thread() and not loaders[0].is_alive()

    def fail() -> None:
        raise ValueError("no checkpoint in runs/x")

    with pytest.raises(ValueError, match="no checkpoint in runs/x"):
        off_the_main_thread(fail)
