"""Encode corpora into a token file (and a validation file), in parallel processes and constant memory.

``encode_corpus`` takes any inputs ``sources.py`` reads. Plain text files with no validation split take the
byte-range path below; everything else goes document by document through ``document_encode.py``. Each file or
document ends with one end-of-text token (unless its text already ends with it, or ``end_of_text=False``), so
no two run together.

Byte-range path: each file is cut into byte ranges at *safe* points: right after a ``"\n"`` between printable
ASCII bytes, or between the two newlines of ``X"\n\n"Y`` (a paragraph break, unless a special token starts at
Y: "\n\n" would then be one pre-token), and where no special token spans the cut. There GPT-2 pre-tokenization
of the whole text equals that of the two halves, so the parallel result is identical to ``Tokenizer.encode`` of
each whole file. Workers stream their range through an incremental UTF-8 decoder into
``Tokenizer.encode_stream`` and write part files, which the parent appends in order through ``TokenFileWriter``:
the output appears, complete, only at the end. Invalid UTF-8 stops the encode naming file and byte offset
(``errors="strict"``) or becomes U+FFFD exactly as ``bytes.decode(errors="replace")`` of the whole file would.

``engine="tiktoken"`` encodes with the tokenizer's tiktoken twin (``tokenizer/fast/tiktoken_engine.py``: the same
ids from native code, faster on large varied corpora), built only for a tokenizer whose ids it provably
reproduces and used only once it has given the tokenizer's ids on the inputs' first megabyte; a difference stops
the encode before any output is written, naming where.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, closing
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from scratchlm.data.document_encode import ValSplit, documents_of, encode_documents
from scratchlm.data.encode_workers import in_worker, worker_pool
from scratchlm.data.sources import END_OF_TEXT, HF_PREFIX, Source, decode_utf8, expand_inputs, read_text_blocks
from scratchlm.data.token_file import TokenFileWriter, open_token_file
from scratchlm.progress import progress_bar
from scratchlm.tokenizer.counting import check_error_policy
from scratchlm.tokenizer.pretokenize import GPT2_SPLIT_PATTERN, has_known_boundaries
from scratchlm.tokenizer.tokenizer import Tokenizer

READ_BLOCK = 1 << 20
MIN_CHUNK_BYTES = 1 << 18  # smaller ranges are not worth a task
CHUNKS_PER_WORKER = 4  # ranges of about the unplanned bytes / (workers * 4)
ENGINES = ("scratchlm", "tiktoken")
SAMPLE_CHARS = 1 << 20  # the tiktoken engine is checked against the tokenizer on the inputs' first megabyte
_SAFE_NEIGHBOURS = frozenset(range(0x21, 0x7F))  # printable ASCII, never whitespace
_CUT_SEARCH_WINDOW = 1 << 16


@dataclass(frozen=True)
class EncodeStats:
    input_bytes: int
    num_tokens: int
    seconds: float
    workers: int
    val_tokens: int = 0
    documents: int | None = None  # counted on the document path only
    val_documents: int = 0

    @property
    def bytes_per_token(self) -> float:
        tokens = self.num_tokens + self.val_tokens
        return self.input_bytes / tokens if tokens else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.input_bytes / 1e6 / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        size = f"{self.input_bytes / 1e6:,.1f} MB" if self.input_bytes else "a dataset"
        speed = f"{self.mb_per_s:.1f} MB/s, " if self.input_bytes else ""
        docs = f" from {self.documents:,} documents" if self.documents is not None else ""
        val = (f", validation {self.val_tokens:,} tokens from {self.val_documents:,} documents"
               if self.val_documents else "")
        return (f"{size} -> {self.num_tokens:,} tokens{docs}{val} "
                f"({self.bytes_per_token:.2f} bytes/token) in {self.seconds:.1f} s "
                f"({speed}{self.workers} worker{'s' if self.workers != 1 else ''})")


@dataclass(frozen=True)
class _Task:
    path: Path
    start: int
    end: int
    part: Path
    errors: str


def encode_corpus(tokenizer: Tokenizer | str | Path, inputs: list[str | Path], out: str | Path, *,
                  workers: int = 2, errors: str = "strict", progress: bool = False, text_field: str = "text",
                  end_of_text: bool = True, val_out: str | Path | None = None, val_fraction: float | None = None,
                  val_docs: int | None = None, engine: str = "scratchlm") -> EncodeStats:
    """Encode the inputs (files, folders, globs, ``hf:`` datasets), in order, into the token file ``out``; with
    ``val_fraction`` or ``val_docs``, whole documents go to ``val_out`` instead. ``engine`` is one of ENGINES
    (see the module docstring). Returns sizes and speed."""
    started = time.perf_counter()
    check_error_policy(errors)
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    split = ValSplit(val_fraction, val_docs)
    if (val_out is None) != (val_fraction is None and val_docs is None):
        raise ValueError("a validation file needs --val-fraction or --val-docs, and they need a validation file")
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.load(tokenizer)
    sources = expand_inputs(inputs)  # a missing input is named before anything about the tokenizer
    if end_of_text and END_OF_TEXT not in tokenizer.special_tokens:
        raise ValueError(f"the tokenizer has no {END_OF_TEXT} special token to end documents with (its special "
                         f"tokens: {tokenizer.special_tokens}); train one with --special-token '{END_OF_TEXT}', or "
                         "pass --no-eot")
    if engine == "tiktoken":
        tokenizer = _tiktoken_engine(tokenizer, sources, errors=errors, text_field=text_field)
    out = Path(out)
    total_bytes = sum(Path(source.path).stat().st_size for source in sources if source.format != "hf")
    _remove_orphaned_parts(out.parent, out.name)
    if val_out is None and all(source.is_plain_text for source in sources):
        num_tokens, used = _encode_text_files([Path(source.path) for source in sources], tokenizer, out,
                                              workers=workers, errors=errors, progress=progress,
                                              end_of_text=end_of_text, total_bytes=total_bytes)
        return EncodeStats(total_bytes, num_tokens, time.perf_counter() - started, used)
    counts = encode_documents(tokenizer, sources, out, val_out=val_out, split=split, workers=workers, errors=errors,
                              text_field=text_field, end_of_text=end_of_text, progress=progress)
    return EncodeStats(total_bytes, counts.train_tokens, time.perf_counter() - started, workers,
                       val_tokens=counts.val_tokens, documents=counts.train_docs, val_documents=counts.val_docs)


def _encode_text_files(paths: list[Path], tokenizer: Tokenizer, out: Path, *, workers: int, errors: str,
                       progress: bool, end_of_text: bool, total_bytes: int) -> tuple[int, int]:
    """The byte-range path: (tokens written, workers used)."""
    ranges = _plan_ranges(paths, tokenizer, workers)
    ended = _files_needing_end_of_text(paths, ranges, end_of_text)
    eot_ids = [tokenizer.special_id(END_OF_TEXT)] if end_of_text else []
    with TokenFileWriter(out, vocab_size=tokenizer.vocab_size, tokenizer_hash=tokenizer.hash) as writer:
        # The pid in the name tells a later run whether the encode that made this folder is still alive.
        parts_dir = Path(tempfile.mkdtemp(prefix=f".{out.name}.parts.{os.getpid()}.", dir=out.parent))
        try:
            tasks = [_Task(path, start, end, parts_dir / f"{index:06d}.tok", errors)
                     for index, (path, start, end) in enumerate(ranges)]
            for index, task in enumerate(_run_tasks(tokenizer, tasks, workers, progress, total_bytes)):
                _append_part(writer, task.part)
                if index in ended:
                    writer.write(eot_ids)
        finally:
            shutil.rmtree(parts_dir, ignore_errors=True)
    return writer.num_tokens, min(workers, len(tasks))


def _files_needing_end_of_text(paths: list[Path], ranges: list[tuple[Path, int, int]], end_of_text: bool) -> set[int]:
    """Indices of each file's last range, for the non-empty files whose text does not end with the token."""
    if not end_of_text:
        return set()
    marker = END_OF_TEXT.encode("utf-8")
    last_range = {path: index for index, (path, _, _) in enumerate(ranges)}
    return {last_range[path] for path in paths if not _ends_with(path, marker)}


