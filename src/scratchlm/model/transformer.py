"""The Transformer language model: feed-forward layers, the block, and TransformerLM.

`TransformerLM(config)` is built entirely from a `ModelConfig`: its ablation switches (norm kind and position,
RoPE or none, FFN kind, tied embeddings, QK-norm, zero-initialised residual projections, logit soft-capping) and
those of pretrained checkpoints (grouped-query attention, head_dim, q/k/v biases, llama3 RoPE scaling) select
modules, never forks of the code. Parameter names follow the CS336 reference (`token_embeddings`,
`layers.{i}.attn.{q,k,v,output}_proj`, `ln1`, `ln2`, `ffn.w1/w2/w3`, `ln_final`, `lm_head`).

The model knows nothing of devices, compile, autocast or DDP. The trainer sets two plain attributes,
`check_inputs` (the token-id range check syncs on GPU; off when the data was validated at load) and
`checkpoint_blocks` (activation checkpointing per block), and switches in faster implementations of the same
math with `model.kernels.apply(model, device)`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from scratchlm.model.attention import MultiHeadSelfAttention
from scratchlm.model.config import ModelConfig
from scratchlm.model.kv_cache import KVCache
from scratchlm.model.layers import Embedding, Linear, check_index_dtype, make_norm, relu_squared, silu


class SwiGLU(nn.Module):
    """W2 (SiLU(W1 x) ⊙ W3 x): the Llama FFN. `inputs` are the projections of x that `hidden` combines, in its
    order (a fused decoding step multiplies by them as one); model/kernels/ may swap in a fused `hidden` with the
    same contract."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None) -> None:
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    @property
    def inputs(self) -> tuple[Linear, ...]:
        return self.w1, self.w3

    @staticmethod
    def hidden(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return silu(gate) * up  # (..., d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.hidden(self.w1(x), self.w3(x)))  # (..., d_model) -> (..., d_ff) -> (..., d_model)


class _UngatedFFN(nn.Module):
    """W2 hidden(W1 x), an ungated FFN; each subclass names its activation `hidden`. d_ff = 4·d_model gives it
    the parameters of SwiGLU at 8/3·d."""

    hidden: staticmethod

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None) -> None:
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)

    @property
    def inputs(self) -> tuple[Linear, ...]:
        return (self.w1,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.hidden(self.w1(x)))  # (..., d_model) -> (..., d_ff) -> (..., d_model)


class SiLUFFN(_UngatedFFN):
    """W2 SiLU(W1 x): the ungated FFN ablation."""

    hidden = staticmethod(silu)


class ReLU2FFN(_UngatedFFN):
    """W2 ReLU(W1 x)²: the squared-ReLU FFN of Primer (So et al., 2021) and the modded-nanogpt speedrun; its
    sparse, sharper activations train faster per FLOP than SwiGLU at these small scales."""

    hidden = staticmethod(relu_squared)


