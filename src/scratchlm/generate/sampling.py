"""Text generation: temperature, top-k and nucleus (top-p) sampling over a KV-cached TransformerLM.

`generate(model, prompt_ids, max_new_tokens, ...)` returns the new tokens of each prompt; `stream(...)` is the
same loop as a generator that yields one step at a time (the CLI prints text as it is produced).

Design:
- Sampling rule per step, in this order: only the first `vocab_limit` logits (a model's vocabulary may be padded
  past its tokenizer's: those ids have no text); temperature 0 -> argmax (greedy); else (logits - max) /
  temperature, top-k (keep logits >= the k-th largest: ties at the boundary are all kept), softmax, top-p (keep
  the smallest set of most-likely tokens whose mass reaches p: a token stays when the mass strictly before it is
  < p), sample.
- Batches of prompts of different lengths are LEFT padded; the model's `attention_mask` hides the padding and
  numbers each row's real tokens 0, 1, 2, ... (see model/kv_cache.py), so a row decodes exactly as it would
  alone (greedy).
- Incremental decoding: one prefill of the prompts into a preallocated `KVCache`, then one token per step.
  Token ids live in one preallocated (B, prompt + max_new_tokens) buffer; nothing else is rebuilt per step.
- Sliding window: the model sees at most `context_length` tokens. When the next step would exceed that, the
  window jumps forward to the last `keep = context_length - context_length // 4` tokens, which are re-prefilled
  into the reset cache (positions restart at 0); decoding then continues incrementally for another
  `context_length // 4` tokens. A prompt longer than the context is cut the same way (its last `keep` tokens).
  The uncached loop (`use_cache=False`, the benchmark's baseline and the tests' oracle) recomputes exactly the
  same windows, so cached and uncached greedy decoding agree even beyond the context.
- Speed: decoding runs under `kernels.decoding(model)` (model/kernels/): the model's fastest paths for its
  device, and on CPU its weights packed for oneDNN (model/kernels/packed_linear.py; bf16 weights packed in bf16
  only where the CPU has bf16 instructions). They are switched on when decoding starts and off when it ends (or
  when the caller drops the stream); kernels the caller applied to the model stay.
- Each row stops at `eos_id` (not included in its output) or after `max_new_tokens`; the loop ends when every
  row has stopped. `seed` makes sampling reproducible through a private `torch.Generator`.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence

import torch

from scratchlm.model import KVCache, TransformerLM, kernels


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits (..., V) with every entry below the k-th largest set to -inf (ties with the k-th are kept)."""
    if k >= logits.shape[-1]:
        return logits
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(probs: torch.Tensor, p: float) -> torch.Tensor:
    """probs (..., V) with everything outside the nucleus zeroed (not renormalized).

    The nucleus is the smallest set of most-likely tokens whose total mass reaches p: sorted by probability,
    a token is kept while the mass of the tokens before it is still below p (so the top token always stays).
    """
    if p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # (..., V); ties: lower id first
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return probs.masked_fill(drop, 0.0)


def sample_next(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0,
                generator: torch.Generator | None = None, vocab_limit: int | None = None) -> torch.Tensor:
    """Next token ids (B,) from logits (B, V), all < vocab_limit (default V), with the rule in the module docstring."""
    logits = logits[..., :vocab_limit]  # (B, vocab_limit): a prefix, so positions are still token ids
    if temperature == 0:
        return logits.argmax(dim=-1)
    rows = logits.shape[0]
    return draw(probabilities(logits, [temperature] * rows, [top_k] * rows, [top_p] * rows), generator)


def draw(probs: torch.Tensor, generators: torch.Generator | None | list[torch.Generator | None]) -> torch.Tensor:
    """A token id per row (B,) drawn from probs (B, V) (zeros allowed, sums need not be 1), with one generator for
    the batch or one per row (a server's requests each have their own seed).

    The exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) independent picks i with probability p_i / sum(p)
    (the smallest E_i / p_i, an exponential of rate p_i, wins). It is what `torch.multinomial` does for one
    sample, draw for draw (tests/test_generate.py), with the noise drawn row by row when each row has its own
    generator and the argmax one op for the batch."""
    noise = torch.empty_like(probs)
    if isinstance(generators, list):
        for row, generator in enumerate(generators):
            noise[row].exponential_(generator=generator)
    else:
        noise.exponential_(generator=generators)
    return (probs / noise).argmax(dim=-1)


def probabilities(logits: torch.Tensor, temperatures: Sequence[float], top_ks: Sequence[int | None],
                  top_ps: Sequence[float]) -> torch.Tensor:
    """The distribution (B, V) each row samples from, each with its own temperature (> 0), top-k and top-p: one
    pass over the batch, so a server's rows with different settings sample together (rows that share a top-k or
    a top-p are filtered together). A row's result does not depend on the rows beside it."""
    # Any positive temperature, however tiny: logits / 1e-40 would overflow to inf (softmax: NaN), so the max is
    # subtracted first (the top logit becomes 0, the rest go to -inf); and a temperature below float32's smallest
    # normal number is raised to it, as it would round to 0 (0 / 0 = NaN) where the distribution is one-hot on the
    # top logits anyway. softmax subtracts the max itself, so T = 1 is bit-identical to plain logits / T.
    temperature = torch.tensor(temperatures, dtype=torch.float32, device=logits.device)
    temperature = temperature.clamp_min(torch.finfo(torch.float32).tiny)[:, None]  # (B, 1)
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    for k, rows in _groups(top_ks):
        if k is not None:
            logits[rows] = top_k_filter(logits[rows], k)
    probs = logits.softmax(dim=-1)
    for p, rows in _groups(top_ps):
        if p < 1.0:
            probs[rows] = top_p_filter(probs[rows], p)
    return probs


