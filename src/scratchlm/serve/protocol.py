"""The OpenAI completions and chat completions protocols: validating a request, and the response, chunk and error
objects.

`parse_completion` and `parse_chat` turn the raw bytes of a POST /v1/completions or /v1/chat/completions into a
`CompletionRequest`, or raise `APIError` naming the field and the value (413 for a body over the limit, 404 for
another model, 400 for anything else: invalid UTF-8 or JSON, NaN, a wrong type or range, an unknown field). The
fields are OpenAI's (https://platform.openai.com/docs/api-reference/completions, .../chat) with their defaults,
plus `top_k` (as in vLLM and llama.cpp's server); those we do not implement (penalties, logit_bias, suffix,
best_of > n, chat logprobs) are refused by name rather than ignored. A prompt may be token ids (what
lm-evaluation-harness sends); an empty one starts a new document. A chat request's messages are checked by
tokenizer/chat_template.py's `check_messages`; the server renders them with the model's chat template.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from scratchlm.errors import UserError
from scratchlm.serve.commands import Limits
from scratchlm.tokenizer.chat_template import check_messages

SHARED_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "logprobs",
                 "stop", "seed", "user", "presence_penalty", "frequency_penalty", "logit_bias"}
FIELDS = SHARED_FIELDS | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = SHARED_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
MAX_STOPS = 4
MAX_SEED = 2**63 - 1


class APIError(Exception):
    """An error response: HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[str | list[int]]  # each a text or token ids
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int | None
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    echo: bool
    stop: tuple[str, ...]
    seed: int | None
    messages: list[dict] | None = None  # a chat request's conversation: its prompt is the rendered messages


def parse_completion(body: bytes, *, model_name: str, limits: Limits) -> CompletionRequest:
    fields = _fields(body, FIELDS, model_name)
    shared = _shared(fields, limits)
    n = shared["n"]
    best_of = _integer(fields, "best_of", n, low=1)
    if best_of != n:
        raise bad("best_of", f"best_of must equal n ({n}) here (no server-side ranking), got {best_of}")
    request = CompletionRequest(
        prompts=_prompts(fields), max_tokens=_integer(fields, "max_tokens", 16, low=0, high=limits.max_tokens),
        logprobs=_optional_integer(fields, "logprobs", low=0, high=limits.max_logprobs),
        echo=_boolean(fields, "echo", False), **shared)
    if len(request.prompts) * n > limits.max_choices:
        raise bad("n", f"{len(request.prompts)} prompts x n={n} is {len(request.prompts) * n} choices, more than "
                       f"the server's limit of {limits.max_choices}")
    if request.stream and request.echo and request.logprobs is not None:
        raise bad("echo", "echo with logprobs is not available when streaming: send stream=false")
    return request


def parse_chat(body: bytes, *, model_name: str, limits: Limits) -> CompletionRequest:
    """A chat completions request: `prompts` is empty, and `max_tokens` (`max_completion_tokens`, or the older
    `max_tokens`) None when not given: the server's default is what the context leaves."""
    fields = _fields(body, CHAT_FIELDS, model_name)
    for name in ("logprobs", "top_logprobs"):
        if fields.get(name) not in (None, False, 0):
            raise bad(name, f"{name} is not supported on chat completions (POST /v1/completions has logprobs)")
    if "messages" not in fields:
        raise bad("messages", "messages is required (a list of {\"role\", \"content\"} objects)")
    try:
        messages = check_messages(fields["messages"])
    except UserError as error:
        raise bad(str(error).split(":", 1)[0], str(error)) from None
    name = "max_completion_tokens" if fields.get("max_completion_tokens") is not None else "max_tokens"
    return CompletionRequest(prompts=[], max_tokens=_optional_integer(fields, name, low=1, high=limits.max_tokens),
                             logprobs=None, echo=False, messages=messages, **_shared(fields, limits))


def _shared(fields: dict, limits: Limits) -> dict:
    """The fields both protocols share, checked."""
    return dict(n=_integer(fields, "n", 1, low=1, high=limits.max_choices),
                temperature=_number(fields, "temperature", 1.0, low=0.0), top_p=_top_p(fields),
                top_k=_optional_integer(fields, "top_k", low=1), stream=_boolean(fields, "stream", False),
                include_usage=_include_usage(fields), stop=_stop(fields),
                seed=_optional_integer(fields, "seed", low=0, high=MAX_SEED - limits.max_choices))


