"""Streaming, parallel pre-token counting of text files: the first phase of BPE training.

Training needs only how often each pre-token occurs. A file is cut into chunks of at most ``chunk_bytes``, each
read, decoded, split and counted on its own (in worker processes for large inputs), and the counters are summed.

A chunk boundary cannot change the counts: it is placed only where the pre-tokenization of the whole text is
already cut, found in the raw bytes of a small window. Such places are the start of a special token (the text is
split on them before the regex runs) and, for GPT-2's pattern, a ``\\n`` right after a printable non-space ASCII
byte (every pattern alternative that holds that byte excludes whitespace, and the one look-around, ``\\s+(?!\\S)``,
looks forward from a whitespace run). The other named patterns keep punctuation and the line ends after it
together (``"!\\n"``), so for them it is just after a ``\\n`` with a printable ASCII byte on each side. No special
token may straddle a boundary (checked), and every boundary is a UTF-8 character start. A custom pattern is cut
only at special tokens.

Invalid UTF-8 follows ``errors``: "strict" raises naming the file and byte offset, "replace" substitutes U+FFFD.
"""

from __future__ import annotations

import os
import re
from collections import Counter, namedtuple
from collections.abc import Iterable, Iterator

from scratchlm.progress import progress_bar
from scratchlm.tokenizer.pretokenize import (
    GPT2_SPLIT_PATTERN,
    has_known_boundaries,
    special_token_regex,
    split_on_special_tokens,
    split_pretokens,
)
from scratchlm.workers import default_workers

# typing's constant, spelled out: the counting path imports neither typing nor pathlib (a short run's start-up).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import multiprocessing.context

    import regex

ERROR_POLICIES = ("strict", "replace")
DEFAULT_CHUNK_BYTES = 8 * 2**20  # upper bound on what one worker holds at a time
PARALLEL_THRESHOLD_BYTES = 2**20  # below this, forking workers costs more than it saves
WINDOW_BYTES = 64 * 2**10  # how far a boundary search reads at a time
CHUNKS_PER_WORKER = 4  # more chunks than workers balance the load
PART_CHARS = 2**16  # text pre-tokenized by one findall call: bounds the list of pre-tokens it builds
SMALL_PART_CHARS = 2**10  # non-ASCII parts: 10% off counting the OWT sample, 35% off corpus.en


Chunk = namedtuple("Chunk", ["path", "start", "end"])
Chunk.__doc__ = """Bytes [start, end) of one file (path: str, start: int, end: int), cut at positions where the
pre-tokenization is already cut."""


def check_input_file(path: str | os.PathLike) -> str:
    """The path of a readable regular file, or a clear FileNotFoundError / PermissionError / ValueError."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"input file not found: {path}")
    if not os.path.isfile(path):
        raise ValueError(f"input is not a regular file: {path}")
    if not os.access(path, os.R_OK):
        raise PermissionError(f"input file is not readable: {path}")
    return path


def _boundary_regex(special_bytes: list[bytes], pattern: str) -> re.Pattern[bytes] | None:
    """Where a chunk may be cut for this split pattern (the module docstring says why); None: nowhere."""
    if pattern == GPT2_SPLIT_PATTERN:
        lines = [rb"(?<=[\x21-\x7e])(?=\n)"]
    elif has_known_boundaries(pattern):
        lines = [rb"(?<=[\x21-\x7e]\n)(?=[\x21-\x7e])"]
    else:
        lines = []
    candidates = lines + [b"(?=" + re.escape(token) + b")" for token in special_bytes]
    return re.compile(b"|".join(candidates)) if candidates else None


def straddled(window, position: int, special_tokens: list) -> bool:
    """Whether some special-token occurrence starts before `position` and ends after it (`window` and the tokens
    are both bytes, or both str)."""
    for token in special_tokens:
        found = window.find(token, max(0, position - len(token) + 1), position + len(token) - 1)
        if found != -1 and found < position:
            return True
    return False


def find_boundary(handle, target: int, file_size: int, special_bytes: list[bytes],
                  split_pattern: str = GPT2_SPLIT_PATTERN) -> int:
    """The first safe cut position at or after `target` (or `file_size` when there is none)."""
    pattern = _boundary_regex(special_bytes, split_pattern)
    if pattern is None:
        return file_size
    overlap = max([len(token) for token in special_bytes] + [2])  # 2: the line start's look-behind
    position = target
    while position < file_size:
        window_start = max(0, position - overlap)
        handle.seek(window_start)
        window = handle.read(position - window_start + WINDOW_BYTES + overlap)
        search_end = min(position - window_start + WINDOW_BYTES, len(window))
        for match in pattern.finditer(window, position - window_start, search_end):
            cut = match.start()
            if not straddled(window, cut, special_bytes):
                return window_start + cut
        position += WINDOW_BYTES
    return file_size


def plan_chunks(path: str | os.PathLike, special_tokens: list[str], chunk_bytes: int,
                pattern: str = GPT2_SPLIT_PATTERN) -> list[Chunk]:
    """Cut one file into chunks of about `chunk_bytes` at positions safe for the split pattern (reads only small
    windows)."""
    file_size = os.path.getsize(path)
    special_bytes = [token.encode("utf-8") for token in special_tokens]
    starts = [0]
    with open(path, "rb") as handle:
        while starts[-1] + chunk_bytes < file_size:
            cut = find_boundary(handle, starts[-1] + chunk_bytes, file_size, special_bytes, pattern)
            if cut >= file_size:
                break
            starts.append(cut)
    ends = starts[1:] + [file_size]
    return [Chunk(str(path), start, end) for start, end in zip(starts, ends) if end > start]


def decode_chunk(data: bytes, chunk: Chunk, errors: str) -> str:
    """UTF-8 text of a chunk; in strict mode an error names the file and the absolute byte offset."""
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as error:
        offset = chunk.start + error.start
        raise ValueError(
            f"{chunk.path}: invalid UTF-8 at byte offset {offset} (byte 0x{data[error.start]:02x}: {error.reason}); "
            f"use errors='replace' (CLI: --errors replace) to substitute U+FFFD"
        ) from None


def count_chunk(task: tuple[Chunk, list[str], str, str]) -> Counter[str]:
    """Pre-token counts of one chunk (the worker entry point; special tokens themselves are not counted)."""
    chunk, special_tokens, errors, pattern = task
    with open(chunk.path, "rb") as handle:
        handle.seek(chunk.start)
        data = handle.read(chunk.end - chunk.start)
    text = decode_chunk(data, chunk, errors)
    del data
    counts: Counter[str] = Counter()
    count_text(text, special_token_regex(special_tokens), counts, pattern)
    return counts


def count_text(text: str, special_regex: regex.Pattern | None, counts: Counter[str],
               pattern: str = GPT2_SPLIT_PATTERN) -> None:
    """Add the pre-tokens of `text` (split by `pattern`) to `counts`; special tokens (matched by `special_regex`) are
    cut out first and not counted."""
    for piece, is_special in split_on_special_tokens(text, special_regex):
        if is_special:
            continue
        if not has_known_boundaries(pattern):  # a custom pattern: no part boundary is known to be safe
            counts.update(split_pretokens(piece, pattern))
            continue
        for part in word_aligned_parts(piece):
            # A non-ASCII part goes in small pieces: its ASCII ones take split_pretokens' faster pattern.
            for small in (part,) if part.isascii() else word_aligned_parts(part, SMALL_PART_CHARS):
                counts.update(split_pretokens(small, pattern))


def word_aligned_parts(text: str, size: int = PART_CHARS) -> Iterator[str]:
    """`text` in parts of about `size` characters, each cut just before a space that follows a printable ASCII
    character. A GPT-2 pre-token always starts there (no pattern reaches back across it), so the pre-tokens of
    the parts are those of the whole text, while the list `findall` builds stays small (bounded memory)."""
    start = 0
    while len(text) - start > size:
        cut = text.find(" ", start + size)
        while cut != -1 and not "!" <= text[cut - 1] <= "~":
            cut = text.find(" ", cut + 1)
        if cut == -1:
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


def pool_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context counting workers start in."""
    import multiprocessing  # here, not at the top: small inputs are counted in-process and never need it

    # fork starts a worker in milliseconds with the modules already imported; spawn re-imports everything.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method)


