"""Conversation files for the demonstration: ``scratchlm data conversations --from hh-rlhf|tinystories``.

- **HH-RLHF** (Anthropic's helpful/harmless dialogues, MIT): each line's ``chosen`` field is one dialogue whose
  turns start with ``\\n\\nHuman: `` and ``\\n\\nAssistant: ``. It becomes ``{"messages": [...]}`` with the roles
  user and assistant, each turn's text stripped; a dialogue that ends on a human turn loses that turn (nothing
  answers it), and one with an empty turn or no assistant turn is left out.
- **TinyStories** (stories separated by ``<|endoftext|>``): a 17M model trained for minutes cannot hold a general
  conversation, but it can learn to tell a story on request. Each story becomes a user's request built from the
  story itself (its characters, the names after "named", or a few of its words) and the real story as the
  assistant's answer: ``Tell me a story about Tom and Max.`` -> the story with Tom and Max.

Both are deterministic: the same input and ``seed`` give the same file. ``limit`` keeps the first N conversations.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

_TURN = re.compile(r"\n\n(Human|Assistant): ")
_ROLES = {"Human": "user", "Assistant": "assistant"}
_NAMED = re.compile(r"\bnamed ([A-Z][a-z]+)")
_WORD = re.compile(r"\b[a-z]{4,}\b")  # words a request may name, but for the too common ones below
_COMMON = frozenset(("that", "with", "they", "were", "there", "said", "what", "this", "then", "when", "have",
                     "from", "your", "very", "went", "like", "could", "would", "will", "them", "their", "time",
                     "upon", "once", "saw", "day", "wanted", "didn't", "it's", "into", "back", "about", "just",
                     "because", "after", "looked", "felt", "played", "made", "came", "some", "other", "much",
                     "more", "every", "also", "thought", "asked", "things", "thing", "something", "always",
                     "named", "began", "where", "even", "again", "over", "loved", "knew", "found", "gave", "took"))
_CHARACTER_REQUESTS = ("Tell me a story about {names}.", "Can you write a story with {names}?",
                       "Please tell me a short story where {names} are the main characters.",
                       "I want a bedtime story about {names}.")
_ONE_CHARACTER_REQUESTS = ("Tell me a story about {names}.", "Can you write a story about someone named {names}?",
                           "Please tell me a short story with {names} in it.", "I want a bedtime story about {names}.")
_WORD_REQUESTS = ("Write a short story that uses the words {words}.", "Tell me a story with the words {words}.",
                  "Can you tell me a story about {words}?", "Make up a children's story that includes {words}.")


def hh_rlhf_conversations(path: str | Path) -> Iterator[dict]:
    """The ``chosen`` dialogues of an HH-RLHF file (``.jsonl`` or ``.jsonl.gz``) as ``{"messages": [...]}``."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                dialogue = json.loads(line)["chosen"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}:{number}: expected a JSON object with a \"chosen\" dialogue "
                                 f"(HH-RLHF's format)") from None
            messages = dialogue_messages(dialogue)
            if messages is not None:
                yield {"messages": messages}


def dialogue_messages(dialogue: str) -> list[dict] | None:
    """``\\n\\nHuman: ...\\n\\nAssistant: ...`` -> messages; None when it holds no usable exchange."""
    parts = _TURN.split(dialogue)  # ['', 'Human', text, 'Assistant', text, ...]
    if parts[0].strip():
        return None
    messages = [{"role": _ROLES[speaker], "content": text.strip()} for speaker, text in zip(parts[1::2], parts[2::2])]
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    roles = [m["role"] for m in messages]
    alternating = all(role == ("user", "assistant")[i % 2] for i, role in enumerate(roles))
    if not messages or not alternating or not all(m["content"] for m in messages):
        return None
    return messages


def tinystories_conversations(path: str | Path, seed: int = 0) -> Iterator[dict]:
    """The stories of a TinyStories text file as requests and stories (module docstring)."""
    from scratchlm.data.sources import END_OF_TEXT, read_documents, source_of

    rng = random.Random(seed)
    for document in read_documents(source_of(path)):
        story = document.replace(END_OF_TEXT, "").strip()
        if story:
            yield {"messages": [{"role": "user", "content": story_request(story, rng)},
                                {"role": "assistant", "content": story}]}


def story_request(story: str, rng: random.Random) -> str:
    """A user's request that ``story`` answers: about its named characters, or with a few of its words."""
    names = list(dict.fromkeys(_NAMED.findall(story)))
    if names and rng.random() < 0.6:
        names = names[:2]
        requests = _CHARACTER_REQUESTS if len(names) > 1 else _ONE_CHARACTER_REQUESTS
        return rng.choice(requests).format(names=_joined(names))
    words = [w for w in dict.fromkeys(_WORD.findall(story)) if w not in _COMMON]
    if not words:
        return "Tell me a story."
    chosen = rng.sample(words, min(len(words), rng.randint(1, 3)))
    return rng.choice(_WORD_REQUESTS).format(words=_joined([f'"{w}"' for w in chosen]))


def _joined(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
