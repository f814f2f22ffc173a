"""generate() and stream(): the new tokens of one prompt or of a batch, decoded by the engine (engine.py).

`generate` returns the new tokens of each prompt; `stream` yields them one step at a time (the CLI prints text
as it comes). Both drive the server's engine on the caller's thread. Prompt i samples with its own generator,
seeded `seed + i`, so a prompt alone gives what the server gives for the same seed. A row stops at `eos_id` (not
returned) or after `max_new_tokens`; a prompt that does not fit the context with them (prompt + max_new_tokens - 1)
is refused before any work.

`use_cache=False` is the oracle that tests and benchmarks hold the engine to: every step recomputes the whole
sequence through the model (left-padded rows, no cache), sampling each row as the engine does.
"""

from __future__ import annotations

import collections
import numbers
from collections.abc import Iterator, Sequence

import torch

from scratchlm.generate.engine import Engine, Failed, Finished, Sampling, Token
from scratchlm.generate.engine import Sequence as EngineSequence
from scratchlm.generate.sampling import sample_next
from scratchlm.model import TransformerLM


def generate(model: TransformerLM, prompt_ids: Sequence[int] | Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int | None = None, eos_id: int | None = None,
             seed: int | None = None, use_cache: bool = True, vocab_limit: int | None = None,
             compile: bool = False) -> list[list[int]]:
    """The new tokens of each prompt (a list of prompts, or one prompt as a flat list -> a list of one).

    ``vocab_limit`` (default: the model's vocab_size) restricts sampling to ids below it, e.g. a tokenizer's
    vocab_size when the model's vocabulary is padded beyond it. ``compile`` decodes through a step compiled ahead of
    time (model/kernels/compiled_step.py): faster per token on a CPU, after a build of seconds.
    """
    prompts = _as_batch(prompt_ids, model.config.vocab_size)
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in stream(model, prompts, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                       eos_id=eos_id, seed=seed, use_cache=use_cache, vocab_limit=vocab_limit, compile=compile):
        for row, token in zip(outputs, step):
            if token is not None:
                row.append(token)
    return outputs


def stream(model: TransformerLM, prompt_ids: Sequence[int] | Sequence[Sequence[int]], max_new_tokens: int, *,
           temperature: float = 1.0, top_p: float = 1.0, top_k: int | None = None, eos_id: int | None = None,
           seed: int | None = None, use_cache: bool = True, vocab_limit: int | None = None,
           compile: bool = False) -> Iterator[list[int | None]]:
    """Yield, per step, one new token id per prompt (None for a row that has already stopped).

    Arguments are checked here, before the first step, so bad input fails at the call, not at iteration.
    """
    check_options(max_new_tokens, temperature, top_p, top_k)
    _check_vocab_limit(vocab_limit, model.config.vocab_size)
    prompts = _as_batch(prompt_ids, model.config.vocab_size)
    engine = Engine(model, None, eos_id=eos_id, max_batch=len(prompts), max_queue=len(prompts), compile=compile,
                    vocab_limit=vocab_limit)
    for index, prompt in enumerate(prompts):
        try:
            engine.check(prompt, max_new_tokens)
        except ValueError as error:
            raise ValueError(f"prompt {index}: {error}") from None
    settings = [Sampling(max_new_tokens, temperature, top_p, top_k, seed=None if seed is None else seed + index)
                for index in range(len(prompts))]
    if not use_cache:
        return _recomputed(model, prompts, settings, eos_id, engine.vocab_limit)
    tokens: list[collections.deque[int | None]] = [collections.deque() for _ in prompts]
    ended = [False] * len(prompts)

    def receiver(index: int):
        def emit(event: object) -> None:
            if isinstance(event, Token):
                tokens[index].append(event.id)
            elif isinstance(event, Finished):
                if event.reason == "stop":  # the end of text, sampled at this position: the row's None
                    tokens[index].append(None)
                ended[index] = True
            elif isinstance(event, Failed):
                raise RuntimeError(event.message)
        return emit

    sequences = [EngineSequence(prompt, sampling, receiver(index))
                 for index, (prompt, sampling) in enumerate(zip(prompts, settings))]
    return _by_position(engine.decode(sequences), tokens, ended)


