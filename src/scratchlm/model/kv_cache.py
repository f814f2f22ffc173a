"""KVCache: preallocated per-layer key/value buffers for incremental decoding.

Design: one (B, H_kv, T_max, d_k) key buffer and one value buffer per layer, allocated once, with H_kv the
model's num_kv_heads (fewer than its query heads under grouped-query attention: that is the point of GQA, a
cache num_heads / num_kv_heads times smaller); `length` is how many
positions are filled (shared by all rows of the batch). Each attention layer writes its new keys/values at
[length, length + T) through `update`; the model calls `advance(T, attention_mask)` once after all layers ran.

Batches of prompts with different lengths use LEFT padding, so every row has the same `length`. The cache
keeps a (B, T_max) bool `key_padding` (True = real token) and, per row, the next RoPE position
(`next_position`): padding never gets attended, and each row's real tokens are numbered 0, 1, 2, ... however
much padding precedes them. `TransformerLM.forward(ids, attention_mask=..., kv_cache=cache)` fills both;
`attention_mask` always describes the NEW tokens (same shape as `ids`), and omitting it means "all real".
"""

from __future__ import annotations

import copy

import torch


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 device=None, dtype=torch.float32, zeroed: bool = True) -> None:
        # zeroed=False leaves the key/value buffers unwritten (a position is only read after it was written): on a
        # CPU their pages then take no memory until used, for a server holding room for many rows.
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        new = torch.zeros if zeroed else torch.empty
        self.keys = [new(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [new(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.key_padding = torch.ones(batch_size, max_seq_len, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_seq_len = max_seq_len
        self.length = 0
        self.has_padding = False  # set once any call passed an attention_mask: then masks are applied

    @classmethod
    def for_model(cls, model, batch_size: int, max_seq_len: int | None = None, zeroed: bool = True) -> KVCache:
        """A cache sized for `model` (a TransformerLM), on its device and in its dtype."""
        layers, heads, head_dim, dtype, device = _layout(model)
        return cls(layers, batch_size, heads, max_seq_len or model.config.context_length, head_dim, device=device,
                   dtype=dtype, zeroed=zeroed)

    def rows(self, count: int) -> KVCache:
        """A cache of the first `count` rows over the same buffers (writes to either show in both), at this
        cache's length: how a server's batch of fewer rows than it has room for decodes without copying."""
        view = copy.copy(self)
        view.keys = [keys[:count] for keys in self.keys]
        view.values = [values[:count] for values in self.values]
        view.key_padding, view.next_position = self.key_padding[:count], self.next_position[:count]
        return view

    def check_model(self, model) -> None:
        """A clear error when the cache was built for another model (layers, KV heads, head size, dtype, device)."""
        keys, expected = self.keys[0], _layout(model)
        found = (len(self.keys), keys.shape[1], keys.shape[3], keys.dtype, keys.device)
        if found != expected:
            wrong = [f"{name} {have} (model: {want})" for name, have, want in zip(_LAYOUT, found, expected)
                     if have != want]
            raise ValueError(f"KV cache was built for another model: {', '.join(wrong)}; build it with "
                             f"KVCache.for_model(model, batch_size)")

    @property
    def batch_size(self) -> int:
        return self.key_padding.shape[0]

    def check_room(self, new_tokens: int, batch_size: int) -> None:
        """Clear errors before any buffer is touched: wrong batch size or more tokens than the cache holds."""
        if batch_size != self.batch_size:
            raise ValueError(f"KV cache was built for batch size {self.batch_size}, got a batch of {batch_size}")
        if self.length + new_tokens > self.max_seq_len:
            raise ValueError(f"KV cache full: {self.length} cached + {new_tokens} new tokens > "
                             f"max_seq_len {self.max_seq_len}")

    def positions_for(self, attention_mask: torch.Tensor | None, new_tokens: int) -> torch.Tensor:
        """RoPE positions (B, T) of the new tokens; records their padding mask. Does not advance the length."""
        if attention_mask is None:
            steps = torch.arange(1, new_tokens + 1, device=self.next_position.device).expand(self.batch_size, -1)
        else:
            self.key_padding[:, self.length:self.length + new_tokens] = attention_mask
            steps = attention_mask.long().cumsum(-1)  # (B, T): 1-based count of real tokens so far in this call
        # Padding positions get the position of the next real token (clamped at 0): harmless, never attended.
        return (self.next_position[:, None] + steps - 1).clamp_min(0)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, T, d_k) of `layer` at the current length; return all keys/values so far."""
        end = self.length + k.shape[-2]
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, new_tokens: int, attention_mask: torch.Tensor | None) -> None:
        """Called by the model once per forward, after every layer stored its keys/values."""
        real = new_tokens if attention_mask is None else attention_mask.long().sum(-1)
        self.next_position += real
        self.length += new_tokens

    def reset(self) -> None:
        self.length = 0
        self.key_padding.fill_(True)
        self.next_position.zero_()
        self.has_padding = False


_LAYOUT = ("layers", "kv_heads", "head_dim", "dtype", "device")


def _layout(model) -> tuple:
    """What a cache for `model` (a TransformerLM) must match, in the order of _LAYOUT."""
    cfg, weight = model.config, model.token_embeddings.weight
    return cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, weight.dtype, weight.device
