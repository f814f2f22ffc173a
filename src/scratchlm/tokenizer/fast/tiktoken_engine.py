"""tiktoken as the encoder of ordinary text: our ids, from OpenAI's native (Rust) BPE, for huge corpora.

``TiktokenTokenizer`` is a ``Tokenizer`` whose ordinary text (the pieces between special tokens) is encoded by
``tiktoken.Encoding.encode_ordinary`` instead of ``CachedBPE``. Everything else stays ``Tokenizer``'s own:
special tokens are cut out by our regex, and ``encode_stream`` holds back the same tails. So
``scratchlm data encode --engine tiktoken`` runs the same pipeline with a native piece encoder, in every worker.

Where it wins: large, varied corpora, where ``CachedBPE`` learns every new word in Python (speeds:
docs/tokenizer-encoding.md). Where it does not: a small corpus (building the encoding and its checks takes a
while) and megabyte-long pre-tokens, which tiktoken merges with per-byte state for the whole piece while
``long_merge.py`` works in bounded memory. It needs ``pip install 'scratchlm[fast]'``.

Why the ids are ours. tiktoken has no merge list: ``mergeable_ranks`` maps a token's bytes to a rank, which is
also the id it outputs, and its BPE merges the adjacent pair whose *concatenated bytes* have the lowest rank
(leftmost on ties), emitting a pre-token that is itself a token without merging at all. Ours merges the adjacent
pair with the lowest *merge* rank. With ranks = our ids, the two give the same ids on every text when
(``mergeable_ranks`` checks all three, and refuses the tokenizer naming the first token that fails):

1. the ordinary (non-special) tokens hold distinct bytes, the 256 single bytes among them: tiktoken maps bytes
   to one id;
2. the merges make tokens of increasing ids, so that id order is merge order;
3. every multi-byte ordinary token is what our BPE makes of its own bytes.

Then our BPE never holds two adjacent tokens A, B whose bytes form a token T without (A, B) being T's merge: the
merges inside A and B's span are the ones BPE makes of T's bytes alone (each was the lowest-ranked pair of the
whole piece, so of the span too), which would end at [A, B], not [T], against 3. So at every step tiktoken's
mergeable pairs are exactly ours, ranked in the same order (2), and a pre-token that is a token T is T for both
(3). A byte-level BPE as trained (ours, GPT-2's) meets all three; a vocab with tokens added beside the merges,
or merges out of id order, does not. Condition 3 also makes the pipeline's ignore_merges change nothing (BPE of a
token's bytes is that token), and tiktoken emits such a pre-token whole anyway.

The pre-tokenization pattern is the tokenizer's (``pat_str``): tiktoken's regex engine (Rust's fancy-regex) reads
the named patterns as ``regex`` does (tests check each against our split); a custom pattern that it reads otherwise
is caught by ``data encode``'s check of the first megabyte. With the pipeline's NFC, the text is normalized here
before tiktoken sees it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from scratchlm.extras import require
from scratchlm.tokenizer.bpe import merge_table
from scratchlm.tokenizer.fast.batch_merge import BatchMerger
from scratchlm.tokenizer.pipeline import GPT2_PIPELINE, Pipeline
from scratchlm.tokenizer.tokenizer import Tokenizer

if TYPE_CHECKING:
    import tiktoken


class TiktokenTokenizer(Tokenizer):
    """A ``Tokenizer`` whose ordinary text is encoded by tiktoken: the same ids, or a ValueError at construction.

    ``options`` are ``Tokenizer``'s keywords (``fast``, ``cache_size``, ``added_token_flags``, the chat template:
    ``load``, ``from_files`` and unpickling pass them); ``fast`` and ``cache_size`` choose the piece encoder
    ``Tokenizer.__init__`` builds, which is then replaced by tiktoken's. ``encoding`` is the ``tiktoken.Encoding``,
    usable on its own (its special tokens are ours, with our ids).
    """

    def __init__(self, vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]],
                 special_tokens: list[str] | None = None, *, pipeline: Pipeline = GPT2_PIPELINE, **options) -> None:
        super().__init__(vocab, merges, special_tokens, pipeline=pipeline, **options)
        self.encoding = tiktoken_encoding(self)
        self._bpe = TiktokenBPE(self.encoding, pipeline)

    @classmethod
    def like(cls, tokenizer: Tokenizer) -> TiktokenTokenizer:
        """The tiktoken twin of ``tokenizer``: the same vocab, merges, special tokens (and their flags), pipeline
        (so the same hash) and chat template."""
        return cls(tokenizer.vocab, tokenizer.merges, tokenizer.special_tokens, pipeline=tokenizer.pipeline,
                   added_token_flags=tokenizer.added_token_flags, chat_template=tokenizer.chat_template,
                   end_of_turn_ids=tokenizer.end_of_turn_ids)


class TiktokenBPE:
    """``bpe.PieceEncoder`` through ``tiktoken.Encoding.encode_ordinary`` (the pattern's split and BPE, natively),
    after the pipeline's NFC."""

    def __init__(self, encoding: tiktoken.Encoding, pipeline: Pipeline = GPT2_PIPELINE) -> None:
        self._encode_ordinary = encoding.encode_ordinary
        self._normalize = pipeline.normalize

    def encode(self, text: str, out: list[int]) -> None:
        text = self._normalize(text)
        if not text.isascii():
            # A lone surrogate raises UnicodeEncodeError here, as in our encoders (Tokenizer names it);
            # tiktoken would quietly encode it as U+FFFD.
            text.encode("utf-8")
        out.extend(self._encode_ordinary(text))

    def encode_pretokens(self, pretokens: list[str], out: list[int]) -> None:
        # Each is encoded on its own: a GPT-2 pre-token, alone, is one pre-token (tested), so tiktoken's regex
        # leaves it whole, whereas joined ones could match differently. (Tokenizer hands over pre-tokens only
        # with GPT-2's pipeline.)
        for piece in pretokens:
            self.encode(piece, out)

    def clear(self) -> None:
        """Nothing to forget: tiktoken caches nothing."""


def tiktoken_encoding(tokenizer: Tokenizer) -> tiktoken.Encoding:
    """A ``tiktoken.Encoding`` that gives ``tokenizer``'s ids: ranks are our ids (checked, see the module
    docstring), the split pattern and the special tokens are ours. Needs the ``tiktoken`` package ([fast] extra)."""
    package = require("tiktoken", "fast", "the tiktoken engine (--engine tiktoken)")
    specials = {token: tokenizer.special_id(token) for token in tokenizer.special_tokens}
    return package.Encoding(name=f"scratchlm-{tokenizer.hash[:16]}", pat_str=tokenizer.pipeline.pattern,
                             mergeable_ranks=mergeable_ranks(tokenizer), special_tokens=specials)


def mergeable_ranks(tokenizer: Tokenizer) -> dict[bytes, int]:
    """{bytes: id} of the ordinary tokens, as tiktoken takes them; a ValueError when tiktoken's BPE would not
    give our ids with them (conditions 1-3 of the module docstring)."""
    special_ids = {tokenizer.special_id(token) for token in tokenizer.special_tokens}
    ranks: dict[bytes, int] = {}
    for token_id, data in sorted(tokenizer.vocab.items()):
        if token_id in special_ids:
            continue
        if data in ranks:
            raise _unsupported(f"ids {ranks[data]} and {token_id} are both {data!r}, and tiktoken maps bytes to "
                               "one id")
        ranks[data] = token_id
    missing = next((byte for byte in range(256) if bytes([byte]) not in ranks), None)
    if missing is not None:
        raise _unsupported(f"byte {bytes([missing])!r} is a special token only, and tiktoken needs it as text too")
    _check_merge_order(tokenizer.merges, ranks)
    _check_tokens_make_themselves(tokenizer.merges, ranks)
    return ranks


def _check_merge_order(merges: list[tuple[bytes, bytes]], ranks: dict[bytes, int]) -> None:
    """Condition 2: each merge makes an ordinary token with a larger id than the one before."""
    previous = -1
    for number, (left, right) in enumerate(merges):
        made = ranks.get(left + right)
        if made is None:
            raise _unsupported(f"merge #{number} ({left!r}, {right!r}) makes a special token")
        if made <= previous:
            raise _unsupported(f"merge #{number} ({left!r}, {right!r}) makes token {made}, but merge #{number - 1} "
                               f"made token {previous}: tiktoken ranks merges by id, so ids must follow merge order")
        previous = made


def _check_tokens_make_themselves(merges: list[tuple[bytes, bytes]], ranks: dict[bytes, int]) -> None:
    """Condition 3: our BPE of each multi-byte token's bytes is that token (all merged at once by
    ``batch_merge.py``)."""
    tokens = [data for data in ranks if len(data) > 1]
    if not tokens:
        return
    merger = BatchMerger(merge_table(merges, ranks), [ranks[bytes([byte])] for byte in range(256)])
    ids, counts = merger.merge(b"".join(tokens), np.array([len(data) for data in tokens]))
    # One id made of a token's bytes is that token: the bytes of ordinary tokens are distinct (condition 1).
    if (counts > 1).any():
        first = int(np.argmax(counts > 1))
        start = int(counts[:first].sum())
        data, made = tokens[first], ids[start:start + counts[first]].tolist()
        raise _unsupported(f"token {ranks[data]} {data!r} is not what the merges make of its bytes ({made}), and "
                           "tiktoken would emit it whole")


def _unsupported(reason: str) -> ValueError:
    return ValueError(f"the tiktoken engine cannot give this tokenizer's ids: {reason}; encode with the default "
                      "engine (--engine scratchlm)")
