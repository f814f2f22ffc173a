"""POST /v1/chat/completions against the official `openai` client: a reply is what the engine decodes after the
rendered conversation (the same as generate() on `encode_chat(..., add_generation_prompt=True)`), it ends at the
end of the turn (<|im_end|>, not part of the reply) with finish_reason "stop", streams as role-then-content deltas
ending in [DONE], n choices sample with seed + j as completions do, a stop string cuts it, and a model without a
chat template or a bad conversation gets a 400 naming the field; content given as OpenAI's text parts is read
as its text."""

from __future__ import annotations

import json

import pytest

from chat_helpers import MESSAGES, PROMPT, TOKENIZER, TURN, chat_model
from scratchlm.generate.decoding import generate
from serve_helpers import CONTEXT, EOS, MODEL_NAME, httpx, serving

openai = pytest.importorskip("openai", reason="the test extra's openai client is not installed")
pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def model():
    return chat_model()


@pytest.fixture(scope="module")
def server(model):
    with serving(model, tokenizer=TOKENIZER, max_tokens=100, max_body_bytes=20_000) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_reply_ends_at_the_end_of_the_turn(client, model):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0)
    reply = generate(model, PROMPT, TURN, temperature=0)[0]
    (choice,) = response.choices
    assert choice.message.role == "assistant" and choice.message.content == TOKENIZER.decode(reply)
    assert choice.finish_reason == "stop" and response.object == "chat.completion"
    assert response.id.startswith("chatcmpl-") and response.model == MODEL_NAME
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(PROMPT), TURN)


def test_max_completion_tokens_and_max_tokens_cut_the_reply(client, model):
    reply = generate(model, PROMPT, TURN, temperature=0)[0]
    for limit in ({"max_completion_tokens": 2}, {"max_tokens": 2}):
        response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0, **limit)
        assert response.choices[0].message.content == TOKENIZER.decode(reply[:2])
        assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 2


def test_streaming_gives_the_role_then_the_content_then_the_finish(client, server):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    deltas = [chunk.choices[0] for chunk in chunks if chunk.choices]
    assert "".join(d.delta.content or "" for d in deltas) == whole.choices[0].message.content
    assert [d.finish_reason for d in deltas][-1] == "stop" and all(d.finish_reason is None for d in deltas[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(PROMPT)
    raw = httpx.post(f"{server[0]}/v1/chat/completions", json={"messages": MESSAGES, "stream": True}, timeout=60)
    assert raw.text.endswith("data: [DONE]\n\n")


def test_n_choices_sample_as_completions_do(client, model):
    """Choice j samples with seed + j, as the same ids through /v1/completions, which knows no end of turn: the
    reply is its text up to <|im_end|>."""
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=4, seed=7, max_tokens=6)
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=4, seed=7, max_tokens=6)
    assert [c.index for c in chat.choices] == [0, 1, 2, 3]
    ended = 0
    for mine, theirs in zip(chat.choices, plain.choices):
        reply, end, _ = theirs.text.partition("<|im_end|>")
        assert mine.message.content == reply
        assert mine.finish_reason == ("stop" if end else "length")
        ended += bool(end)
    assert 0 < ended < 4  # both endings were seen
    assert chat.usage.prompt_tokens == len(PROMPT)


def test_a_stop_string_cuts_the_reply(client):
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0)
    text = reply.choices[0].message.content
    stop = text[2]
    cut = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_the_official_client_raises_the_right_errors(client):
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\].role: unknown role 'bot'") as caught:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "a"},
                                                                   {"role": "bot", "content": "b"}])
    assert caught.value.param == "messages[1].role"
    with pytest.raises(openai.BadRequestError, match="messages: empty list"):
        client.chat.completions.create(model=MODEL_NAME, messages=[])
    with pytest.raises(openai.NotFoundError, match="model \"gpt-4\" not found"):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x" * CONTEXT}])
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "messages"


def test_text_parts_are_read_as_their_text(client, model):
    """OpenAI's content parts (what many clients send) give the prompt of the same text as a string."""
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    response = client.chat.completions.create(model=MODEL_NAME, messages=parts, temperature=0)
    reply = generate(model, PROMPT, TURN, temperature=0)[0]
    assert response.choices[0].message.content == TOKENIZER.decode(reply)
    assert response.usage.prompt_tokens == len(PROMPT)


BAD_CHATS = [  # (body, the message's telling part, param)
    ({}, "messages is required", "messages"),
    ({"messages": "hi"}, "messages: expected a list of messages, got str", "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content: expected a string or a list of text parts",
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://a/b.png"}}]}]},
     "messages[0].content[0].type: 'image_url' parts are not supported: this model reads text",
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
     "messages[0].content[0].text: expected a string, got NoneType", "messages[0].content[0].text"),
    ({"messages": [{"content": "a"}]}, "messages[0].role: missing", "messages[0].role"),
    ({"messages": ["a"]}, "messages[0]: expected an object", "messages[0]"),
    ({"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens must be an integer in [1, 100]",
     "max_completion_tokens"),
    ({"messages": MESSAGES, "logprobs": True}, "logprobs is not supported on chat completions", "logprobs"),
    ({"messages": MESSAGES, "tools": []}, "unknown field 'tools'", "tools"),
    ({"messages": MESSAGES, "temperature": -1}, "temperature must be a finite number >= 0", "temperature"),
]


@pytest.mark.parametrize(("body", "message", "param"), BAD_CHATS, ids=[m for _, m, _ in BAD_CHATS])
def test_bad_chat_requests_name_the_field(server, body, message, param):
    response = httpx.post(f"{server[0]}/v1/chat/completions", content=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_a_model_without_a_chat_template_gets_a_400_that_says_so():
    with serving() as (url, _):  # the byte tokenizer: no template
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="has no chat template") as caught:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES)
        assert caught.value.code == "no_chat_template"
        assert client.completions.create(model=MODEL_NAME, prompt="a", max_tokens=1).choices  # still serving


def test_end_of_turn_stops_only_chat_requests(model):
    """The engine's own stop id stays <|endoftext|>: a completion runs past <|im_end|>, a chat reply ends there."""
    reply = generate(model, PROMPT, TURN, temperature=0)[0]
    with serving(model, tokenizer=TOKENIZER) as (url, _):
        plain = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": TURN + 2,
                                                           "temperature": 0}, timeout=60).json()
    assert plain["usage"]["completion_tokens"] == TURN + 2
    assert plain["choices"][0]["text"].startswith(TOKENIZER.decode(reply) + "<|im_end|>")
    assert EOS not in reply