def _fields(body: bytes, known: set[str], model_name: str) -> dict:
    """The request's JSON object (the app has already refused a body over the limit), after refusing unknown
    fields, another model and fields we do not implement."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {error.start}: {body[error.start]:#04x})",
                       code="invalid_utf8") from None
    try:
        fields = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, NaN, ints over Python's digit limit
        raise APIError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(fields, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(fields).__name__}",
                       code="invalid_json")
    unknown = sorted(set(fields) - known)
    if unknown:
        raise bad(unknown[0], f"unknown field {unknown[0]!r}")
    model = fields.get("model")
    if model is not None and model != model_name:
        raise APIError(404, f"model {_show(model)} not found: this server serves {model_name!r} (GET /v1/models)",
                       param="model", code="model_not_found")
    _refuse_unsupported(fields)
    return fields


def body_too_large(limits: Limits) -> APIError:
    return APIError(413, f"the request body is larger than the server's limit of {limits.max_body_bytes} bytes "
                         f"(scratchlm serve --max-body-bytes)", code="request_too_large")


def bad(field: str, message: str) -> APIError:
    return APIError(400, message, param=field, code="invalid_value")


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _refuse_unsupported(fields: dict) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if fields.get(name) not in (None, 0, 0.0):
            raise bad(name, f"{name} is not supported (only 0), got {_show(fields[name])}")
    if fields.get("logit_bias") not in (None, {}):
        raise bad("logit_bias", "logit_bias is not supported")
    if fields.get("suffix") not in (None, ""):
        raise bad("suffix", "suffix (insertion) is not supported")
    if "user" in fields and not isinstance(fields["user"], str):
        raise bad("user", f"user must be a string, got {_show(fields['user'])}")


def _integer(fields: dict, name: str, default: int, *, low: int, high: int | None = None) -> int:
    value = fields.get(name)
    if value is None:
        return default
    if type(value) is not int or value < low or (high is not None and value > high):
        allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise bad(name, f"{name} must be {allowed}, got {_show(value)}")
    return value


def _optional_integer(fields: dict, name: str, *, low: int, high: int | None = None) -> int | None:
    return None if fields.get(name) is None else _integer(fields, name, 0, low=low, high=high)


def _number(fields: dict, name: str, default: float, *, low: float) -> float:
    value = fields.get(name)
    if value is None:
        return default
    if type(value) not in (int, float) or not math.isfinite(value) or value < low:
        raise bad(name, f"{name} must be a finite number >= {low:g}, got {_show(value)}")
    return float(value)


def _top_p(fields: dict) -> float:
    value = _number(fields, "top_p", 1.0, low=0.0)
    if not 0 < value <= 1:
        raise bad("top_p", f"top_p must be in (0, 1], got {_show(fields['top_p'])}")
    return value


def _boolean(fields: dict, name: str, default: bool) -> bool:
    value = fields.get(name)
    if value is None:
        return default
    if type(value) is not bool:
        raise bad(name, f"{name} must be true or false, got {_show(value)}")
    return value


def _include_usage(fields: dict) -> bool:
    options = fields.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad("stream_options", f"stream_options must be {{\"include_usage\": bool}}, got {_show(options)}")
    return _boolean(options, "include_usage", False)


def _stop(fields: dict) -> tuple[str, ...]:
    value = fields.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)):
        raise bad("stop", f"stop must be a non-empty string or a list of at most {MAX_STOPS} non-empty strings, "
                          f"got {_show(value)}")
    return tuple(stops)


def _prompts(fields: dict) -> list[str | list[int]]:
    if "prompt" not in fields:
        raise bad("prompt", "prompt is required (a string, a list of strings, or token ids)")
    value = fields["prompt"]
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return list(value)
        if all(type(item) is int for item in value):
            return [value]
        if all(isinstance(item, list) and item and all(type(t) is int for t in item) for item in value):
            return [list(item) for item in value]
    raise bad("prompt", f"prompt must be a string, a non-empty list of strings, a non-empty list of token ids or "
                        f"a list of such lists, got {_show(value)}")


# ------------------------------------------------------------------------------------------ responses

def completion_object(request_id: str, model_name: str, kind: str, choices: list[dict], usage: dict | None,
                      created: int) -> dict:
    """A response or stream chunk: `kind` "text_completion" (choices of `choice`), "chat.completion" (of
    `chat_choice`) or "chat.completion.chunk" (of `chat_delta`)."""
    body = {"id": request_id, "object": kind, "created": created, "model": model_name, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def chat_delta(index: int, delta: dict, finish_reason: str | None) -> dict:
    """A streamed choice: delta is {"role": "assistant", "content": ""} first, then {"content": text}, then {}."""
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def models_object(model_name: str, created: int, context_length: int) -> dict:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "scratchlm", "context_length": context_length}]}


class Logprobs:
    """The legacy completions `logprobs` object, built a token at a time: tokens, their log-probabilities, the
    top alternatives at each position and each token's character offset in the choice's text."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(token)

    def object(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}