FFN_CLASSES = {"swiglu": SwiGLU, "silu": SiLUFFN, "relu2": ReLU2FFN}


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap · tanh(logits / cap): smoothly bounds every logit to (-cap, cap), no runaway confidence (Gemma 2).
    cap None or 0: the logits as they are."""
    return cap * torch.tanh(logits / cap) if cap else logits


class TransformerBlock(nn.Module):
    """Pre-norm: x + attn(ln1(x)), then + ffn(ln2(·)). Post-norm: ln1(x + attn(x)), then ln2(· + ffn(·)). Shaped
    by `config` (a ModelConfig): norm, norm_position, norm_eps, ffn, d_ff, and the attention's fields."""

    def __init__(self, config: ModelConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.pre_norm = config.norm_position == "pre"
        self.ln1 = make_norm(config.norm, config.d_model, config.norm_eps, device=device, dtype=dtype)
        self.attn = MultiHeadSelfAttention(config, device=device, dtype=dtype)
        self.ln2 = make_norm(config.norm, config.d_model, config.norm_eps, device=device, dtype=dtype)
        self.ffn = FFN_CLASSES[config.ffn](config.d_model, config.d_ff, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                layer_index: int = 0, key_padding: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, d_model) -> (B, T, d_model)."""
        if self.pre_norm:
            x = x + self.attn(self.ln1(x), token_positions, kv_cache, layer_index, key_padding, documents)
            return x + self.ffn(self.ln2(x))
        x = self.ln1(x + self.attn(x, token_positions, kv_cache, layer_index, key_padding, documents))
        return self.ln2(x + self.ffn(x))


def positions_in_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) positions that restart at 0 where a document starts: [7, 7, 7, 9, 9] -> [0, 1, 2, 0, 1]."""
    index = torch.arange(document_ids.shape[-1], device=document_ids.device).expand_as(document_ids)  # (B, T)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    return index - torch.where(starts, index, 0).cummax(dim=-1).values  # minus where each one's document starts


class TransformerLM(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, vocab_size)."""

    def __init__(self, config: ModelConfig, device=None, dtype=None) -> None:
        super().__init__()
        if config.vocab_size is None:  # a training config may leave it to the tokenizer; a model cannot
            raise ValueError("model.vocab_size is not set: give it, or let `scratchlm train` take the tokenizer's")
        self.config = config
        self.token_embeddings = Embedding(config.vocab_size, config.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(TransformerBlock(config, device, dtype) for _ in range(config.num_layers))
        self.ln_final = make_norm(config.norm, config.d_model, config.norm_eps, device=device, dtype=dtype)
        self.lm_head = Linear(config.d_model, config.vocab_size, device=device, dtype=dtype)
        if config.tie_embeddings:
            # One matrix for both ends, with the lm_head's init (σ = √(2/(d+V))): with the embedding's σ = 1
            # the initial logits would have std ≈ √d_model and the first losses would be far above ln V.
            self.token_embeddings.weight = self.lm_head.weight
        if config.zero_init_residual:
            # Every block then starts as the identity (its residual branches add 0), and the first updates
            # grow the branches from there (modded-nanogpt); the other projections keep their random init, so
            # the gradients reaching these zero matrices are not zero.
            for layer in self.layers:
                nn.init.zeros_(layer.attn.output_proj.weight)
                nn.init.zeros_(layer.ffn.w2.weight)
        self.check_inputs = True
        self.checkpoint_blocks = False

    def forward(self, in_indices: torch.Tensor, *, token_positions: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, attention_mask: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """in_indices (B, T) int; token_positions (T,) or (B, T); attention_mask (B, T) bool, True = real token;
        document_ids (B, T) int, the document each position belongs to when several are packed into a row.

        With `attention_mask` (left padding) and no explicit positions, each row's real tokens get positions
        0, 1, 2, ...; padding is never attended. With `kv_cache`, the new tokens continue the cached ones.
        With `document_ids` (training on packed sequences, no cache) a token attends only to its own document's
        tokens and, without explicit positions, each document's tokens get positions 0, 1, 2, ...: every
        document's logits are those of the document alone.
        `last_only=True` returns only the last position's logits (B, 1, V): all that sampling after a prefill
        needs; for a small model with a large vocabulary, the output projection over every prompt position
        (2·d_model·V FLOPs each) is a large share of a prefill.
        """
        self._validate(in_indices, token_positions, attention_mask, kv_cache, document_ids)
        key_padding = attention_mask
        if kv_cache is not None:
            kv_cache.check_room(in_indices.shape[1], in_indices.shape[0])
            kv_cache.has_padding |= attention_mask is not None
            if kv_cache.has_padding:  # each row counts its real tokens (without padding RoPE starts at the length)
                positions = kv_cache.positions_for(attention_mask, in_indices.shape[1])  # records the padding
                if token_positions is None:
                    token_positions = positions
            key_padding = kv_cache.key_padding if kv_cache.has_padding else None
        elif attention_mask is not None and token_positions is None:
            token_positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)  # (B, T)
        if document_ids is not None and token_positions is None:
            token_positions = positions_in_documents(document_ids)

        x = self.token_embeddings(in_indices)  # (B, T, d_model)
        for index, layer in enumerate(self.layers):
            if self.checkpoint_blocks and self.training and torch.is_grad_enabled() and kv_cache is None:
                x = checkpoint(layer, x, token_positions, None, index, key_padding, document_ids,
                               use_reentrant=False)
            else:
                x = layer(x, token_positions, kv_cache, index, key_padding, document_ids)
        if kv_cache is not None:
            kv_cache.advance(in_indices.shape[1], attention_mask)
        if last_only:
            x = x[:, -1:]
        return softcap(self.lm_head(self.ln_final(x)), self.config.logit_softcap)  # (B, T, V); T = 1: last_only

    def _validate(self, in_indices, token_positions, attention_mask, kv_cache, document_ids) -> None:
        """Shape, dtype and KV-cache checks always (O(1), no sync); value ranges only when `check_inputs` (they
        sync on GPU)."""
        cfg = self.config
        if in_indices.dim() != 2:
            raise ValueError(f"in_indices must be a (batch, seq) integer tensor, got shape {tuple(in_indices.shape)}")
        check_index_dtype("in_indices", in_indices)
        batch, seq = in_indices.shape
        if kv_cache is not None:
            kv_cache.check_model(self)
        past = kv_cache.length if kv_cache is not None else 0
        if past + seq > cfg.context_length:
            raise ValueError(f"sequence length {past + seq} (cached {past} + new {seq}) exceeds context_length "
                             f"{cfg.context_length}")
        if attention_mask is not None and (attention_mask.shape != in_indices.shape
                                           or attention_mask.dtype != torch.bool):
            raise ValueError(f"attention_mask must be a bool tensor shaped like in_indices "
                             f"{tuple(in_indices.shape)}, got {tuple(attention_mask.shape)} {attention_mask.dtype}")
        if document_ids is not None:
            if kv_cache is not None or tuple(document_ids.shape) != (batch, seq):
                raise ValueError(f"document_ids must be shaped like in_indices ({batch}, {seq}) and come without a "
                                 f"kv_cache, got {tuple(document_ids.shape)}")
            check_index_dtype("document_ids", document_ids)
        if token_positions is not None:
            check_index_dtype("token_positions", token_positions)
            shape = tuple(token_positions.shape)
            if shape not in ((seq,), (1, seq), (batch, seq)):
                raise ValueError(f"token_positions must be shaped (seq,), (1, seq) or (batch, seq) = ({batch}, {seq}), "
                                 f"got {shape}")
        if not self.check_inputs:
            return
        if in_indices.numel() and (in_indices.min() < 0 or in_indices.max() >= cfg.vocab_size):
            bad = in_indices[(in_indices < 0) | (in_indices >= cfg.vocab_size)][0].item()
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {cfg.vocab_size})")
        if token_positions is not None and token_positions.numel() and (
                token_positions.min() < 0 or token_positions.max() >= cfg.context_length):
            raise ValueError(f"token_positions must lie in [0, {cfg.context_length}), got values in "
                             f"[{token_positions.min().item()}, {token_positions.max().item()}]")

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameter count (a tied matrix counted once); non_embedding=True: `ModelConfig.non_embedding_params`."""
        total = sum(p.numel() for p in self.parameters())
        return self.config.non_embedding_params(total) if non_embedding else total
