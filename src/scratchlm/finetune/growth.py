"""A base model that has no chat template learns ChatML: two new special tokens, and the rows they need.

ChatML marks each turn ``<|im_start|>ROLE\\n ... <|im_end|>\\n``; ``Tokenizer.with_chatml`` adds ``<|im_start|>`` and
``<|im_end|>`` as special tokens after the vocabulary (the end of a turn is ``<|im_end|>``) and the template.
The model then needs an embedding row and an output row for each new id: the token embedding matrix and the
head (one matrix when tied) grow to the new vocabulary size, and each new row starts as the mean of the rows of
the tokens the model was trained on, rather than at random: its embedding is then a typical input and its logit
a typical score (Hewitt, "Initializing new word embeddings for pretrained language models", 2021). A model whose
vocabulary was padded (model.pad_vocab_to) may hold the new ids already: their rows are set the same way, and the
matrices grow only when they must.
"""

from __future__ import annotations

import dataclasses

import torch

from scratchlm.model.config import ModelConfig

ROW_MATRICES = ("token_embeddings.weight", "lm_head.weight")  # (vocab_size, d_model) each; one tensor when tied


def grow_vocabulary(model: ModelConfig, weights: dict[str, torch.Tensor], old_size: int,
                    new_ids: list[int]) -> ModelConfig:
    """Give ``weights`` (a state dict, changed in place) rows for ``new_ids``, each the mean of the rows of ids
    below ``old_size`` (the tokens the model knows); returns the model config with the vocabulary that holds them."""
    needed = max(new_ids, default=-1) + 1
    grown = dataclasses.replace(model, vocab_size=max(model.vocab_size, needed))  # rounded up to pad_vocab_to
    done: dict[int, torch.Tensor] = {}  # tied matrices: grow the one tensor once
    for name in ROW_MATRICES:
        matrix = weights[name]
        if id(matrix) not in done:
            done[id(matrix)] = _with_mean_rows(matrix, grown.vocab_size, old_size, new_ids)
        weights[name] = done[id(matrix)]
    return grown


def _with_mean_rows(matrix: torch.Tensor, size: int, old_size: int, new_ids: list[int]) -> torch.Tensor:
    """``matrix`` (V, d) with ``size`` rows, the ``new_ids`` rows (and any other added ones) the mean of its first
    ``old_size`` rows, computed in float64."""
    mean = matrix[:old_size].double().mean(dim=0).to(matrix.dtype)  # (d,)
    grown = torch.cat([matrix, mean.expand(size - matrix.shape[0], -1)]) if size > matrix.shape[0] else matrix.clone()
    grown[new_ids] = mean
    return grown