def _by_position(steps: Iterator[None], tokens: list[collections.deque[int | None]],
                 ended: list[bool]) -> Iterator[list[int | None]]:
    """The engine's tokens a position at a time: the next token of every row (None once it stopped), as soon as
    each row has it or has ended (a joining row samples its first token at its prefill, in the same engine step
    as the others' next one)."""
    for _ in steps:
        while all(queue or done for queue, done in zip(tokens, ended)) and any(tokens):
            yield [queue.popleft() if queue else None for queue in tokens]


def _recomputed(model: TransformerLM, prompts: list[list[int]], settings: list[Sampling], eos_id: int | None,
                vocab_limit: int) -> Iterator[list[int | None]]:
    """The uncached oracle: each step runs the model over every row's whole sequence so far (left-padded) and
    samples each row with its own generator, as the engine does."""
    rows, width = len(prompts), max(len(prompt) for prompt in prompts)
    device = model.lm_head.weight.device
    total = width + settings[0].max_tokens
    ids = torch.zeros(rows, total, dtype=torch.long, device=device)
    real = torch.ones(rows, total, dtype=torch.bool, device=device)  # False = left padding
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):width] = torch.tensor(prompt, dtype=torch.long)
        real[row, :width - len(prompt)] = False
    generators = [torch.Generator(device).manual_seed(s.seed) if s.seed is not None else None for s in settings]
    finished = [False] * rows
    for column in range(width, total):
        with torch.inference_mode():
            mask = real[:, :column] if not real[:, :column].all() else None
            logits = model(ids[:, :column], attention_mask=mask, last_only=True)[:, -1]  # (B, V)
        step: list[int | None] = []
        for row, sampling in enumerate(settings):
            token = int(sample_next(logits[row:row + 1], temperature=sampling.temperature, top_k=sampling.top_k,
                                    top_p=sampling.top_p, generator=generators[row], vocab_limit=vocab_limit))
            ids[row, column] = token
            if finished[row] or token == eos_id:
                finished[row], token = True, None
            step.append(token)
        yield step
        if all(finished):
            return


def default_max_new_tokens(prompt_length: int, context_length: int, cap: int = 256) -> int:
    """The token budget when none is given: what the context leaves after the prompt (the last new token is never
    fed back, so prompt + budget - 1 must fit), at most `cap` (0 or less: the prompt alone passes the context)."""
    return min(cap, context_length + 1 - prompt_length)


def check_options(max_new_tokens: int, temperature: float, top_p: float, top_k: int | None) -> None:
    """A ValueError naming the first sampling option out of its range (generate(), stream() and the chat)."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")


def _check_vocab_limit(vocab_limit: int | None, vocab_size: int) -> None:
    if vocab_limit is not None and (type(vocab_limit) is not int or not 1 <= vocab_limit <= vocab_size):
        raise ValueError(f"vocab_limit must be an integer in [1, {vocab_size}] (the model's vocab_size) or None, "
                         f"got {vocab_limit!r}")


def _as_batch(prompt_ids: Sequence[int] | Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """A list of prompts (each a non-empty list of ids in [0, vocab_size)); one flat prompt becomes a batch of 1."""
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: give at least one prompt of at least one token")
    flat = isinstance(prompt_ids[0], numbers.Integral)
    prompts = [list(prompt_ids)] if flat else [list(p) for p in prompt_ids]
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {index} is empty: generation needs at least one token to condition on")
        for position, token in enumerate(prompt):
            if not isinstance(token, numbers.Integral) or isinstance(token, bool) or not 0 <= token < vocab_size:
                raise ValueError(f"prompt {index}, position {position}: token id {token!r} is outside the "
                                 f"vocabulary [0, {vocab_size})")
    return [[int(token) for token in prompt] for prompt in prompts]