def _counted_chunks(tasks: list, num_workers: int) -> Iterator[Counter[str]]:
    if num_workers <= 1 or len(tasks) <= 1:
        yield from map(count_chunk, tasks)
        return
    with pool_context().Pool(min(num_workers, len(tasks))) as pool:
        # imap keeps file order, so the first error raised is the one earliest in the input.
        yield from pool.imap(count_chunk, tasks)


def check_error_policy(errors: str) -> None:
    """Refuse a UTF-8 policy other than ERROR_POLICIES."""
    if errors not in ERROR_POLICIES:
        raise ValueError(f"errors must be one of {ERROR_POLICIES}, got {errors!r}")


def resolve_workers(num_workers: int | None) -> int:
    """`num_workers`, or the default (usable CPUs, at most 8) when None; fewer than 1 is an error."""
    workers = default_workers() if num_workers is None else num_workers
    if workers < 1:
        raise ValueError(f"num_workers must be at least 1, got {workers}")
    return workers


def count_pretokens(
    paths: Iterable[str | os.PathLike],
    special_tokens: list[str],
    *,
    num_workers: int | None = None,
    errors: str = "strict",
    progress: bool = False,
    chunk_bytes: int | None = None,
    parallel_threshold: int = PARALLEL_THRESHOLD_BYTES,
    pattern: str = GPT2_SPLIT_PATTERN,
) -> Counter[str]:
    """Counts of every pre-token (split by `pattern`, GPT-2's by default) in the files, special tokens cut out
    first.

    `num_workers` defaults to the usable CPUs; inputs smaller than `parallel_threshold` bytes are counted in
    this process. `chunk_bytes` (default: enough chunks to balance the workers, at most 8 MiB) bounds the
    text any one process holds.
    """
    check_error_policy(errors)
    workers = resolve_workers(num_workers)
    files = [check_input_file(path) for path in paths]
    total_bytes = sum(map(os.path.getsize, files))
    if total_bytes < parallel_threshold:
        workers = 1
    if chunk_bytes is None:
        balanced = -(-total_bytes // (workers * CHUNKS_PER_WORKER)) if workers > 1 else DEFAULT_CHUNK_BYTES
        chunk_bytes = max(WINDOW_BYTES, min(DEFAULT_CHUNK_BYTES, balanced))
    chunks = [chunk for path in files for chunk in plan_chunks(path, special_tokens, chunk_bytes, pattern)]
    tasks = [(chunk, special_tokens, errors, pattern) for chunk in chunks]
    totals: Counter[str] = Counter()
    bar = progress_bar(total_bytes, progress, unit="B", unit_scale=True, desc="counting pre-tokens")
    # The generator comes first in zip so that it runs to its end and closes the pool.
    for counts, chunk in zip(_counted_chunks(tasks, workers), chunks):
        totals.update(counts)
        bar.update(chunk.end - chunk.start)
    bar.close()
    return totals
