"""Token ids -> completion text as it is sampled: incremental UTF-8 decoding and stop strings.

A token can end in the middle of a multi-byte character, so an incremental decoder keeps the trailing bytes until
the character completes (and a leftover becomes U+FFFD at the end), exactly as `scratchlm generate` prints.
A stop string ends the completion before it; text that might be the start
of one is held back until it is clear that it is not, so a streamed completion never shows part of a stop string.
"""

from __future__ import annotations

import codecs

from scratchlm.tokenizer import Tokenizer


class TextStream:
    """Feed token ids with `add`; each call returns the text that is now final. `stopped` is set by a stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # everything decoded so far (the completion, plus a held-back tail)
        self.emitted = 0  # characters of `text` already returned
        self.stopped = False

    def add(self, token_id: int) -> str:
        return self._extend(self.decoder.decode(self.tokenizer.decode_bytes([token_id])), final=False)

    def finish(self) -> str:
        """The rest of the text once no more tokens come (a dangling partial character becomes U+FFFD)."""
        return "" if self.stopped else self._extend(self.decoder.decode(b"", final=True), final=True)

    def _extend(self, new: str, final: bool) -> str:
        self.text += new
        # A stop string may begin in already emitted text only where that text was held back, so the search starts
        # where any stop string ending in the new text could begin.
        search_from = max(0, self.emitted - max((len(s) for s in self.stop), default=0))
        found = [index for s in self.stop if (index := self.text.find(s, search_from)) >= 0]
        if found:
            end = min(found)
            self.stopped = True
        else:
            end = len(self.text) if final else len(self.text) - self._held_back()
        delta = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is the beginning of a stop string."""
        for length in range(min(len(self.text), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            tail = self.text[-length:]
            if any(s.startswith(tail) for s in self.stop):
                return length
        return 0
