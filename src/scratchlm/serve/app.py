"""The FastAPI application: the OpenAI completions routes over an `Engine`, the API key and the playground page.

Routes: POST /v1/completions and POST /v1/chat/completions (JSON, or server-sent events with `stream`), GET
/v1/models, GET /health (no key), GET / (static/playground.html). Every error is OpenAI's error object. With an API
key, /v1/* need `Authorization: Bearer KEY`, compared in constant time; the key is never logged or echoed.

A request becomes one engine `Sequence` per choice (prompt x n; choice j samples with seed + j, as `scratchlm
generate --num-samples` does). A chat request is a completion whose one prompt is its messages rendered by the
chat template, stopping at the tokenizer's end-of-turn ids too: only its response objects differ. A request that
ends for any reason (done, client gone, timeout, error) cancels its sequences, freeing their batch slots at the
next decoding step. `_Delivery` hands each decoding step's events to the event loop in one wakeup, and a stream
writes every event that has arrived in one write: with 8 streams, per-token wakeups and writes would cost the
engine's core more than the batched forward pass saves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from scratchlm.errors import UserError
from scratchlm.generate.decoding import default_max_new_tokens
from scratchlm.generate.engine import Engine, Failed, Finished, PromptLogprobs, QueueFull, Sampling, Sequence, Token
from scratchlm.serve import protocol
from scratchlm.serve.commands import Limits
from scratchlm.serve.protocol import APIError, CompletionRequest, Logprobs, error_body

RETRY_AFTER_SECONDS = 1
DISCONNECT_POLL_SECONDS = 0.05


def create_app(engine: Engine, *, model_name: str, limits: Limits, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="scratchlm", docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer = engine.tokenizer
    created = int(time.time())
    playground = resources.files("scratchlm.serve").joinpath("static/playground.html").read_text(encoding="utf-8")
    deliveries: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Delivery] = weakref.WeakKeyDictionary()

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise APIError(401, "missing API key: send the header Authorization: Bearer KEY",
                           code="missing_api_key")
        if not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid API key", code="invalid_api_key")

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(error.status_code,
                                                                                           str(error.detail))
        return JSONResponse(error_body(message, "invalid_request_error"), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(error).__name__}", "server_error"), status_code=500)

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(playground)

    @app.get("/health")
    async def health() -> JSONResponse:
        status = "failed" if engine.failed else "stopping" if engine.stopping else "ok"
        failure = {"error": engine.failure} if engine.failed else {}
        return JSONResponse({"status": status, "model": model_name, **failure, **engine.stats()},
                            status_code=200 if status == "ok" else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check_key(request)
        return JSONResponse(protocol.models_object(model_name, created, engine.model.config.context_length))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_key(request)
        unavailable(engine)
        body = await _read_body(request, limits)
        parsed = protocol.parse_completion(body, model_name=model_name, limits=limits)
        prompt_ids = [_prompt_ids(prompt, tokenizer, engine.eos_id) for prompt in parsed.prompts]
        return await respond(request, _Completion(parsed, prompt_ids, tokenizer, model_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_key(request)
        unavailable(engine)
        body = await _read_body(request, limits)
        parsed = protocol.parse_chat(body, model_name=model_name, limits=limits)
        if tokenizer.chat_template is None:
            raise APIError(400, f"model {model_name!r} has no chat template (a base model): use /v1/completions, "
                                "or fine-tune it into a chat model with `scratchlm finetune`",
                           param="messages", code="no_chat_template")
        try:
            ids = tokenizer.encode_chat(parsed.messages, add_generation_prompt=True)
        except UserError as error:  # the template refused the conversation (its raise_exception)
            raise APIError(400, str(error), param="messages", code="invalid_value") from None
        max_tokens = parsed.max_tokens
        if max_tokens is None:  # OpenAI's default: as many as the context leaves (here, up to the server's limit)
            max_tokens = max(1, default_max_new_tokens(len(ids), engine.model.config.context_length, limits.max_tokens))
        parsed = dataclasses.replace(parsed, prompts=[ids], max_tokens=max_tokens)
        return await respond(request, _Completion(parsed, [ids], tokenizer, model_name,
                                                  stop_ids=tokenizer.end_of_turn_ids))

    async def respond(request: Request, run: _Completion) -> Response:
        """Submit a request's sequences to the engine and answer: JSON, or a stream of events."""
        parsed = run.request
        for ids in run.prompt_ids:
            try:
                engine.check(ids, parsed.max_tokens)
            except ValueError as error:
                code = "context_length_exceeded" if "context" in str(error) else "invalid_value"
                raise APIError(400, str(error), param="messages" if run.chat else "prompt", code=code) from None
        loop = asyncio.get_running_loop()
        delivery = deliveries.setdefault(loop, _Delivery(loop))
        try:
            engine.submit(run.sequences(delivery))
        except QueueFull as error:
            raise APIError(429, f"the server is busy ({error}): retry later", kind="server_error",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except RuntimeError:  # the engine stopped or failed since the check above
            unavailable(engine)
            raise
        deadline = loop.time() + limits.request_timeout
        if parsed.stream:
            return StreamingResponse(_stream(run, deadline, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _collect(run, deadline, request)

    return app


def unavailable(engine: Engine) -> None:
    """A 503 once the engine takes no more requests: it failed (saying why), or the server is shutting down."""
    if engine.failed:
        raise APIError(503, engine.failure, kind="server_error", code="engine_failed")
    if engine.stopping:
        raise APIError(503, "the server is shutting down", kind="server_error", code="shutting_down")


class _Delivery:
    """Events from the engine thread to the requests' queues on one event loop: the first event after a delivery
    schedules the next one (`call_soon_threadsafe` wakes the loop), the rest of that decoding step's events ride
    along with it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, tuple[int, object]]] = []

    def put(self, queue: asyncio.Queue, item: tuple[int, object]) -> None:
        """Called on the engine thread."""
        with self._lock:
            first = not self._pending
            self._pending.append((queue, item))
        if first:
            with contextlib.suppress(RuntimeError):  # the event loop has closed (server stopped): nobody listens
                self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, item in pending:
            queue.put_nowait(item)


@dataclass
class _Choice:
    """What one sequence has produced so far."""
    prompt_ids: list[int]
    echo_text: str | None  # the prompt as text, for a request with echo
    text: list[str] = field(default_factory=list)
    logprobs: Logprobs | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0


class _Completion:
    """One request: its choices, the sequences computing them and the queue their events arrive on. A chat request
    (`chat`) has one prompt, its rendered messages, and stops at stop_ids too (the end-of-turn ids)."""

    def __init__(self, request: CompletionRequest, prompt_ids: list[list[int]], tokenizer, model_name: str, *,
                 stop_ids: tuple[int, ...] = ()) -> None:
        self.request, self.prompt_ids, self.stop_ids = request, prompt_ids, stop_ids
        self.tokenizer, self.model_name = tokenizer, model_name
        self.chat = request.messages is not None
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices: list[_Choice] = []
        self._sequences: list[Sequence] = []

    def sequences(self, delivery: _Delivery) -> list[Sequence]:
        request = self.request
        for prompt, ids in zip(request.prompts, self.prompt_ids):
            for sample in range(request.n):
                index = len(self._sequences)
                sampling = Sampling(max_tokens=request.max_tokens, temperature=request.temperature,
                                    top_p=request.top_p, top_k=request.top_k,
                                    seed=None if request.seed is None else request.seed + sample,
                                    stop=request.stop, logprobs=request.logprobs,
                                    prompt_logprobs=request.echo and request.logprobs is not None,
                                    stop_ids=self.stop_ids)
                self._sequences.append(Sequence(ids, sampling, self._emitter(delivery, index)))
                echo = (prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)) if request.echo else None
                self.choices.append(_Choice(ids, echo))
        return self._sequences

    def _emitter(self, delivery: _Delivery, index: int):
        def emit(event: object) -> None:
            delivery.put(self.queue, (index, event))
        return emit

    def cancel(self) -> None:
        for sequence in self._sequences:
            sequence.cancel()

    async def next_events(self, deadline: float, poll: float) -> list[tuple[int, object]]:
        """Every (choice index, event) that has arrived, waiting for the first; [] after `poll` seconds without
        one. Raises TimeoutError at the request's deadline."""
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise TimeoutError
        arrived = []
        if self.queue.empty():  # (waiting creates a task: only when there is nothing to take)
            try:
                arrived.append(await asyncio.wait_for(self.queue.get(), min(poll, remaining)))
            except TimeoutError:
                if remaining <= poll:
                    raise
                return []
        return arrived + [self.queue.get_nowait() for _ in range(self.queue.qsize())]

    def usage(self) -> dict:
        prompt_tokens = sum(len(ids) for ids in self.prompt_ids)
        return protocol.usage(prompt_tokens, sum(c.completion_tokens for c in self.choices))

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: Logprobs | None = None, *,
               chunk: bool = False) -> dict:
        """One choice of the response, or with `chunk` of a stream chunk (a chat's is then a delta)."""
        if not self.chat:
            return protocol.choice(index, text, finish_reason, logprobs.object() if logprobs else None)
        if chunk:
            return protocol.chat_delta(index, {"content": text} if text or finish_reason is None else {}, finish_reason)
        return protocol.chat_choice(index, text, finish_reason)

    def body(self, choices: list[dict], usage: dict | None = None, *, chunk: bool = False) -> dict:
        """The response object with these choices; with `chunk`, a chunk of the stream."""
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return protocol.completion_object(self.id, self.model_name, kind, choices, usage, self.created)


def _prompt_ids(prompt: str | list[int], tokenizer, eos_id: int | None) -> list[int]:
    if not isinstance(prompt, str):
        return prompt
    if prompt:
        return tokenizer.encode(prompt)
    if eos_id is None:
        raise APIError(400, "the prompt is empty and the tokenizer has no <|endoftext|> to start a document with",
                       param="prompt", code="invalid_value")
    return [eos_id]


async def _read_body(request: Request, limits: Limits) -> bytes:
    """The body, refused (413) as soon as it is known to be over the limit: from Content-Length, or while reading."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise protocol.body_too_large(limits)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise protocol.body_too_large(limits)
        chunks.append(chunk)
    return b"".join(chunks)


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode_bytes([token_id]).decode("utf-8", errors="replace")


def _top(tokenizer, top: dict[int, float] | None) -> dict[str, float] | None:
    """Alternatives keyed by their text, most likely first; ids with the same text (bytes that are no character
    alone all read U+FFFD) keep the likeliest one's log-probability."""
    if top is None:
        return None
    texts: dict[str, float] = {}
    for token_id, logprob in top.items():
        texts.setdefault(_token_text(tokenizer, token_id), logprob)
    return texts


def _apply(choice: _Choice, event: object, tokenizer, logprobs: Logprobs | None) -> str:
    """Record an event in its choice; returns the new text. A Failed event raises APIError."""
    if isinstance(event, Token):
        if logprobs is not None:
            logprobs.add(_token_text(tokenizer, event.id), event.logprob, _top(tokenizer, event.top))
        choice.text.append(event.text)
        return event.text
    if isinstance(event, PromptLogprobs):
        if logprobs is not None:
            for token_id, logprob, top in zip(choice.prompt_ids, event.logprobs, event.top):
                logprobs.add(_token_text(tokenizer, token_id), logprob, _top(tokenizer, top))
        return ""
    if isinstance(event, Finished):
        choice.finish_reason, choice.completion_tokens = event.reason, event.completion_tokens
        choice.text.append(event.text)
        return event.text
    assert isinstance(event, Failed)
    status = 503 if event.kind == "shutdown" else 500
    raise APIError(status, event.message, kind="server_error", code=event.kind)


async def _collect(run: _Completion, deadline: float, request: Request) -> Response:
    for choice in run.choices:
        if run.request.logprobs is not None:
            choice.logprobs = Logprobs()
        if choice.echo_text is not None:
            choice.text.append(choice.echo_text)
    pending = len(run.choices)
    try:
        while pending:
            try:
                arrived = await run.next_events(deadline, poll=1.0)
            except TimeoutError:
                raise _timeout() from None
            if not arrived and await request.is_disconnected():
                return Response(status_code=499)  # nobody reads it; the sequences are cancelled below
            for index, event in arrived:
                choice = run.choices[index]
                _apply(choice, event, run.tokenizer, choice.logprobs)
                pending -= isinstance(event, Finished)
    finally:
        run.cancel()
    choices = [run.choice(i, "".join(c.text), c.finish_reason, c.logprobs) for i, c in enumerate(run.choices)]
    return JSONResponse(run.body(choices, run.usage()))


async def _stream(run: _Completion, deadline: float, request: Request):
    """Server-sent events: a chunk per piece of text (and per echo), a final chunk per choice with its
    finish_reason, the usage if asked, then [DONE]; an error ends the stream with an error event instead. A chat
    stream's chunks are chat.completion.chunk objects, led by one per choice whose delta names the role.

    A client that leaves is noticed when a write fails, but tokens that complete no character (or may start a
    stop string) write nothing, so the connection is also polled every DISCONNECT_POLL_SECONDS."""
    def chunk(index: int, text: str, finish_reason: str | None = None, logprobs: Logprobs | None = None) -> str:
        return _event(run.body([run.choice(index, text, finish_reason, logprobs, chunk=True)], chunk=True))

    offsets = [0] * len(run.choices)
    try:
        if run.chat:  # OpenAI's first delta of each choice names the role
            yield "".join(_event(run.body([protocol.chat_delta(index, {"role": "assistant", "content": ""}, None)],
                                          chunk=True)) for index in range(len(run.choices)))
        if run.request.echo:
            for index, choice in enumerate(run.choices):
                offsets[index] = len(choice.echo_text)
                yield chunk(index, choice.echo_text)
        pending = len(run.choices)
        loop = asyncio.get_running_loop()
        polled = loop.time()
        while pending:
            try:
                arrived = await run.next_events(deadline, poll=DISCONNECT_POLL_SECONDS)
            except TimeoutError:
                yield _event(_timeout().body())
                return
            if loop.time() - polled >= DISCONNECT_POLL_SECONDS:
                polled = loop.time()
                if await request.is_disconnected():
                    return
            written = []  # every event that arrived goes out in one write
            for index, event in arrived:
                choice = run.choices[index]
                logprobs = Logprobs(offsets[index]) if run.request.logprobs is not None else None
                try:
                    text = _apply(choice, event, run.tokenizer, logprobs)
                except APIError as error:
                    yield "".join(written) + _event(error.body())
                    return
                if logprobs is not None:
                    offsets[index] = logprobs.offset
                if isinstance(event, Finished):
                    pending -= 1
                    written.append(chunk(index, text, event.reason))
                elif text or logprobs is not None:
                    written.append(chunk(index, text, None, logprobs))
            if written:
                yield "".join(written)
        if run.request.include_usage:
            yield _event(run.body([], run.usage(), chunk=True))
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away (the response is cancelled)
        run.cancel()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _timeout() -> APIError:
    return APIError(504, "the request timed out (scratchlm serve --request-timeout)", kind="server_error",
                    code="timeout")
