"""The KV cache of a continuously batched decoder: rows join and leave between steps, in buffers allocated once.

A `KVCache` keeps every row at one shared `length`, shorter rows LEFT padded (`key_padding` marks real
positions, `next_position` continues each row's RoPE numbering): that is all continuous batching needs.
`BatchCache` holds `capacity` rows and decodes its first `rows` (`cache`, a KVCache over the same buffers):
- `add(prefilled)`: new rows join after the others, right-aligned to the batch's length (a longer prefill
  shifts the batch's rows right instead);
- `keep(rows)`: only those rows stay, rows past the new count moving into freed places (it returns the order);
- `compact()`: drops leading columns that are padding in every row, so the length can grow again. Every row's
  tokens fit the context, so after compacting the longest row has room.
The buffers are allocated once and left unwritten (`zeroed=False`): a new cache per join or leave would zero and
copy the batch's whole size, and an idle server's pages take no memory. Only written positions are read (a
joining row's padding columns are zeroed). Invariant: from the cache's length on, every row's columns are
marked real, as in a fresh KVCache, so each step's new key is attended.
"""

from __future__ import annotations

from scratchlm.model import KVCache, TransformerLM


class BatchCache:
    def __init__(self, model: TransformerLM, capacity: int) -> None:
        # The buffers (their own length is never used), unwritten: a page takes memory once a row has used it.
        self.store = KVCache.for_model(model, capacity, zeroed=False)
        self.cache: KVCache | None = None  # the first `rows` rows, what each decoding step reads and extends

    @property
    def rows(self) -> int:
        return 0 if self.cache is None else self.cache.batch_size

    def add(self, prefilled: KVCache) -> None:
        """The rows of `prefilled` join the batch after the rows already in it."""
        rows, joining = self.rows, prefilled.batch_size
        if rows + joining > self.store.batch_size:
            raise ValueError(f"the batch holds {self.store.batch_size} rows: {rows} + {joining} do not fit")
        length = self.cache.length if self.cache is not None else 0
        has_padding = self.cache is not None and self.cache.has_padding
        if prefilled.length > length and rows:  # the newcomer is the longest: the others move right
            _shift_right(self.store, slice(0, rows), length, prefilled.length - length)
            has_padding = True
        new_length = max(length, prefilled.length)
        _copy_in(prefilled, self.store, slice(rows, rows + joining), shift=new_length - prefilled.length)
        self._use_rows(rows + joining, new_length,
                       has_padding or prefilled.has_padding or (rows > 0 and length != prefilled.length))

    def keep(self, kept: list[int]) -> list[int]:
        """Only the rows `kept` stay; returns the old index of each row left, in its new place. Each place a
        leaving row frees below the new row count takes one of the rows kept past it: one row copied per row that
        leaves, however many rows come after it."""
        if self.cache is None:
            return []
        count, length, has_padding = len(kept), self.cache.length, self.cache.has_padding
        order = list(range(self.rows))
        staying = set(kept)
        holes = [row for row in range(count) if row not in staying]
        movers = [row for row in range(count, self.rows) if row in staying]  # as many as holes
        store = self.store
        for hole, mover in zip(holes, movers):
            for buffers in (store.keys, store.values):
                for buffer in buffers:
                    buffer[hole, :, :length] = buffer[mover, :, :length]
            store.key_padding[hole] = store.key_padding[mover]
            store.next_position[hole] = store.next_position[mover]
            order[hole] = mover
        self._use_rows(count, length, has_padding)
        return order[:count]

    def _use_rows(self, count: int, length: int, has_padding: bool) -> None:
        """Decode the store's first `count` rows from now on (none: no cache), at `length`."""
        self.cache = self.store.rows(count) if count else None
        if self.cache is not None:
            self.cache.length, self.cache.has_padding = length, has_padding

    def compact(self) -> int:
        """Drop the leading columns that are padding in every row (in place); returns how many were dropped."""
        cache = self.cache
        if cache is None or not cache.has_padding:
            return 0
        real_anywhere = cache.key_padding[:, :cache.length].any(dim=0)  # (length,)
        if not real_anywhere.any():
            return 0
        drop = int(real_anywhere.int().argmax())  # the first column that some row really uses
        if drop == 0:
            return 0
        end = cache.length
        for buffers in (cache.keys, cache.values):
            for buffer in buffers:
                buffer[:, :, :end - drop] = buffer[:, :, drop:end].clone()  # overlapping ranges: copy first
        cache.key_padding[:, :end - drop] = cache.key_padding[:, drop:end].clone()
        cache.key_padding[:, end - drop:].fill_(True)
        cache.length = end - drop
        return drop


def _shift_right(store: KVCache, rows: slice, length: int, shift: int) -> None:
    """Move columns [0, length) of `rows` to [shift, shift + length); the columns before become padding."""
    for buffers in (store.keys, store.values):
        for buffer in buffers:
            buffer[rows, :, shift:shift + length] = buffer[rows, :, :length].clone()  # overlapping: copy first
            buffer[rows, :, :shift] = 0
    store.key_padding[rows, shift:shift + length] = store.key_padding[rows, :length].clone()
    store.key_padding[rows, :shift] = False


def _copy_in(source: KVCache, store: KVCache, rows: slice, shift: int) -> None:
    """source's rows into the store's `rows`, `shift` columns to the right (the columns before are padding,
    zeroed: a row that left may have left anything there, and a masked column's value still meets a 0 weight)."""
    end = source.length
    for sources, targets in ((source.keys, store.keys), (source.values, store.values)):
        for layer, target in enumerate(targets):
            target[rows, :, :shift] = 0
            target[rows, :, shift:shift + end] = sources[layer][:, :, :end]
    store.key_padding[rows, :shift] = False
    store.key_padding[rows, shift:shift + end] = source.key_padding[:, :end]
    store.key_padding[rows, shift + end:] = True
    store.next_position[rows] = source.next_position
