"""Byte-level BPE encoding as the algorithm states it: the readable path, and the rule every fast path must equal.

A pre-token (one match of the tokenizer's split pattern, GPT-2's by default, see ``pretokenize.py``) becomes its
UTF-8 bytes, one token each; then the adjacent pair with the lowest merge rank is merged, the leftmost one if it
occurs more than once, until no adjacent pair has a merge. That is GPT-2's rule, and the one tiktoken's educational
module (``_educational.py``) and minbpe show. ``ReadableBPE`` applies it to each pre-token of a text, with no cache
and no other trick, after the two steps a tokenizer's ``pipeline.Pipeline`` may add: the text is put in NFC first,
and with ``ignore_merges`` a pre-token whose bytes are one token is that token, unmerged (as Llama 3's tokenizer,
and tiktoken always, do).

It costs O(n) per merge, O(n^2) per pre-token of n bytes, and runs a Python loop per pair: fine for a sentence,
far too slow for a corpus (and a megabyte-long line of letters, one pre-token, would never finish). The
``Tokenizer`` therefore uses ``tokenizer/fast/`` unless it is built with ``fast=False``; tests check both give the
same ids on random and adversarial text (and that the readable path gives tiktoken's GPT-2 ids).
"""

from __future__ import annotations

from typing import Protocol

from scratchlm.tokenizer.pipeline import GPT2_PIPELINE, Pipeline
from scratchlm.tokenizer.pretokenize import pretokens

# (left id, right id) -> (rank, merged id): the merge table both encoders read.
MergeTable = dict[tuple[int, int], tuple[int, int]]


class PieceEncoder(Protocol):
    """What ``Tokenizer`` asks of an encoder of ordinary text (special tokens already cut out)."""

    def encode(self, text: str, out: list[int]) -> None:
        """Append the ids of text to out."""

    def encode_pretokens(self, pretokens: list[str], out: list[int]) -> None:
        """Append the ids of each given pre-token to out (they are not pre-tokenized again)."""

    def clear(self) -> None:
        """Forget any cached work (the ids stay the same)."""


def merge_table(merges: list[tuple[bytes, bytes]], bytes_to_id: dict[bytes, int]) -> MergeTable:
    """(left id, right id) -> (rank, merged id); the first occurrence of a pair keeps its rank."""
    lookup = bytes_to_id.get
    lefts = list(map(lookup, [left for left, _ in merges]))
    rights = list(map(lookup, [right for _, right in merges]))
    results = list(map(lookup, [left + right for left, right in merges]))
    if None in lefts or None in rights or None in results:
        rank = next(r for r, ids in enumerate(zip(lefts, rights, results)) if None in ids)
        left, right = merges[rank]
        missing = next(t for t in (left, right, left + right) if t not in bytes_to_id)
        raise ValueError(f"merge #{rank} ({left!r}, {right!r}) uses or makes {missing!r}, which is not in the vocab")
    # Built from the last merge to the first, so a repeated pair ends up with its first (lowest) rank.
    pairs = zip(lefts[::-1], rights[::-1])
    return dict(zip(pairs, zip(range(len(merges) - 1, -1, -1), results[::-1])))


def bpe_merge(ids: list[int], table: MergeTable) -> list[int]:
    """The BPE of one pre-token given as its byte ids: merge the lowest-ranked adjacent pair (leftmost on ties)
    until no adjacent pair has a merge."""
    ids = list(ids)
    while len(ids) > 1:
        ranked = [(table[pair][0], index) for index, pair in enumerate(zip(ids, ids[1:])) if pair in table]
        if not ranked:
            break
        _, index = min(ranked)  # the lowest rank; among its occurrences, the leftmost
        ids[index:index + 2] = [table[ids[index], ids[index + 1]][1]]
    return ids


class ReadableBPE:
    """``PieceEncoder`` by the rule alone: normalize and pre-tokenize as the pipeline says, then ``bpe_merge`` each
    pre-token (or, with ignore_merges, look it up whole in ``tokens``: bytes -> id of the ordinary tokens)."""

    def __init__(self, table: MergeTable, byte_ids: list[int], pipeline: Pipeline = GPT2_PIPELINE,
                 tokens: dict[bytes, int] | None = None) -> None:
        self._table = table
        self._byte_ids = byte_ids  # the id of each of the 256 single bytes
        self._pipeline = pipeline
        self._whole_tokens = (tokens or {}) if pipeline.ignore_merges else {}

    def encode(self, text: str, out: list[int]) -> None:
        self.encode_pretokens(pretokens(self._pipeline.normalize(text), self._pipeline.pattern), out)

    def encode_pretokens(self, pretokens: list[str], out: list[int]) -> None:
        for piece in pretokens:
            data = piece.encode("utf-8")
            if data in self._whole_tokens:  # ignore_merges: a pre-token that is a token is emitted whole
                out.append(self._whole_tokens[data])
            else:
                out.extend(bpe_merge([self._byte_ids[byte] for byte in data], self._table))

    def clear(self) -> None:
        """Nothing to forget: this encoder caches nothing."""
