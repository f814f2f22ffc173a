"""Log-likelihood of a continuation given a context: the request multiple-choice benchmarks are made of.

A benchmark such as HellaSwag asks, for each candidate answer, log p(continuation | context) and whether greedy
decoding would produce it. These requests are answered as lm-evaluation-harness (``lm_eval`` 0.4.x) answers them for
its ``hf`` model, so ``scratchlm eval --continuations`` matches ``lm_eval`` on the ``export hf`` folder
(scripts/check_lm_eval.sh):

- Tokenization (``TemplateLM._encode_pair``): the context's trailing whitespace moves to the front of the
  continuation; context + continuation is encoded whole and cut where the context's own encoding ends. An empty
  context is the end-of-text token (or the continuation's first token, when it is that token).
- Scoring (``HFLM._loglikelihood_tokens``): the model reads the last ``context_length + 1`` tokens, less the last;
  the continuation's tokens are scored at the last positions: the sum of their log-softmax values, and whether each
  is its position's argmax. ``eval --window`` sets a smaller ``context_length``: lm_eval's API models keep
  ``max_length - 1`` tokens, so against ``scratchlm serve`` they score as ``context_length = max_length - 2`` here.

Batches are right-padded: under a causal mask no scored position sees the padding after it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from scratchlm.tokenizer.formats.hf import EOS_TOKEN
from scratchlm.tokenizer.tokenizer import Tokenizer

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # inputs (B, T) long -> logits (B, T, V)


@dataclass(frozen=True)
class Request:
    """One line of a continuations file: its number (1-based) and the two strings."""

    line: int
    context: str
    continuation: str


@dataclass(frozen=True)
class Score:
    loglikelihood: float  # sum over the continuation's tokens of log p(token | everything before it), nats
    is_greedy: bool  # every continuation token is the argmax of its position
    tokens: int  # the continuation's tokens scored


def read_requests(path: Path) -> list[Request]:
    """The requests of a JSON Lines file of ``{"context": str, "continuation": str}`` (blank lines skipped)."""
    requests = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: malformed JSON ({error.msg}, column {error.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: want a JSON object with \"context\" and \"continuation\", "
                                 f"got {type(record).__name__}")
            for field in ("context", "continuation"):
                if not isinstance(record.get(field), str):
                    found = "missing" if field not in record else f"{json.dumps(record[field])}, not a string"
                    raise ValueError(f"{path}:{number}: field {field!r} is {found}")
            requests.append(Request(number, record["context"], record["continuation"]))
    if not requests:
        raise ValueError(f"{path}: no requests (want one JSON object a line)")
    return requests


def encode_request(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm_eval cuts them (see the module docstring)."""
    if not context:
        if EOS_TOKEN not in tokenizer.special_tokens:
            raise ValueError(f"an empty context is scored after {EOS_TOKEN}, which this tokenizer lacks "
                             f"(special tokens: {tokenizer.special_tokens})")
        eot, ids = tokenizer.special_id(EOS_TOKEN), tokenizer.encode(continuation)
        return (ids[:1], ids[1:]) if ids[:1] == [eot] else ([eot], ids)  # one that starts with it needs no other
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return context_ids, whole[len(context_ids):]


def check_continuation(continuation_ids: Sequence[int], context_length: int) -> None:
    """lm_eval's limits: at least one token to score, and no more than the model reads at once."""
    if not 1 <= len(continuation_ids) <= context_length:
        raise ValueError(f"the continuation is {len(continuation_ids)} tokens; the model scores 1 to its "
                         f"context_length {context_length}")


def score_tokens(logits_fn: LogitsFn, pairs: Sequence[tuple[list[int], list[int]]], context_length: int, *,
                 batch_size: int = 8, device: str | torch.device = "cpu") -> list[Score]:
    """Score each (context ids, continuation ids) pair; the continuation must have 1..context_length tokens."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    windows = []  # (model input, the continuation's ids)
    for index, (context_ids, continuation_ids) in enumerate(pairs):
        try:
            check_continuation(continuation_ids, context_length)
        except ValueError as error:
            raise ValueError(f"request {index}: {error}") from None
        window = (context_ids + continuation_ids)[-(context_length + 1):][:-1]
        windows.append((window, continuation_ids))
    scores = []
    for first in range(0, len(windows), batch_size):
        batch = windows[first:first + batch_size]
        width = max(len(window) for window, _ in batch)
        inputs = torch.zeros(len(batch), width, dtype=torch.long)  # right padding: never seen (causal mask)
        for row, (window, _) in enumerate(batch):
            inputs[row, :len(window)] = torch.tensor(window)
        log_probs = torch.log_softmax(logits_fn(inputs.to(device)).float(), dim=-1).cpu()  # (B, T, V)
        for row, (window, continuation_ids) in enumerate(batch):
            positions = log_probs[row, len(window) - len(continuation_ids):len(window)]  # (n, V)
            targets = torch.tensor(continuation_ids)
            scores.append(Score(loglikelihood=positions.gather(-1, targets[:, None]).double().sum().item(),
                                is_greedy=bool((positions.argmax(-1) == targets).all()),
                                tokens=len(continuation_ids)))
    return scores


def score_requests(logits_fn: LogitsFn, tokenizer: Tokenizer, requests: Sequence[Request], context_length: int,
                   *, source: str | Path, batch_size: int = 8, device: str | torch.device = "cpu") -> list[Score]:
    """Encode and score requests read from ``source``; an unscorable one is refused naming its line."""
    pairs = []
    for request in requests:
        try:
            context_ids, continuation_ids = encode_request(tokenizer, request.context, request.continuation)
            check_continuation(continuation_ids, context_length)
        except ValueError as error:
            raise ValueError(f"{source}:{request.line}: {error}") from None
        pairs.append((context_ids, continuation_ids))
    return score_tokens(logits_fn, pairs, context_length, batch_size=batch_size, device=device)