def _ends_with(path: Path, marker: bytes) -> bool:
    size = path.stat().st_size
    if size == 0:
        return True  # an empty file is no document
    with open(path, "rb") as handle:
        handle.seek(max(size - len(marker), 0))
        return handle.read() == marker


def _remove_orphaned_parts(folder: Path, name: str) -> None:
    """Delete what earlier encodes into `name` left when killed by SIGKILL (which runs no clean-up): the part
    folder ``.NAME.parts.PID.*`` and the unfinished output ``.NAME.PID.*.partial``, when process PID is gone."""
    for leftover in [*folder.glob(f".{name}.parts.*"), *folder.glob(f".{name}.*.partial")]:
        pid = leftover.name.removeprefix(f".{name}.").removeprefix("parts.").split(".")[0]
        if pid.isdigit() and not _is_alive(int(pid)):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    return True


def _run_tasks(tokenizer: Tokenizer, tasks: list[_Task], workers: int, progress: bool,
               total_bytes: int) -> Iterator[_Task]:
    """Encode every task's range into its part file; yield the tasks in order as their parts are ready."""
    with closing(progress_bar(total_bytes, progress, unit="B", unit_scale=True, desc="encode")) as bar, \
            ExitStack() as stack:
        if workers == 1 or len(tasks) == 1:
            done = (_encode_range(tokenizer, task) for task in tasks)
        else:
            pool = stack.enter_context(worker_pool(tokenizer, min(workers, len(tasks))))
            done = pool.map(partial(in_worker, _encode_range), tasks)
        for task in done:
            bar.update(task.end - task.start)
            yield task


