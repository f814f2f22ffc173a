"""The continuously batched decoder: concurrent sequences decode together, joining and leaving between steps.

generate() drives it on the caller's thread (`decode`), `scratchlm serve` on a thread of its own (`start`,
`submit`); either way one thread owns the model. `submit` queues sequences (`QueueFull` past `max_queue`);
before every step the engine admits waiting ones while the batch has fewer than `max_batch` rows, drops the
rows that ended or were cancelled, then decodes one token for every row in one forward pass over the shared KV
cache (batch_cache.py). A joining sequence is prefilled alone into a one-row scratch cache, then copied in.
Each row samples by sampling.py's rule with its own `torch.Generator`, so its tokens for a seed do not depend
on the rows beside it. Prompt + max_tokens - 1 must fit the context (`check`; no sliding window).

Results go out through each sequence's `emit`, on the engine thread: `PromptLogprobs` (with prompt_logprobs),
a `Token` per sampled token, then `Finished` or `Failed`. A sequence stops at `eos_id` or one of its
`stop_ids` (a chat's end-of-turn ids), which are no part of the text or the count; with `logprobs` such an id
is still a `Token` (text '') before `Finished`, as OpenAI's logprobs have it and lm-eval relies on.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from scratchlm.generate import batch_cache
from scratchlm.generate.sampling import draw, probabilities
from scratchlm.generate.text import TextStream
from scratchlm.model import KVCache, TransformerLM, kernels
from scratchlm.model.kernels import compiled_step
from scratchlm.tokenizer import Tokenizer

log = logging.getLogger("scratchlm.serve")


@dataclass(frozen=True)
class Sampling:
    """One sequence's settings (generate/sampling.py's rule). logprobs: how many alternatives to report per
    sampled token (0 = only the token's own log-probability; None = none). stop_ids: ids that end this sequence
    as the engine's eos_id does (a chat's end-of-turn ids)."""
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: bool = False
    stop_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Token:
    """A sampled token and the text that became final with it ('' while a character or stop string is open)."""
    id: int
    text: str
    logprob: float | None = None
    top: dict[int, float] | None = None


@dataclass(frozen=True)
class PromptLogprobs:
    """log p(prompt[i] | prompt[:i]) for i >= 1 (None for the first) and the top alternatives at each position."""
    logprobs: list[float | None]
    top: list[dict[int, float] | None]


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (end of text, a stop id or a stop string) or "length" (max_tokens)
    text: str = ""  # the rest of the text (a held-back tail that was not a stop string)
    completion_tokens: int = 0


@dataclass(frozen=True)
class Failed:
    message: str
    kind: str = "server_error"  # "shutdown" when the server is stopping


class QueueFull(Exception):
    """The waiting queue has no room for the submitted sequences."""


@dataclass(eq=False)
class Sequence:
    """A prompt to continue. `emit` receives the events on the engine thread; `cancel()` is safe from anywhere."""
    prompt_ids: list[int]
    sampling: Sampling
    emit: Callable[[object], None]
    cancelled: bool = field(default=False, init=False)

    def cancel(self) -> None:
        self.cancelled = True  # read by the engine thread before each step


class _Row:
    """A sequence in the batch: its generator, text, token count and the token to feed next."""

    def __init__(self, sequence: Sequence, tokenizer: Tokenizer | None, device: torch.device) -> None:
        self.sequence = sequence
        self.sampling = sequence.sampling
        seed = self.sampling.seed if self.sampling.seed is not None else random.getrandbits(63)
        self.generator = torch.Generator(device).manual_seed(seed)
        self.text = TextStream(tokenizer, self.sampling.stop) if tokenizer is not None else None  # None: ids only
        self.generated = 0
        self.last = -1
        self.done = False


class Engine:
    def __init__(self, model: TransformerLM, tokenizer: Tokenizer | None, *, eos_id: int | None, max_batch: int = 16,
                 max_queue: int = 64, compile: bool = False, vocab_limit: int | None = None) -> None:
        """tokenizer None: token ids only (no text, no stop strings), the ids of the model's vocabulary, sampled
        below `vocab_limit` (default: the model's vocab_size); with a tokenizer, its ids (`vocab_limit` is its
        vocab_size: a padded model vocabulary has ids without text)."""
        if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {model.config.vocab_size}")
        self.model, self.tokenizer, self.eos_id = model, tokenizer, eos_id
        self.max_batch, self.max_queue = max_batch, max_queue
        self.compile = compile  # decode through the step compiled ahead of time (model/kernels/compiled_step.py)
        self.prompt_limit = tokenizer.vocab_size if tokenizer is not None else model.config.vocab_size
        self.vocab_limit = tokenizer.vocab_size if tokenizer is not None else vocab_limit or self.prompt_limit
        self.device = model.lm_head.weight.device
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._wakeup = threading.Condition()
        self._rows: list[_Row] = []
        self._batch = batch_cache.BatchCache(model, max_batch)
        self._prefill_cache = KVCache.for_model(model, 1, zeroed=False)  # reset for each joining sequence
        self._forward = kernels.forward_step(model)  # the engine thread swaps in its decoding step (_run)
        self.stopping = False  # set by request_stop: the engine fails every sequence and ends
        self.failure: str | None = None  # why the engine thread ended on an error: it decodes nothing more
        self._ready = threading.Event()  # set by the engine thread once it can decode (or has failed to)
        self.steps = 0  # decoding steps run (a batch of B rows counts once)
        self.sampled = 0  # tokens sampled, over all sequences
        self._thread = threading.Thread(target=self._run, name="scratchlm-serve-engine", daemon=True)

    # ------------------------------------------------------------------ the caller's side (any thread)

    def start(self) -> Engine:
        """Start the engine thread; returns once it is ready to decode (its step compiled, with compile=True), so
        that the first request does not wait for that. A RuntimeError with the reason if it failed to start."""
        self._thread.start()
        self._ready.wait()
        if self.failure is not None:
            raise RuntimeError(self.failure)
        return self

    def decode(self, sequences: list[Sequence]) -> Iterator[None]:
        """Decode `sequences` to their ends on the calling thread, without the engine thread (generate()'s way),
        yielding after each step; their events reach their `emit` as on the thread. The speed paths are on while
        it runs and off when it ends or the caller drops it."""
        self.submit(sequences)
        with kernels.decoding(self.model, self.compile, self.max_batch) as forward:
            self._forward = forward
            while self._waiting or self._rows:
                with torch.inference_mode():  # per step: the caller's code between steps runs as it would
                    self._step()
                yield

    def submit(self, sequences: list[Sequence]) -> None:
        """Queue all of `sequences`, or none (ValueError for a bad one, QueueFull, RuntimeError once stopping)."""
        for sequence in sequences:
            self.check(sequence.prompt_ids, sequence.sampling.max_tokens)
        with self._wakeup:
            if self.stopping or self.failure is not None:
                raise RuntimeError(self.failure or "the engine is stopping")
            if any(waiting.cancelled for waiting in self._waiting):  # their clients left: they hold no place
                self._waiting = collections.deque(waiting for waiting in self._waiting if not waiting.cancelled)
            if len(self._waiting) + len(sequences) > self.max_queue:
                raise QueueFull(f"{len(self._waiting)} sequences are waiting (queue limit {self.max_queue})")
            self._waiting.extend(sequences)
            self._wakeup.notify()

    def check(self, prompt_ids: list[int], max_tokens: int) -> None:
        """A ValueError unless the prompt is token ids of the tokenizer (the model) and it fits the context with
        max_tokens: there is no sliding window, so what cannot fit is refused before any work."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        for token in prompt_ids:
            if type(token) is not int or not 0 <= token < self.prompt_limit:
                raise ValueError(f"token id {token!r} is outside the vocabulary [0, {self.prompt_limit})")
        context = self.model.config.context_length
        if len(prompt_ids) + max(max_tokens - 1, 0) > context:  # the last token sampled is never fed back
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens and max_tokens is {max_tokens}, more than "
                             f"the model's context of {context} tokens holds (prompt + max_tokens - 1)")

    def request_stop(self) -> None:
        """Fail every sequence and end the thread, soon. Only sets a flag: safe inside a signal handler."""
        self.stopping = True

    @property
    def failed(self) -> bool:
        """Whether the engine thread ended on an error (`failure` says which): nothing will be decoded."""
        return self.failure is not None

    def close(self, timeout: float = 30.0) -> None:
        self.request_stop()
        with self._wakeup:
            self._wakeup.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def stats(self) -> dict[str, int]:
        waiting = sum(not sequence.cancelled for sequence in self._waiting)
        return {"active": len(self._rows), "waiting": waiting, "max_batch": self.max_batch,
                "max_queue": self.max_queue, "steps": self.steps, "tokens_sampled": self.sampled}

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        try:
            with torch.inference_mode(), kernels.decoding(self.model, self.compile, self.max_batch) as forward:
                self._forward = forward  # the fused decoding step (model/kernels/decode_step.py) where it applies
                if self.compile and compiled_step.supports(self.model):
                    try:
                        self._compile_steps()
                    except Exception:  # e.g. no C++ compiler: each step then fails its requests with the reason
                        log.exception("compiling the decoding step failed")
                self._ready.set()
                self._decode_until_stopped()
        except Exception as error:  # setting up the decoding failed: nothing can be decoded (a failing step is
            # caught in _decode_until_stopped: its requests fail, and the server goes on)
            self.failure = f"the decoding engine failed: {type(error).__name__}: {error}"
            if self._ready.is_set():  # while serving: the log says it (before, start() raises it)
                log.error(self.failure)
            self._fail_all(self.failure, kind="shutdown")
        finally:
            self._ready.set()  # whatever happened: start() must not wait forever

    def _decode_until_stopped(self) -> None:
        while True:
            with self._wakeup:
                while not (self.stopping or self._waiting or self._rows):
                    self._wakeup.wait(0.1)  # a timeout: request_stop (a signal handler) cannot notify
                if self.stopping:
                    break
            try:
                self._step()
            except Exception as error:  # a bug or out of memory: the clients hear of it, the server goes on
                log.exception("decoding step failed")
                self._fail_all(f"decoding failed: {type(error).__name__}: {error}")
        self._fail_all("the server is shutting down", kind="shutdown")

    def _compile_steps(self) -> None:
        """Build the decoding step before the first request rather than during it: its two libraries, one row and
        any other count (compiled_step.py), each by a step on a scratch cache, before start() returns."""
        log.info("compiling the decoding step (ahead of time, 20-60 s)")
        for rows in (1, 2):
            with torch.inference_mode(False):  # a cache as the batch's: its strides are built into the library
                cache = KVCache.for_model(self.model, rows, zeroed=False)
            self._forward(torch.zeros(rows, 1, dtype=torch.long, device=self.device), cache)  # a prefill
            self._forward(torch.zeros(rows, 1, dtype=torch.long, device=self.device), cache)  # a compiled step

    def _step(self) -> None:
        self._admit()
        self._leave()
        if not self._rows:
            return
        cache = self._batch.cache
        if cache.length + 1 > cache.max_seq_len:
            self._batch.compact()
        last = torch.tensor([[row.last] for row in self._rows], device=self.device)  # (B, 1)
        logits = self._forward(last, cache)[:, -1]  # (B, V)
        self._sample(self._rows, logits)
        self.steps += 1

    def _admit(self) -> None:
        while len(self._rows) < self.max_batch:
            with self._wakeup:
                if not self._waiting:
                    return
                sequence = self._waiting.popleft()
            if not sequence.cancelled:
                self._prefill(sequence)

    def _prefill(self, sequence: Sequence) -> None:
        row = _Row(sequence, self.tokenizer, self.device)
        sampling = sequence.sampling
        ids = torch.tensor([sequence.prompt_ids], device=self.device)  # (1, P)
        cache = None
        if sampling.max_tokens > 0:
            cache = self._prefill_cache
            cache.reset()
        if sampling.prompt_logprobs or cache is None:  # every position's logits: the model's forward
            logits = self.model(ids, kv_cache=cache, last_only=not sampling.prompt_logprobs)  # (1, P or 1, V)
        else:
            logits = self._forward(ids, cache)  # (1, 1, V): the decoding step, as generate() prefills
        if sampling.prompt_logprobs:
            sequence.emit(self._prompt_logprobs(sequence.prompt_ids, logits[0], sampling.logprobs or 0))
        if sampling.max_tokens == 0:
            sequence.emit(Finished("length"))
            return
        self._sample([row], logits[:, -1])
        if not row.done:
            self._rows.append(row)
            self._batch.add(cache)

    def _leave(self) -> None:
        """Drop finished and cancelled rows (and their cache rows), and the columns that were only theirs: every
        step attends over the cache's whole length, so columns that are padding in every row left would cost
        each later step until the context's end (one copy of the cache now, against a share of every step)."""
        kept = [index for index, row in enumerate(self._rows) if not (row.done or row.sequence.cancelled)]
        if len(kept) == len(self._rows):
            return
        self._rows = [self._rows[index] for index in self._batch.keep(kept)]
        self._batch.compact()

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """One token for each row from its logits (len(rows), V); emits them and marks the rows that end."""
        tokens = self._choose(rows, logits[:, :self.vocab_limit])
        self.sampled += len(tokens)
        wanted = [i for i, row in enumerate(rows) if row.sampling.logprobs is not None]
        scores = self._log_probs(logits[wanted]) if wanted else None
        for i, (row, token) in enumerate(zip(rows, tokens)):
            logprob = top = None
            if scores is not None and i in wanted:
                row_scores = scores[wanted.index(i)]
                logprob, top = float(row_scores[token]), _top(row_scores[None], row.sampling.logprobs)[0]
            if token == self.eos_id or token in row.sampling.stop_ids:  # end of text or of a turn: no part of the
                # completion's text or token count, but with logprobs it has its entry (lm-eval drops the last
                if logprob is not None:  # entry as the sampled one)
                    row.sequence.emit(Token(token, "", logprob, top))
                self._finish(row, "stop")
                continue
            row.generated += 1
            row.last = token
            row.sequence.emit(Token(token, row.text.add(token) if row.text else "", logprob, top))
            if row.text and row.text.stopped:
                self._finish(row, "stop")
            elif row.generated >= row.sampling.max_tokens:
                self._finish(row, "length")

    @staticmethod
    def _choose(rows: list[_Row], logits: torch.Tensor) -> list[int]:
        """Each row's token, as sample_next draws it for that row alone: the greedy rows' argmax, the others'
        distributions in one pass (sampling.probabilities) and their draws in another, each row's noise from its
        own generator (sampling.draw)."""
        greedy = [row.sampling.temperature == 0 for row in rows]
        tokens = logits.argmax(dim=-1).tolist() if any(greedy) else [0] * len(rows)
        sampled = [i for i, is_greedy in enumerate(greedy) if not is_greedy]
        if sampled:
            settings = [rows[i].sampling for i in sampled]
            probs = probabilities(logits if len(sampled) == len(rows) else logits[sampled],
                                  [s.temperature for s in settings], [s.top_k for s in settings],
                                  [s.top_p for s in settings])
            drawn = draw(probs, [rows[i].generator for i in sampled]).tolist()
            for i, token in zip(sampled, drawn):
                tokens[i] = token
        return tokens

    def _finish(self, row: _Row, reason: str) -> None:
        row.done = True
        row.sequence.emit(Finished(reason, row.text.finish() if row.text else "", row.generated))

    def _log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """log-softmax over the tokenizer's ids, in float32: the model's own distribution (no temperature)."""
        return logits[..., :self.vocab_limit].float().log_softmax(dim=-1)

    def _prompt_logprobs(self, prompt: list[int], logits: torch.Tensor, alternatives: int) -> PromptLogprobs:
        """logits (P, V) of the whole prompt -> the log-probability of each prompt token after the ones before."""
        scores = self._log_probs(logits[:-1])  # (P - 1, V): position i predicts token i + 1
        targets = torch.tensor(prompt[1:], device=scores.device)
        logprobs = scores.gather(-1, targets[:, None])[:, 0].tolist() if len(prompt) > 1 else []
        return PromptLogprobs([None, *logprobs], [None, *_top(scores, alternatives)])

    def _fail_all(self, message: str, kind: str = "server_error") -> None:
        for row in self._rows:
            if not row.done:
                row.sequence.emit(Failed(message, kind))
        self._rows = []
        self._batch.keep([])
        if kind == "shutdown":
            with self._wakeup:
                waiting, self._waiting = list(self._waiting), collections.deque()
            for sequence in waiting:
                sequence.emit(Failed(message, kind))


def _top(scores: torch.Tensor, alternatives: int) -> list[dict[int, float]]:
    """Each row of scores (N, V): its `alternatives` likeliest ids and their log-probabilities ({} for none)."""
    if not alternatives:
        return [{} for _ in range(len(scores))]
    values, ids = scores.topk(alternatives, dim=-1)
    return [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
