"""What a fine-tuning run trains on: conversations read and checked, rendered with the run's tokenizer, in rows.

``ConversationData`` is the trainer's data when data.format = conversations (train/resolve.py calls it; the
trainer knows nothing of conversations). ``read`` checks every record before anything is written; ``prepare``
gives a tokenizer without a chat template ChatML (and the starting weights rows for its tokens),
renders every example, cut to model.context_length + 1 tokens, and lays them out in rows (data.packing);
``sampler`` draws the training batches, ``validation_batches`` the held-out rows in order.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from scratchlm.config import RunConfig
from scratchlm.data.batches import MaskedBatch
from scratchlm.errors import UserError
from scratchlm.finetune.conversations import Conversation, Example, read_examples
from scratchlm.finetune.packing import Rows, RowSampler, build_rows, row_batches
from scratchlm.finetune.rendering import Rendered, render_example
from scratchlm.model.config import ModelConfig

if TYPE_CHECKING:
    from scratchlm.init_source import InitSource
    from scratchlm.tokenizer.tokenizer import Tokenizer

ROW_MATRICES = ("token_embeddings.weight", "lm_head.weight")  # (vocab_size, d_model) each; one tensor when tied


@dataclass
class ConversationData:
    """A fine-tuning run's examples, then (after ``prepare``) their rows."""

    train: list[Example]
    val: list[Example]
    quiet: bool = False
    train_rows: Rows | None = field(default=None, repr=False)
    val_rows: Rows | None = field(default=None, repr=False)

    @classmethod
    def read(cls, config: RunConfig, *, quiet: bool = False) -> ConversationData:
        """The checked records of data.train_path and data.val_path (or of a held-out data.val_fraction)."""
        data = config.data
        if not data.train_path:
            raise UserError("data.train_path is not set: give the conversations to fine-tune on (--data FILE.jsonl)")
        train = read_examples([data.train_path])
        if data.val_path:
            return cls(train, read_examples([data.val_path]), quiet)
        held_out = round(len(train) * data.val_fraction)  # 0 for a few records: no validation
        if held_out >= len(train):
            raise UserError(f"data.val_fraction {data.val_fraction} of {len(train)} records holds out {held_out}: "
                            f"leave at least one record on each side")
        order = np.random.default_rng([config.train.seed, 1]).permutation(len(train))
        val = set(order[:held_out].tolist())
        return cls([e for i, e in enumerate(train) if i not in val], [e for i, e in enumerate(train) if i in val],
                   quiet)

    def prepare(self, config: RunConfig, tokenizer: Tokenizer | None,
                source: InitSource | None) -> tuple[RunConfig, Tokenizer]:
        """(config, tokenizer) the run trains with: ChatML added where needed (module docstring), every example
        rendered and laid out in rows."""
        if tokenizer is None:
            where = source.where if source is not None else "this run"
            raise UserError(f"fine-tuning renders text, so it needs the model's tokenizer, and {where} records none: "
                            f"start from a run or folder that has one")
        if tokenizer.chat_template is None and any(isinstance(e, Conversation) for e in self.train + self.val):
            config, tokenizer = _with_chatml(config, tokenizer, source)
        if config.model.vocab_size < tokenizer.vocab_size:
            raise UserError(f"the model's vocabulary ({config.model.vocab_size}) does not hold the "
                            f"{tokenizer.vocab_size} ids of its tokenizer")
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, tokenizer_hash=tokenizer.hash))
        self.train_rows = self._rows(self.train, config, tokenizer, "training")
        self.val_rows = self._rows(self.val, config, tokenizer, "validation") if self.val else None
        return config, tokenizer

    def _rows(self, examples: list[Example], config: RunConfig, tokenizer: Tokenizer, what: str) -> Rows:
        row_length = config.model.context_length + 1
        rendered = [render_example(e, tokenizer, train_on_prompt=config.data.train_on_prompt) for e in examples]
        cut = [r for r in rendered if len(r) > row_length]
        kept = [Rendered(r.ids[:row_length], r.counted[:row_length], r.where) for r in rendered]  # (views)
        kept = [r for r in kept if r.counted[1:].any()]
        if not kept:
            raise UserError(f"none of the {len(rendered)} {what} records has a token to learn within the model's "
                            f"context of {config.model.context_length} tokens")
        if (cut or len(kept) < len(rendered)) and not self.quiet:
            print(f"scratchlm finetune: {len(cut)} of {len(rendered)} {what} records are longer than the context "
                  f"({row_length} tokens) and were cut; {len(rendered) - len(kept)} left nothing to learn and were "
                  f"left out", file=sys.stderr, flush=True)
        pad_id = tokenizer.end_of_turn_ids[0] if tokenizer.end_of_turn_ids else 0  # never a counted target
        return build_rows(kept, row_length, config.data.packing, pad_id)

    def plan_tokens(self) -> np.ndarray:
        """The training rows' tokens as one array: what a time budget's probe steps train on."""
        return self.train_rows.tokens.reshape(-1)

    def sampler(self, config: RunConfig, device: torch.device, rank: int, world_size: int) -> RowSampler:
        return RowSampler(self.train_rows, config.micro_batch_size, device, seed=config.train.seed, rank=rank,
                          world_size=world_size)

    @property
    def has_validation(self) -> bool:
        return self.val_rows is not None

    def validation_batches(self, config: RunConfig, device: torch.device,
                           max_batches: int | None) -> Iterator[MaskedBatch]:
        return row_batches(self.val_rows, config.micro_batch_size, device, max_batches)


def _with_chatml(config: RunConfig, tokenizer: Tokenizer,
                 source: InitSource | None) -> tuple[RunConfig, Tokenizer]:
    """The tokenizer with ChatML (``<|im_start|>ROLE\\n ... <|im_end|>\\n``: two special tokens after the vocabulary,
    and the template), and the config (and the source's weights) with rows for its new tokens."""
    grown = tokenizer.with_chatml()
    new_ids = [grown.special_id(token) for token in grown.special_tokens if token not in tokenizer.special_tokens]
    if source is None:
        raise UserError("the run's tokenizer has no chat template, and no init_from weights to give ChatML's tokens "
                        "rows: start the fine-tuning from a model (--init-from)")
    model = grow_vocabulary(config.model, source.weights, tokenizer.vocab_size, new_ids)
    return dataclasses.replace(config, model=model), grown


def grow_vocabulary(model: ModelConfig, weights: dict[str, torch.Tensor], old_size: int,
                    new_ids: list[int]) -> ModelConfig:
    """Give ``weights`` (a state dict, changed in place) rows for ``new_ids``, each the mean of the rows of ids
    below ``old_size`` (the tokens the model knows); returns the model config with the vocabulary that holds them.

    A new row starts as the mean rather than at random: its embedding is then a typical input and its logit a
    typical score (Hewitt, "Initializing new word embeddings for pretrained language models", 2021). A vocabulary
    padded past the tokenizer's (model.pad_vocab_to) may hold the new ids already: the matrices grow only when
    they must."""
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
