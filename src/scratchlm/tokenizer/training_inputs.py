"""What BPE training reads: pre-token counts of every input ``data/sources.py`` knows.

``count_input_pretokens`` expands the inputs (files, folders, globs, ``hf:`` datasets, as ``data encode`` takes
them) and counts each source the fastest way that gives the same counts: plain text files by ``counting.py``'s
byte ranges; everything else as a stream of documents read by ``sources.py``, each counted on its own (so no
pre-token spans two documents, as an ``<|endoftext|>`` between them ensures in a text file). A compressed text file
is one text, re-cut by ``safe_parts`` where the pre-tokenization is already cut.

The stream goes in batches of about ``BATCH_CHARS`` characters: the first is counted in this process, and only when
a second follows do worker processes take over, at most ``IN_FLIGHT_PER_WORKER`` batches each ahead of the reader.
Inputs that are all plain text files skip importing ``sources.py`` (its readers slow a short run's start-up), so
``NOT_PLAIN_TEXT_SUFFIXES`` repeats which names it parses; a test keeps the two in step.
"""

from __future__ import annotations

import os
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from itertools import chain, islice

from scratchlm.progress import progress_bar
from scratchlm.tokenizer.counting import (
    check_error_policy,
    count_pretokens,
    count_text,
    pool_context,
    resolve_workers,
    straddled,
)
from scratchlm.tokenizer.pretokenize import GPT2_SPLIT_PATTERN, has_known_boundaries, special_token_regex

# typing's constant, spelled out, as in counting.py
TYPE_CHECKING = False
if TYPE_CHECKING:
    from scratchlm.data.sources import Source

BATCH_CHARS = 2**20  # about a second of counting: enough batches to keep the workers busy
IN_FLIGHT_PER_WORKER = 2
NOT_PLAIN_TEXT_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".gz", ".zst")  # what sources.py parses


def count_input_pretokens(
    inputs: Iterable[str | os.PathLike],
    special_tokens: list[str],
    *,
    num_workers: int | None = None,
    errors: str = "strict",
    text_field: str = "text",
    progress: bool = False,
    pattern: str = GPT2_SPLIT_PATTERN,
) -> Counter[str]:
    """Counts of every pre-token (split by `pattern`, GPT-2's by default) in the inputs, special tokens cut out
    first.

    `text_field` is the JSON field or the parquet / dataset column that holds the text; `errors` the invalid UTF-8
    policy ("strict" or "replace"); `num_workers` defaults to the usable CPUs (at most 8).
    """
    check_error_policy(errors)
    workers = resolve_workers(num_workers)
    inputs = list(inputs)
    plain = plain_text_files(inputs)  # the common case, counted without importing sources.py
    streamed: list[Source] = []
    if plain is None:
        from scratchlm.data.sources import expand_inputs

        sources = expand_inputs(inputs)
        plain = [source.path for source in sources if source.is_plain_text]
        streamed = [source for source in sources if not source.is_plain_text]
    counts: Counter[str] = Counter()
    if plain:
        counts = count_pretokens(plain, special_tokens, num_workers=workers, errors=errors, progress=progress,
                                 pattern=pattern)
    if streamed:
        counts.update(count_document_pretokens(streamed, special_tokens, num_workers=workers, errors=errors,
                                               text_field=text_field, progress=progress, pattern=pattern))
    return counts


def plain_text_files(inputs: list[str | os.PathLike]) -> list[str] | None:
    """The inputs, when each names an existing file that ``sources.py`` reads as plain text; else None."""
    paths = [os.fspath(spec) for spec in inputs]
    plain = all(os.path.isfile(path) and not path.startswith("hf:")
                and not os.path.basename(path).lower().endswith(NOT_PLAIN_TEXT_SUFFIXES) for path in paths)
    return paths if paths and plain else None


def count_document_pretokens(sources: list[Source], special_tokens: list[str], *, num_workers: int, errors: str,
                             text_field: str, progress: bool, pattern: str = GPT2_SPLIT_PATTERN) -> Counter[str]:
    """Pre-token counts of the sources' documents, each document counted on its own."""
    documents = (document for source in sources
                 for document in _documents(source, special_tokens, errors=errors, text_field=text_field,
                                            pattern=pattern))
    totals: Counter[str] = Counter()
    bar = progress_bar(None, progress, unit="char", unit_scale=True, desc="counting pre-tokens")
    for chars, counts in _counted_batches(_batches(documents), special_tokens, num_workers, pattern):
        totals.update(counts)
        bar.update(chars)
    bar.close()
    return totals


