"""The Stanford CS336 assignment-1 adapter surface, implemented by scratchlm.

Point the assignment's `tests/adapters.py` at these functions (same names and parameters) to run its official
tests against scratchlm. Every function is a thin call into the real implementation: build the module, load the
given weights by their state-dict names, run it. No logic lives here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import IO, Any, BinaryIO

import numpy as np
import torch
from torch import nn

from scratchlm.data.batches import get_batch
from scratchlm.model.attention import MultiHeadSelfAttention, RotaryPositionalEmbedding, scaled_dot_product_attention
from scratchlm.model.config import ModelConfig
from scratchlm.model.layers import Embedding, Linear, RMSNorm, silu, softmax
from scratchlm.model.transformer import SwiGLU, TransformerBlock, TransformerLM
from scratchlm.optim.adamw import AdamW
from scratchlm.optim.clip import clip_gradients
from scratchlm.optim.schedule import lr_cosine_schedule
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.tokenizer.train_bpe import train_bpe
from scratchlm.train.checkpoint import load_checkpoint, save_checkpoint
from scratchlm.train.loss import cross_entropy

Tensor = torch.Tensor


def _with_weights(module: nn.Module, weights: dict[str, Tensor]) -> nn.Module:
    """Load `weights` (strict: every name must match) and return the module, for one-line adapters."""
    module.load_state_dict(weights)
    return module


def run_linear(d_in: int, d_out: int, weights: Tensor, in_features: Tensor) -> Tensor:
    return _with_weights(Linear(d_in, d_out), {"weight": weights})(in_features)


def run_embedding(vocab_size: int, d_model: int, weights: Tensor, token_ids: Tensor) -> Tensor:
    return _with_weights(Embedding(vocab_size, d_model), {"weight": weights})(token_ids)


def run_swiglu(d_model: int, d_ff: int, w1_weight: Tensor, w2_weight: Tensor, w3_weight: Tensor,
               in_features: Tensor) -> Tensor:
    weights = {"w1.weight": w1_weight, "w2.weight": w2_weight, "w3.weight": w3_weight}
    return _with_weights(SwiGLU(d_model, d_ff), weights)(in_features)


def run_scaled_dot_product_attention(Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None = None) -> Tensor:
    return scaled_dot_product_attention(Q, K, V, mask)


def _attention_weights(q: Tensor, k: Tensor, v: Tensor, o: Tensor) -> dict[str, Tensor]:
    return {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v, "output_proj.weight": o}


def run_multihead_self_attention(d_model: int, num_heads: int, q_proj_weight: Tensor, k_proj_weight: Tensor,
                                 v_proj_weight: Tensor, o_proj_weight: Tensor, in_features: Tensor) -> Tensor:
    config = ModelConfig(d_model=d_model, num_heads=num_heads, context_length=in_features.shape[-2], position="nope")
    attention = MultiHeadSelfAttention(config)
    weights = _attention_weights(q_proj_weight, k_proj_weight, v_proj_weight, o_proj_weight)
    return _with_weights(attention, weights)(in_features)


def run_multihead_self_attention_with_rope(d_model: int, num_heads: int, max_seq_len: int, theta: float,
                                           q_proj_weight: Tensor, k_proj_weight: Tensor, v_proj_weight: Tensor,
                                           o_proj_weight: Tensor, in_features: Tensor,
                                           token_positions: Tensor | None = None) -> Tensor:
    config = ModelConfig(d_model=d_model, num_heads=num_heads, context_length=max_seq_len, rope_theta=theta)
    attention = MultiHeadSelfAttention(config)
    weights = _attention_weights(q_proj_weight, k_proj_weight, v_proj_weight, o_proj_weight)
    return _with_weights(attention, weights)(in_features, token_positions)


def run_rope(d_k: int, theta: float, max_seq_len: int, in_query_or_key: Tensor, token_positions: Tensor) -> Tensor:
    return RotaryPositionalEmbedding(theta, d_k, max_seq_len)(in_query_or_key, token_positions)


def run_transformer_block(d_model: int, num_heads: int, d_ff: int, max_seq_len: int, theta: float,
                          weights: dict[str, Tensor], in_features: Tensor) -> Tensor:
    config = ModelConfig(d_model=d_model, num_heads=num_heads, d_ff=d_ff, context_length=max_seq_len, rope_theta=theta)
    block = TransformerBlock(config)
    return _with_weights(block, weights)(in_features)


def run_transformer_lm(vocab_size: int, context_length: int, d_model: int, num_layers: int, num_heads: int,
                       d_ff: int, rope_theta: float, weights: dict[str, Tensor], in_indices: Tensor) -> Tensor:
    config = ModelConfig(vocab_size=vocab_size, context_length=context_length, d_model=d_model,
                         num_layers=num_layers, num_heads=num_heads, d_ff=d_ff, rope_theta=rope_theta)
    return _with_weights(TransformerLM(config), weights)(in_indices)


def run_rmsnorm(d_model: int, eps: float, weights: Tensor, in_features: Tensor) -> Tensor:
    return _with_weights(RMSNorm(d_model, eps=eps), {"weight": weights})(in_features)


def run_silu(in_features: Tensor) -> Tensor:
    return silu(in_features)


def run_softmax(in_features: Tensor, dim: int) -> Tensor:
    return softmax(in_features, dim=dim)


def run_get_batch(dataset: np.ndarray, batch_size: int, context_length: int, device: str) -> tuple[Tensor, Tensor]:
    return get_batch(dataset, batch_size, context_length, device)


def run_cross_entropy(inputs: Tensor, targets: Tensor) -> Tensor:
    return cross_entropy(inputs, targets)


def run_gradient_clipping(parameters: Iterable[nn.Parameter], max_l2_norm: float) -> None:
    clip_gradients(parameters, max_l2_norm)


def get_adamw_cls() -> type[torch.optim.Optimizer]:
    return AdamW


def run_get_lr_cosine_schedule(it: int, max_learning_rate: float, min_learning_rate: float, warmup_iters: int,
                               cosine_cycle_iters: int) -> float:
    return lr_cosine_schedule(it, max_learning_rate, min_learning_rate, warmup_iters, cosine_cycle_iters)


def run_save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, iteration: int,
                        out: str | os.PathLike | BinaryIO | IO[bytes]) -> None:
    save_checkpoint(model, optimizer, iteration, out)


def run_load_checkpoint(src: str | os.PathLike | BinaryIO | IO[bytes], model: nn.Module,
                        optimizer: torch.optim.Optimizer) -> int:
    return load_checkpoint(src, model, optimizer)


def get_tokenizer(vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]],
                  special_tokens: list[str] | None = None) -> Tokenizer:
    return Tokenizer(vocab, merges, special_tokens)


def run_train_bpe(input_path: str | os.PathLike, vocab_size: int, special_tokens: list[str],
                  **kwargs: Any) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    return train_bpe(input_path, vocab_size, special_tokens, **kwargs)
