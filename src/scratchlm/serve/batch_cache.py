"""Row operations on a KVCache for continuous batching: merge caches, keep some rows, drop shared padding.

`KVCache` (model/kv_cache.py) holds every row at one shared `length`, shorter rows LEFT padded: `key_padding`
(B, T_max) marks real positions and `next_position` (B,) continues each row's RoPE numbering, so a row's padding
changes neither what it attends to nor its positions. That is all continuous batching needs:

- `merge(a, b)`: the rows of a, then those of b, in one cache of length max(a.length, b.length); the shorter
  cache's rows are shifted right, their new leading columns marked as padding. A new request joins this way
  after its prefill (alone, in a cache of its own).
- `select(cache, rows)`: a cache of those rows only (finished requests leave).
- `compact(cache)`: drops the leading columns that are padding in every row, so the length can grow again (and
  the steps stop attending over them: the engine compacts whenever rows leave). Every row's own tokens (prompt +
  completion) fit the context, so after compacting the longest row has room.

Each returns a new cache or edits in place, copying whole key/value rows: one (rows, heads, length, head_dim)
copy per layer, rare next to the decoding steps (once per join or leave).
"""

from __future__ import annotations

import torch

from scratchlm.model import KVCache, TransformerLM


def merge(model: TransformerLM, a: KVCache | None, b: KVCache) -> KVCache:
    """One cache holding a's rows, then b's (a None: b itself)."""
    if a is None or a.batch_size == 0:
        return b
    length = max(a.length, b.length)
    merged = KVCache.for_model(model, a.batch_size + b.batch_size, a.max_seq_len)
    rows = 0
    for part in (a, b):
        _copy_rows(part, merged, slice(rows, rows + part.batch_size), shift=length - part.length)
        rows += part.batch_size
    merged.length = length
    merged.has_padding = a.has_padding or b.has_padding or a.length != b.length
    return merged


def select(model: TransformerLM, cache: KVCache, rows: list[int]) -> KVCache | None:
    """A cache of `rows` of `cache`, in that order (None when no row is left)."""
    if not rows:
        return None
    if rows == list(range(cache.batch_size)):
        return cache
    index = torch.tensor(rows, device=cache.key_padding.device)
    kept = KVCache.for_model(model, len(rows), cache.max_seq_len)
    end = cache.length
    for layer in range(len(cache.keys)):
        kept.keys[layer][:, :, :end] = cache.keys[layer][index, :, :end]
        kept.values[layer][:, :, :end] = cache.values[layer][index, :, :end]
    kept.key_padding[:, :end] = cache.key_padding[index, :end]
    kept.next_position.copy_(cache.next_position[index])
    kept.length, kept.has_padding = end, cache.has_padding
    return kept


def compact(cache: KVCache) -> int:
    """Drop the leading columns that are padding in every row (in place); returns how many were dropped."""
    real_anywhere = cache.key_padding[:, :cache.length].any(dim=0)  # (length,)
    if not cache.has_padding or not real_anywhere.any():
        return 0
    drop = int(real_anywhere.int().argmax())  # the first column that some row really uses
    if drop == 0:
        return 0
    end = cache.length
    for buffers in (cache.keys, cache.values):
        for layer, buffer in enumerate(buffers):
            buffers[layer][:, :, :end - drop] = buffer[:, :, drop:end].clone()  # overlapping ranges: copy first
    cache.key_padding[:, :end - drop] = cache.key_padding[:, drop:end].clone()
    cache.key_padding[:, end - drop:].fill_(True)
    cache.length = end - drop
    return drop


def _copy_rows(source: KVCache, target: KVCache, rows: slice, shift: int) -> None:
    """source's rows into target's `rows`, `shift` columns to the right (the columns before are padding)."""
    end = source.length
    for layer in range(len(source.keys)):
        target.keys[layer][rows, :, shift:shift + end] = source.keys[layer][:, :, :end]
        target.values[layer][rows, :, shift:shift + end] = source.values[layer][:, :, :end]
    target.key_padding[rows, :shift] = False
    target.key_padding[rows, shift:shift + end] = source.key_padding[:, :end]
    target.next_position[rows] = source.next_position
