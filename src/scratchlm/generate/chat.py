"""A conversation with a chat model: the messages so far, and each reply decoded as it is sampled.

`ChatSession` is what `scratchlm chat` runs (and what a notebook can use): `reply(text)` adds the user's message,
renders the whole conversation with the tokenizer's chat template (tokenizer/chat_template.py) ending with the
header of the assistant's turn, and decodes on the engine (engine.py, driven on the caller's thread as generate()
drives it) until the model ends its turn (one of the tokenizer's end-of-turn ids, or <|endoftext|>), a token
budget, or the context. The reply's text is yielded piece by piece as it becomes final and, once the reply has
ended, joins the conversation as the assistant's message; the next turn renders everything again (as a chat
server does: the template decides what earlier turns look like, e.g. Qwen3 drops their thinking).

Reply k samples with seed + k, so a conversation is reproducible from its seed and its user messages.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from scratchlm.errors import UserError
from scratchlm.generate.decoding import check_options, default_max_new_tokens
from scratchlm.generate.engine import Engine, Failed, Finished, Sampling, Sequence, Token
from scratchlm.tokenizer import Tokenizer


class ChatSession:
    def __init__(self, model, tokenizer: Tokenizer, *, system: str | None = None, max_new_tokens: int | None = None,
                 temperature: float = 0.8, top_p: float = 0.9, top_k: int | None = None, seed: int | None = None,
                 compile: bool = False) -> None:
        """A conversation with `model`, whose `tokenizer` must carry a chat template (UserError otherwise);
        `system` starts it with a system message. The sampling options are those of generate()."""
        if tokenizer.chat_template is None:
            raise UserError("this model's tokenizer has no chat template (a base model): fine-tune it into a chat "
                            "model with `scratchlm finetune`, or use `scratchlm generate`")
        check_options(max_new_tokens or 0, temperature, top_p, top_k)
        self.tokenizer = tokenizer
        self.system = [{"role": "system", "content": system}] if system else []
        self.messages: list[dict] = list(self.system)
        self.max_new_tokens, self.seed = max_new_tokens, seed
        self.sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, stop_ids=tokenizer.end_of_turn_ids)
        self.engine = Engine(model, tokenizer, eos_id=tokenizer.end_of_text_id, max_batch=1, max_queue=1,
                             compile=compile)
        self.replies = 0  # replies made: reply k samples with seed + k
        self.finish_reason: str | None = None  # of the last reply: "stop" (end of turn) or "length"

    def reset(self) -> None:
        """Start over: only the system message (if any) remains."""
        self.messages = list(self.system)

    def reply(self, text: str) -> Iterator[str]:
        """Yield the model's reply to the user's `text`, piece by piece; once it ends, both messages join the
        conversation (a reply abandoned midway leaves it unchanged). A UserError, before any decoding, when the
        conversation no longer fits the model's context (say /reset)."""
        messages = [*self.messages, {"role": "user", "content": text}]
        ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True)
        context = self.engine.model.config.context_length
        budget = self.max_new_tokens
        if budget is None:
            budget = default_max_new_tokens(len(ids), context)
        try:
            self.engine.check(ids, max(budget, 1))
        except ValueError:
            raise UserError(f"the conversation is {len(ids)} tokens, too long for the model's context of {context} "
                            f"with a reply of {max(budget, 1)}: /reset starts over") from None
        seed = None if self.seed is None else self.seed + self.replies
        pieces: collections.deque[str] = collections.deque()
        ended: list[str] = []

        def emit(event: object) -> None:
            if isinstance(event, Token | Finished):
                pieces.append(event.text)
            if isinstance(event, Finished):
                ended.append(event.reason)
            elif isinstance(event, Failed):
                raise RuntimeError(event.message)

        sequence = Sequence(ids, Sampling(max_tokens=budget, seed=seed, **self.sampling), emit)
        reply = []
        for _ in self.engine.decode([sequence]):
            while pieces:
                piece = pieces.popleft()
                reply.append(piece)
                if piece:
                    yield piece
        self.messages = [*messages, {"role": "assistant", "content": "".join(reply)}]
        self.replies += 1
        self.finish_reason = ended[0] if ended else None
