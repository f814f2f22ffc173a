"""An example -> its token ids and which of them the loss counts (the assistant's tokens, end-of-turn included).

A conversation is rendered whole with the tokenizer's chat template and encoded once. Which ids are the
assistant's is derived from the template itself, not from knowledge of any one format: the turn of assistant
message ``i`` (from ``trained_from`` on) starts after the ids of ``messages[:i]`` rendered with the generation
prompt (``<|im_start|>assistant\\n`` in ChatML), which must be a prefix of the conversation's ids, and ends at the
first end-of-turn id after that (``<|im_end|>``, ``<|eot_id|>``), which counts too: the model learns to end its
turn. Without end-of-turn ids it ends where ``messages[:i + 1]`` rendered alone ends. A template that renders
earlier turns differently once more follow cannot be split this way, and the record is refused rather than
trained on a guessed mask.

A prompt-completion pair is plain text: prompt, completion, end-of-text, and the loss counts the completion and
the end. ``train_on_prompt`` counts every token instead (as pretraining does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from scratchlm.errors import UserError
from scratchlm.finetune.conversations import Completion, Conversation, Example
from scratchlm.tokenizer.formats.hf import EOS_TOKEN as END_OF_TEXT

if TYPE_CHECKING:
    from scratchlm.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True)
class Rendered:
    """An example's ``ids`` (L,) and ``counted`` (L,): True where the token is one the loss counts as a target."""

    ids: np.ndarray  # int64
    counted: np.ndarray  # bool
    where: str

    def __len__(self) -> int:
        return len(self.ids)


def render_example(example: Example, tokenizer: Tokenizer, *, train_on_prompt: bool = False) -> Rendered:
    """The ids of ``example`` and the mask of the tokens its loss counts (module docstring)."""
    if isinstance(example, Completion):
        ids, counted = _completion(example, tokenizer)
    else:
        ids, counted = _conversation(example, tokenizer)
    ids_array = np.asarray(ids, dtype=np.int64)
    counted_array = np.ones(len(ids), dtype=bool) if train_on_prompt else np.asarray(counted, dtype=bool)
    return Rendered(ids_array, counted_array, example.where)


def _completion(example: Completion, tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    prompt, completion = tokenizer.encode(example.prompt), tokenizer.encode(example.completion)
    return prompt + completion + [completion_end_id(tokenizer)], [False] * len(prompt) + [True] * (len(completion) + 1)


def completion_end_id(tokenizer: Tokenizer) -> int:
    """What ends a completion: ``<|endoftext|>``, else the first end-of-turn id."""
    if tokenizer.end_of_text_id is not None:
        return tokenizer.end_of_text_id
    if tokenizer.end_of_turn_ids:
        return tokenizer.end_of_turn_ids[0]
    raise UserError(f"a prompt-completion record needs an end-of-text token to end the completion, and this "
                    f"tokenizer has neither {END_OF_TEXT} nor end-of-turn tokens")


def _conversation(example: Conversation, tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    messages = list(example.messages)
    ids = tokenizer.encode_chat(messages)
    counted = [False] * len(ids)
    ends = set(tokenizer.end_of_turn_ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or index < example.trained_from:
            continue
        start = _prefix_length(ids, tokenizer.encode_chat(messages[:index], add_generation_prompt=True), example,
                               f"messages[:{index}] with the generation prompt")
        if ends:
            end = next((i + 1 for i in range(start, len(ids)) if ids[i] in ends), None)
            if end is None:
                raise UserError(f"{example.where}: messages[{index}]: the chat template ends this assistant turn "
                                f"with none of the end-of-turn tokens {sorted(ends)}")
        else:
            end = _prefix_length(ids, tokenizer.encode_chat(messages[:index + 1]), example, f"messages[:{index + 1}]")
        counted[start:end] = [True] * (end - start)
    return ids, counted


def _prefix_length(ids: list[int], prefix: list[int], example: Conversation, what: str) -> int:
    """len(prefix), once it is a prefix of ids; else the record is refused (the mask cannot be derived)."""
    if ids[:len(prefix)] != prefix:
        raise UserError(f"{example.where}: the chat template renders {what} as something the whole conversation "
                        f"does not start with, so the assistant's tokens cannot be told from the prompt's")
    return len(prefix)