def _groups(values: Sequence) -> list[tuple[object, slice | list[int]]]:
    """Each distinct value and the rows that have it (all rows: a slice, which indexes without a copy)."""
    if len(set(values)) <= 1:
        return [(values[0] if values else None, slice(None))]
    rows: dict[object, list[int]] = {}
    for row, value in enumerate(values):
        rows.setdefault(value, []).append(row)
    return list(rows.items())


def generate(model: TransformerLM, prompt_ids: Sequence[int] | Sequence[Sequence[int]], max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int | None = None, eos_id: int | None = None,
             seed: int | None = None, use_cache: bool = True, vocab_limit: int | None = None,
             compile: bool = False) -> list[list[int]]:
    """The new tokens of each prompt (a list of prompts, or one prompt as a flat list -> a list of one).

    ``vocab_limit`` (default: the model's vocab_size) restricts sampling to ids below it, e.g. a tokenizer's
    vocab_size when the model's vocabulary is padded beyond it. ``compile`` decodes a bf16 model's steps through
    torch.compile (model/kernels/compiled_step.py): faster per token on a CPU, after a compile of seconds.
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
    """Yield, per decoding step, one new token id per prompt (None for a row that has already stopped).

    Arguments are checked here, before the first step, so bad input fails at the call, not at iteration.
    """
    _check_options(max_new_tokens, temperature, top_p, top_k)
    _check_vocab_limit(vocab_limit, model.config.vocab_size)
    decoder = _Decoder(model, _as_batch(prompt_ids, model.config.vocab_size), max_new_tokens, use_cache)
    generator = None
    if seed is not None:
        generator = torch.Generator(decoder.tokens.device).manual_seed(seed)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator, vocab_limit=vocab_limit)
    return _decode(decoder, max_new_tokens, eos_id, sampling, compile)


def _decode(decoder: _Decoder, max_new_tokens: int, eos_id: int | None, sampling: dict,
            compile: bool) -> Iterator[list[int | None]]:
    rows = decoder.tokens.shape[0]
    finished = [False] * rows
    # until the last step, or until the caller drops it
    with kernels.decoding(decoder.model, compile=compile) as forward:
        for column in range(decoder.prompt_width, decoder.prompt_width + max_new_tokens):
            step: list[int | None] = decoder.next_tokens(column, sampling, forward).tolist()
            for row, token in enumerate(step):
                if finished[row] or token == eos_id:
                    finished[row], step[row] = True, None
            yield step
            if all(finished):
                return


class _Decoder:
    """The token buffer, the padding mask, the context window and (optionally) the KV cache of one batch."""

    def __init__(self, model: TransformerLM, prompts: list[list[int]], max_new_tokens: int, use_cache: bool):
        self.model = model
        self.context = model.config.context_length
        self.keep = self.context - self.context // 4  # tokens kept when the window slides
        self.prompt_width = max(len(p) for p in prompts)
        self.pad_width = self.prompt_width - min(len(p) for p in prompts)  # columns that hold any padding
        device = model.lm_head.weight.device
        total = self.prompt_width + max_new_tokens
        self.tokens = torch.zeros(len(prompts), total, dtype=torch.long, device=device)  # (B, total)
        self.real = torch.ones(len(prompts), total, dtype=torch.bool, device=device)  # False = left padding
        for row, prompt in enumerate(prompts):
            pad = self.prompt_width - len(prompt)
            self.tokens[row, pad:self.prompt_width] = torch.tensor(prompt, dtype=torch.long)
            self.real[row, :pad] = False
        self.cache = KVCache.for_model(model, len(prompts)) if use_cache else None
        self.start = 0  # first column inside the model's window
        self.cached_until = 0  # columns [start, cached_until) are in the cache

    @torch.inference_mode()
    def next_tokens(self, column: int, sampling: dict, forward: kernels.Step) -> torch.Tensor:
        """Sample the tokens (B,) of `column` and store them in the buffer; `forward` is the model's step."""
        next_ids = sample_next(self.logits_before(column, forward), **sampling)
        self.tokens[:, column] = next_ids
        return next_ids

    def logits_before(self, column: int, forward: kernels.Step) -> torch.Tensor:
        """Next-token logits (B, V) after columns [.., column), sliding the window first if it is full."""
        if column - self.start > self.context:
            self.start = column - self.keep
            if self.cache is not None:
                self.cache.reset()
                self.cached_until = self.start
        first = self.cached_until if self.cache is not None else self.start
        ids = self.tokens[:, first:column]  # (B, T)
        mask = self.real[:, first:column] if first < self.pad_width else None
        logits = forward(ids, self.cache, mask)  # (B, 1, V)
        self.cached_until = column
        return logits[:, -1]


def _check_options(max_new_tokens: int, temperature: float, top_p: float, top_k: int | None) -> None:
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
