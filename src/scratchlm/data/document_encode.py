"""Encode a stream of documents (any format ``sources.py`` reads) into a train and an optional validation token file.

Design:
- The parent reads documents in order and groups them into batches of about 1 MiB of text, each bound for one
  destination (train or validation); worker processes encode the batches (``Tokenizer.encode`` of each document,
  then the end-of-text id unless the text already ends with that token) and the parent writes the results in
  order. At most ``2 * workers`` batches are in flight, so memory stays bounded whatever the corpus size.
- The validation split takes whole documents, chosen by their index in the stream (deterministic, streaming,
  no shuffle): ``val_docs=N`` takes the first N; ``val_fraction=F`` takes document i when floor((i+1)·F) >
  floor(i·F), evenly spaced, floor(n·F) of n documents.
- ``encode.py``'s byte-range path is the special case of plain text files with no split; both give the same ids
  for the same text (tested).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scratchlm.data.encode_workers import in_worker, worker_pool
from scratchlm.data.sources import END_OF_TEXT, Source, read_documents
from scratchlm.data.token_file import TokenFileWriter
from scratchlm.progress import progress_bar
from scratchlm.tokenizer.tokenizer import Tokenizer

BATCH_CHARS = 1 << 20
IN_FLIGHT_PER_WORKER = 2


@dataclass(frozen=True)
class ValSplit:
    """Which documents go to the validation file: the first ``docs``, or an evenly spaced ``fraction``."""

    fraction: float | None = None
    docs: int | None = None

    def __post_init__(self) -> None:
        if self.fraction is not None and self.docs is not None:
            raise ValueError("give either a validation fraction or a number of validation documents, not both")
        if self.fraction is not None and not 0 < self.fraction < 1:
            raise ValueError(f"--val-fraction must be between 0 and 1 (exclusive), got {self.fraction}")
        if self.docs is not None and self.docs < 1:
            raise ValueError(f"--val-docs must be at least 1, got {self.docs}")

    def is_val(self, index: int) -> bool:
        if self.docs is not None:
            return index < self.docs
        if self.fraction is not None:
            return math.floor((index + 1) * self.fraction) > math.floor(index * self.fraction)
        return False

    def describe(self) -> str:
        return f"--val-docs {self.docs}" if self.docs is not None else f"--val-fraction {self.fraction}"


@dataclass(frozen=True)
class DocumentCounts:
    train_tokens: int
    val_tokens: int
    train_docs: int
    val_docs: int


def encode_documents(tokenizer: Tokenizer, sources: list[Source], out: Path, *, val_out: str | Path | None,
                     split: ValSplit, workers: int, errors: str, text_field: str, end_of_text: bool,
                     progress: bool) -> DocumentCounts:
    """Encode every document of ``sources`` into ``out`` (and ``val_out``, the documents ``split`` selects)."""
    eot_id = tokenizer.special_id(END_OF_TEXT) if end_of_text else None
    documents = (document for source in sources
                 for document in documents_of(source, tokenizer, text_field=text_field, errors=errors))
    batches = _batches(documents, split)
    with ExitStack() as stack:
        writers = {False: stack.enter_context(_writer(out, tokenizer))}
        if val_out is not None:
            writers[True] = stack.enter_context(_writer(val_out, tokenizer))
        counts = {False: 0, True: 0}
        for is_val, count, ids in _encoded(tokenizer, batches, workers, eot_id, progress):
            writers[is_val].write(ids)
            counts[is_val] += count
        if val_out is not None and not counts[True]:
            raise ValueError(f"{split.describe()} selects none of the {counts[False]} documents; "
                             "use --val-docs N, or a larger fraction")
        if not counts[False]:
            raise ValueError(f"no training documents left: the inputs hold {counts[True]} documents, all of them "
                             f"taken by {split.describe()}")
        train_tokens = writers[False].num_tokens
        val_tokens = writers[True].num_tokens if val_out is not None else 0
    return DocumentCounts(train_tokens, val_tokens, counts[False], counts[True])


def documents_of(source: Source, tokenizer: Tokenizer, *, text_field: str, errors: str) -> Iterator[str]:
    """The documents of one source as they are encoded: a text file is cut after each end-of-text token when the
    tokenizer has that token (the cut changes no id: a special token ends a piece anyway)."""
    separator = END_OF_TEXT if END_OF_TEXT in tokenizer.special_tokens else None
    return read_documents(source, text_field=text_field, errors=errors, end_of_text=separator)


def _writer(path: str | Path, tokenizer: Tokenizer) -> TokenFileWriter:
    return TokenFileWriter(path, vocab_size=tokenizer.vocab_size, tokenizer_hash=tokenizer.hash)


def _batches(documents: Iterable[str], split: ValSplit) -> Iterator[tuple[bool, list[str]]]:
    """(bound for validation?, documents) in stream order, each batch about BATCH_CHARS of text."""
    batch: list[str] = []
    batch_is_val = False
    chars = 0
    for index, document in enumerate(documents):
        is_val = split.is_val(index)
        if batch and (is_val != batch_is_val or chars >= BATCH_CHARS):
            yield batch_is_val, batch
            batch, chars = [], 0
        batch.append(document)
        batch_is_val = is_val
        chars += len(document)
    if batch:
        yield batch_is_val, batch


def _encoded(tokenizer: Tokenizer, batches: Iterator[tuple[bool, list[str]]], workers: int, eot_id: int | None,
             progress: bool) -> Iterator[tuple[bool, int, np.ndarray]]:
    """(is_val, documents, ids) per batch, in order; encoded in ``workers`` processes, a bounded number ahead."""
    bar = progress_bar(None, progress, unit=" docs", desc="encode")
    try:
        if workers == 1:
            for is_val, documents in batches:
                yield is_val, len(documents), encode_batch(tokenizer, documents, eot_id)
                bar.update(len(documents))
            return
        with worker_pool(tokenizer, workers) as pool:
            pending: deque = deque()
            for is_val, documents in batches:
                pending.append((is_val, len(documents), pool.submit(in_worker, encode_batch, documents, eot_id)))
                if len(pending) >= workers * IN_FLIGHT_PER_WORKER:
                    yield _finished(pending.popleft(), bar)
            while pending:
                yield _finished(pending.popleft(), bar)
    finally:
        bar.close()


def _finished(entry: tuple, bar) -> tuple[bool, int, np.ndarray]:
    is_val, count, future = entry
    ids = future.result()
    bar.update(count)
    return is_val, count, ids


def encode_batch(tokenizer: Tokenizer, documents: list[str], eot_id: int | None) -> np.ndarray:
    """The ids of the documents in order, each followed by ``eot_id`` unless its text already ends with that
    token (a text file's documents keep theirs); ``eot_id`` None adds nothing."""
    ids: list[int] = []
    for document in documents:
        ids.extend(tokenizer.encode(document))
        if eot_id is not None and not document.endswith(END_OF_TEXT):
            ids.append(eot_id)
    return np.asarray(ids, dtype=np.uint32)
