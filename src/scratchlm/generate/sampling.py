"""The sampling rule: temperature, top-k and nucleus (top-p) sampling of the next token from a model's logits.

Per step, in this order: only the first `vocab_limit` logits (a model's vocabulary may be padded past its
tokenizer's: those ids have no text); temperature 0 -> argmax (greedy); else (logits - max) / temperature, top-k
(keep logits >= the k-th largest: ties at the boundary are all kept), softmax, top-p (keep the smallest set of
most-likely tokens whose mass reaches p: a token stays when the mass strictly before it is < p), sample.
`probabilities` applies it to a batch whose rows each have their own settings, and `draw` samples each row with its
own generator (the engine's rows, engine.py); `sample_next` is the rule for a batch that shares its settings.
The decoding loop around it is engine.py; generate() and stream() (decoding.py) drive it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