def _encode_range(tokenizer: Tokenizer, task: _Task) -> _Task:
    """Encode a task's byte range into its part file; returns the task."""
    text = decode_utf8(task.path, _read_range(task.path, task.start, task.end), task.errors, task.start)
    with TokenFileWriter(task.part, vocab_size=tokenizer.vocab_size, durable=False) as writer:  # a scratch file
        for ids in tokenizer.encode_stream(text):
            writer.write(ids)
    return task


def _read_range(path: Path, start: int, end: int) -> Iterator[bytes]:
    """The bytes start..end of a file, block by block."""
    with open(path, "rb") as handle:
        handle.seek(start)
        while start < end:
            block = handle.read(min(READ_BLOCK, end - start))
            if not block:
                raise ValueError(f"{path}: file shrank while being read (ended at byte {start})")
            start += len(block)
            yield block


def _append_part(writer: TokenFileWriter, part: Path) -> None:
    tokens = open_token_file(part, vocab_size=writer.vocab_size).tokens
    for start in range(0, len(tokens), READ_BLOCK):
        writer.write(tokens[start:start + READ_BLOCK])
    del tokens
    part.unlink()


# ---------------------------------------------------------------------------------------------- tiktoken engine
def _tiktoken_engine(tokenizer: Tokenizer, sources: list[Source], *, errors: str, text_field: str) -> Tokenizer:
    """The tokenizer's tiktoken twin, once it has given the tokenizer's ids on the inputs' first megabyte."""
    from scratchlm.tokenizer.fast.tiktoken_engine import TiktokenTokenizer

    engine = TiktokenTokenizer.like(tokenizer)
    for where, text in _first_texts(sources, tokenizer, errors=errors, text_field=text_field, limit=SAMPLE_CHARS):
        _refuse_other_ids(tokenizer, engine, where, text)
    return engine


def _first_texts(sources: list[Source], tokenizer: Tokenizer, *, errors: str, text_field: str,
                 limit: int) -> Iterator[tuple[str, str]]:
    """(where, text) for the first ``limit`` characters of the inputs, in the pieces the encoder takes whole: a
    plain text file's beginning, or documents; the last one cut at the limit."""
    for source in sources:
        if source.is_plain_text:
            texts = [(source.path, _text_start(source, errors, limit))]
        else:
            name = f"{HF_PREFIX}{source.path}" if source.format == "hf" else source.path
            texts = ((f"document {number} of {name}", document) for number, document
                     in enumerate(documents_of(source, tokenizer, text_field=text_field, errors=errors), 1))
        for where, text in texts:
            yield where, text[:limit]
            limit -= len(text)
            if limit <= 0:
                return


def _text_start(source: Source, errors: str, limit: int) -> str:
    """The text of a file's first blocks, at least ``limit`` characters of it when the file has as many."""
    blocks: list[str] = []
    with closing(read_text_blocks(source, errors=errors)) as decoded:
        for block in decoded:
            blocks.append(block)
            limit -= len(block)
            if limit <= 0:
                break
    return "".join(blocks)