def _documents(source: Source, special_tokens: list[str], *, errors: str, text_field: str,
               pattern: str) -> Iterator[str]:
    """The source's documents; for a text file, its text in safe parts (its end-of-text tokens stay text or
    special tokens, as on the byte-range path)."""
    from scratchlm.data.sources import read_documents, read_text_blocks

    if source.format == "text":
        blocks = read_text_blocks(source, errors=errors)
        return safe_parts(blocks, special_tokens) if has_known_boundaries(pattern) else iter(["".join(blocks)])
    return read_documents(source, text_field=text_field, errors=errors)


def safe_parts(blocks: Iterable[str], special_tokens: list[str]) -> Iterator[str]:
    """The text of `blocks` (one text, read block by block) cut into parts whose pre-token counts add up to those
    of the whole text.

    A part ends just before a space that follows a printable ASCII character, where a pre-token of every named
    pattern always starts (``counting.word_aligned_parts`` says why), and inside no special-token occurrence, so
    the special-token split is unchanged too. Positions closer to the end of the text read so far than the longest
    special token are not cut yet: an occurrence across them may still be arriving. Text without such a space (a
    line of DNA) stays one part, as a file without a safe cut is one chunk on the byte-range path.
    """
    reach = max(map(len, special_tokens), default=1)  # a cut at i needs the text up to i + reach
    pending = ""
    searched = 1  # positions in pending[1:searched] were refused: no space after ASCII, or inside a special
    for block in blocks:
        pending += block
        limit = len(pending) - reach + 1
        cut = _last_safe_cut(pending, searched, limit, special_tokens)
        if cut:
            yield pending[:cut]
            pending = pending[cut:]
            searched = max(1, limit - cut)  # past the cut, the positions up to limit were refused
        else:
            searched = max(searched, limit)
    if pending:
        yield pending


def _last_safe_cut(text: str, start: int, end: int, special_tokens: list[str]) -> int:
    """The last position in [start, end) (start >= 1) just before a space that follows a printable ASCII
    character and inside no special token, or 0 when there is none."""
    cut = text.rfind(" ", start, end)
    while cut != -1 and (not "!" <= text[cut - 1] <= "~" or straddled(text, cut, special_tokens)):
        cut = text.rfind(" ", start, cut)
    return max(cut, 0)


def _batches(documents: Iterable[str]) -> Iterator[list[str]]:
    """The documents in order, in lists of about BATCH_CHARS characters."""
    batch: list[str] = []
    chars = 0
    for document in documents:
        batch.append(document)
        chars += len(document)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def count_documents(documents: list[str], special_tokens: list[str],
                    pattern: str = GPT2_SPLIT_PATTERN) -> Counter[str]:
    """Pre-token counts of a batch of documents, each counted on its own (the worker entry point)."""
    special_regex = special_token_regex(special_tokens)
    counts: Counter[str] = Counter()
    for document in documents:
        count_text(document, special_regex, counts, pattern)
    return counts


def _counted_batches(batches: Iterator[list[str]], special_tokens: list[str],
                     workers: int, pattern: str) -> Iterator[tuple[int, Counter[str]]]:
    """(characters, counts) of each batch, in order: in this process while there is only one batch, else in
    `workers` processes, a bounded number of batches ahead of the reader."""
    head = list(islice(batches, 2))
    if workers == 1 or len(head) < 2:
        for batch in chain(head, batches):
            yield sum(map(len, batch)), count_documents(batch, special_tokens, pattern)
        return
    from concurrent.futures import ProcessPoolExecutor  # here: a small input never needs it

    with ProcessPoolExecutor(workers, mp_context=pool_context()) as pool:
        pending: deque = deque()
        try:
            for batch in chain(head, batches):
                pending.append((sum(map(len, batch)), pool.submit(count_documents, batch, special_tokens, pattern)))
                if len(pending) >= workers * IN_FLIGHT_PER_WORKER:
                    chars, future = pending.popleft()
                    yield chars, future.result()
            for chars, future in pending:
                yield chars, future.result()
        except BaseException:  # a bad record, or the caller stopped: drop the queued batches, then re-raise
            pool.shutdown(wait=True, cancel_futures=True)
            raise
