"""The server's limits: what one request may ask for and how much waiting the server accepts.

Each has a `scratchlm serve` flag (commands.py) and is documented in docs/serving.md; the defaults suit a small
model on one machine. A request over a limit gets an OpenAI error object: 413 for the body, 400 for a field, 429
with Retry-After for a full queue, 504 after the request timeout.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1_000_000  # a request body larger than this is refused (413) before it is parsed
    max_tokens: int = 2048  # the largest max_tokens a request may ask for (the context may allow fewer)
    max_batch: int = 16  # sequences decoded together; more wait in the queue
    max_queue: int = 64  # sequences waiting for a batch slot; past that, 429 with Retry-After
    max_choices: int = 16  # choices in one request: len(prompt list) x n
    max_logprobs: int = 20  # the largest `logprobs` (alternatives per token)
    request_timeout: float = 600.0  # seconds from arrival to the last token; then 504 (or a final error event)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_tokens", "max_batch", "max_queue", "max_choices", "max_logprobs"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"limit {name} must be a positive integer, got {value!r}")
        if not self.request_timeout > 0:
            raise ValueError(f"limit request_timeout must be a positive number of seconds, got {self.request_timeout}")