def _refuse_other_ids(reference: Tokenizer, engine: Tokenizer, where: str, text: str) -> None:
    """A ValueError naming the first token where ``engine`` does not give ``reference``'s ids for text."""
    expected, got = reference.encode(text), engine.encode(text)
    if got == expected:
        return
    position = next((i for i, (want, have) in enumerate(zip(expected, got)) if want != have),
                    min(len(expected), len(got)))
    offset = len(reference.decode_bytes(expected[:position]))
    raise ValueError(f"--engine tiktoken gives other ids than the tokenizer on {where}: token {position} (at byte "
                     f"{offset}) is {_describe(engine, got, position)} instead of "
                     f"{_describe(reference, expected, position)}; encode with the default --engine scratchlm")


def _describe(tokenizer: Tokenizer, ids: list[int], position: int) -> str:
    if position >= len(ids):
        return "missing (the ids end there)"
    return f"{ids[position]} {tokenizer.decode_bytes([ids[position]])!r}"


# ---------------------------------------------------------------------------------------------- chunking
def _plan_ranges(paths: list[Path], tokenizer: Tokenizer, workers: int) -> list[tuple[Path, int, int]]:
    """(path, start, end) byte ranges covering every file in order, cut only at safe points.

    Ranges shrink as the input runs out (guided scheduling): each is about the bytes still unplanned divided by
    ``workers * CHUNKS_PER_WORKER``, and at least MIN_CHUNK_BYTES, so the last tasks are short and no worker
    waits long for the other to finish.
    """
    remaining = sum(path.stat().st_size for path in paths)
    specials = [token.encode("utf-8") for token in tokenizer.special_tokens]
    pattern = tokenizer.pipeline.pattern
    cuts = workers > 1 and has_known_boundaries(pattern)
    ranges = []
    for path in paths:
        size = path.stat().st_size
        start = 0
        with open(path, "rb") as handle:
            while cuts and size - start > (target := _range_target(remaining, workers)):
                cut = _next_safe_cut(handle, start + target, size, specials, pattern == GPT2_SPLIT_PATTERN)
                if cut >= size:
                    break
                ranges.append((path, start, cut))
                remaining -= cut - start
                start = cut
        ranges.append((path, start, size))
        remaining -= size - start
    return ranges


def _range_target(remaining: int, workers: int) -> int:
    return max(MIN_CHUNK_BYTES, remaining // (workers * CHUNKS_PER_WORKER))


def _next_safe_cut(handle, position: int, size: int, specials: list[bytes], paragraphs: bool = True) -> int:
    """The first offset >= position just after a "\\n" between printable ASCII bytes (or, with paragraphs, between
    the two of X"\\n\\n"Y); ``size`` if none."""
    while position < size:
        handle.seek(position - 1)
        window = handle.read(_CUT_SEARCH_WINDOW + 1)
        newline = window.find(b"\n", 1)
        while 0 < newline < len(window) - 2:
            cut = position - 1 + newline + 1
            after = window[newline + 1]
            line_break = after in _SAFE_NEIGHBOURS
            paragraph_break = (paragraphs and after == 0x0A and window[newline + 2] in _SAFE_NEIGHBOURS
                               and not _special_starts_at(handle, cut + 1, specials))
            if (window[newline - 1] in _SAFE_NEIGHBOURS and (line_break or paragraph_break)
                    and not _special_spans(handle, cut, specials)):
                return cut
            newline = window.find(b"\n", newline + 1)
        position += _CUT_SEARCH_WINDOW - 1
    return size


def _special_starts_at(handle, position: int, specials: list[bytes]) -> bool:
    """Whether one of the special tokens' bytes occur at ``position``."""
    handle.seek(position)
    ahead = handle.read(max((len(token) for token in specials), default=0))
    return any(ahead.startswith(token) for token in specials)


def _special_spans(handle, cut: int, specials: list[bytes]) -> bool:
    """Whether any special token's bytes occur across ``cut`` (a cut there could split it)."""
    longest = max((len(token) for token in specials), default=0)
    if longest < 2:
        return False
    start = max(cut - longest + 1, 0)
    handle.seek(start)
    around = handle.read(2 * longest)
    index = cut - start
    return any(around.find(token, max(index - len(token) + 1, 0), index + len(token) - 1) != -1
               for token in specials if len(token) > 1)
