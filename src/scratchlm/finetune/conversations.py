"""Reading fine-tuning data: JSON lines of conversations or prompt-completion pairs, each record checked.

The record formats Hugging Face TRL's SFTTrainer reads: ``{"messages": [...]}`` (the loss counts the assistant's
turns); ``{"prompt": [messages], "completion": [messages]}`` (the loss counts the completion's assistant turns
only); ``{"prompt": "...", "completion": "..."}`` (plain text, no template; the loss counts the completion).
Inputs are what ``data encode`` reads (files, folders, globs of ``.jsonl`` / ``.json``, optionally compressed). A
bad record is one line naming the file, the line and the field (``data.jsonl:7: messages[2].role: ...``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scratchlm.errors import UserError
from scratchlm.tokenizer.chat_template import check_messages

FORMATS = 'a "messages" list, or "prompt" and "completion" (both strings, or both lists of messages)'


@dataclass(frozen=True)
class Conversation:
    """A checked conversation: ``messages`` (role, content, ...) with at least one assistant turn at or after
    ``trained_from``, after a first message that is not the assistant's. The loss counts the assistant turns from
    ``messages[trained_from]`` on: all of them (0) for a messages record, the completion's for a prompt-completion
    one."""

    messages: tuple[dict, ...]
    where: str  # FILE:LINE, for messages about it
    trained_from: int = 0


@dataclass(frozen=True)
class Completion:
    """A checked prompt-completion pair of plain texts."""

    prompt: str
    completion: str
    where: str


Example = Conversation | Completion


def read_examples(inputs: Sequence[str]) -> list[Example]:
    """Every record of the inputs (files, folders, globs), checked, in order; the first bad record is a UserError
    (or a ValueError from the reader: malformed JSON, invalid UTF-8) naming its file and line."""
    from scratchlm.data.sources import expand_inputs, read_json_records

    examples = []
    for source in expand_inputs(list(inputs)):
        if source.format not in ("jsonl", "json"):
            raise UserError(f"{source.path}: fine-tuning reads JSON lines (.jsonl) of {FORMATS}, not a "
                            f"{source.format} file")
        examples += [checked_example(record, where) for where, record in read_json_records(source)]
    if not examples:
        raise UserError(f"{', '.join(map(str, inputs))}: no records: fine-tuning needs JSON lines of {FORMATS}")
    return examples


def checked_example(record: object, where: str) -> Example:
    """The example a parsed JSON record holds, or a UserError naming ``where`` and the field."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object with {FORMATS}, got {type(record).__name__}")
    if "messages" in record:
        if "prompt" in record or "completion" in record:
            raise UserError(f"{where}: has both messages and prompt/completion: give one format a record")
        messages = check_messages(record["messages"], where=f"{where}: messages")
        if "assistant" not in [message["role"] for message in messages]:
            raise UserError(f"{where}: messages: no assistant message, so nothing to learn from this record")
        _check_opening(messages, where, "messages")
        return Conversation(tuple(messages), where)
    if "prompt" in record or "completion" in record:
        for field in ("prompt", "completion"):
            if field not in record:
                raise UserError(f"{where}: {field}: missing (a prompt-completion record has both)")
        if isinstance(record["prompt"], list):
            return _conversational_completion(record["prompt"], record["completion"], where)
        for field in ("prompt", "completion"):
            if not isinstance(record[field], str):
                raise UserError(f"{where}: {field}: expected a string, got {type(record[field]).__name__} (or give "
                                f"prompt and completion both as lists of messages)")
        if not record["completion"]:
            raise UserError(f"{where}: completion: empty, so nothing to learn from this record")
        return Completion(record["prompt"], record["completion"], where)
    fields = ", ".join(map(repr, list(record)[:8])) or "none"
    raise UserError(f"{where}: expected {FORMATS} (fields: {fields})")


def _conversational_completion(prompt: list, completion: object, where: str) -> Conversation:
    """TRL's conversational prompt-completion record: the conversation prompt + completion, trained from the
    completion on, which ends with the assistant's answer."""
    if not isinstance(completion, list):
        raise UserError(f"{where}: completion: expected a list of messages, as the prompt is one, got "
                        f"{type(completion).__name__}")
    prompt = check_messages(prompt, where=f"{where}: prompt")
    completion = check_messages(completion, where=f"{where}: completion")
    last = len(completion) - 1
    if completion[last]["role"] != "assistant":
        raise UserError(f"{where}: completion[{last}].role: {completion[last]['role']!r}, but a completion ends with "
                        f"the assistant's message (the answer to learn)")
    _check_opening(prompt, where, "prompt")
    return Conversation(tuple(prompt + completion), where, trained_from=len(prompt))


def _check_opening(messages: list[dict], where: str, field: str) -> None:
    """A conversation opens with a system or user message, which the assistant answers."""
    if messages[0]["role"] == "assistant":
        raise UserError(f"{where}: {field}[0].role: the conversation starts with the assistant; the assistant answers "
                        f"a system or user message")
