"""Document readers: every input format `data encode` and `tokenizer train` accept, as one stream of documents.

An input spec is a file, a folder (every file of a known format inside it, recursively, in sorted order), a
glob (``data/*.jsonl.gz``), or a Hugging Face dataset ``hf:NAME[:CONFIG][:SPLIT]`` (NAME: a hub dataset, or a
local folder written by ``Dataset.save_to_disk`` or holding data files; SPLIT defaults to ``train``).

What a document is, per format:
- ``.txt`` (and any unknown suffix): the file's text, cut after each end-of-text token ``<|endoftext|>`` it holds
  (TinyStories' layout); a file that holds none is one document (held in memory whole). Read in 1 MiB blocks.
- ``.jsonl`` / ``.ndjson``: one JSON object per line, its ``text_field`` (default ``"text"``) is the document.
- ``.json``: a JSON array of objects (read whole), or else JSON lines like ``.jsonl``.
- ``.parquet``: one row per document, column ``text_field``, read in record batches (needs pyarrow).
- Any of these compressed as ``.gz`` (stdlib) or ``.zst`` (needs zstandard), named ``NAME.FORMAT.gz``.

Records are streamed, so memory stays bounded by the largest document. Every bad record stops the read with one
line naming file and line (JSON) or row (parquet, datasets): malformed JSON, a missing field, a value that is not
text, invalid UTF-8, a lone surrogate. Optional libraries are imported only when their format is read, and their
absence is one line naming the package to install.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import io
import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from scratchlm.extras import require

END_OF_TEXT = "<|endoftext|>"
HF_PREFIX = "hf:"
READ_BLOCK = 1 << 20
FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json",
           ".parquet": "parquet"}
KNOWN_SUFFIXES = tuple(FORMATS)
COMPRESSED_SUFFIXES = (".gz", ".zst")
_PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Source:
    """One input: a file of a format, or a Hugging Face dataset (``path`` is then the spec after ``hf:``)."""

    path: str
    format: str  # "text" | "jsonl" | "json" | "parquet" | "hf"
    compression: str | None = None  # None | ".gz" | ".zst"

    @property
    def is_plain_text(self) -> bool:
        """An uncompressed text file: the byte-range parallel encoder can cut it anywhere safe."""
        return self.format == "text" and self.compression is None


# ---------------------------------------------------------------------------------------------- specs -> sources
def expand_inputs(specs: list[str | Path]) -> list[Source]:
    """The sources of every spec, in order; a spec that matches nothing is an error naming it."""
    sources = [source for spec in specs for source in _expand(str(spec))]
    if not sources:
        raise ValueError("no input files given")
    return sources


def _expand(spec: str) -> list[Source]:
    if spec.startswith(HF_PREFIX):
        return [Source(spec[len(HF_PREFIX):], "hf")]
    path = Path(spec)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and _format_of(p)[0]
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise FileNotFoundError(f"folder {path} holds no input files (known suffixes: "
                                    f"{', '.join(KNOWN_SUFFIXES)}, optionally + .gz or .zst)")
        return [source_of(file) for file in files]
    if path.is_file():
        return [source_of(path)]
    if glob.has_magic(spec):
        matches = sorted(Path(match) for match in glob.glob(spec, recursive=True) if Path(match).is_file())
        if not matches:
            raise FileNotFoundError(f"input pattern {spec} matches no files")
        return [source_of(match) for match in matches]
    raise FileNotFoundError(f"input file {path} does not exist")


def _format_of(path: Path) -> tuple[str | None, str | None]:
    """(format, compression) as a file's suffixes tell them; format None for an unknown suffix."""
    name = path.name.lower()
    compression = next((suffix for suffix in COMPRESSED_SUFFIXES if name.endswith(suffix)), None)
    name = name.removesuffix(compression or "")
    return next((kind for suffix, kind in FORMATS.items() if name.endswith(suffix)), None), compression


def source_of(path: str | Path) -> Source:
    """A file's source, its format and compression told by its suffixes (unknown suffixes read as text)."""
    path = Path(path)
    kind, compression = _format_of(path)
    kind = kind or "text"
    if kind == "parquet" and compression:
        raise ValueError(f"{path}: parquet files compress internally; decompress it first")
    with open(path, "rb"):  # unreadable files fail here, before any work starts
        pass
    return Source(str(path), kind, compression)


# ---------------------------------------------------------------------------------------------- documents
def read_documents(source: Source, *, text_field: str = "text", errors: str = "strict",
                   end_of_text: str | None = END_OF_TEXT) -> Iterator[str]:
    """The documents of one source, in order. ``end_of_text``: the text that separates documents inside a text
    file (None: a text file is one document)."""
    if source.format == "text":
        return _text_documents(source, errors, end_of_text)
    if source.format == "parquet":
        return _parquet_documents(source, text_field)
    if source.format == "hf":
        return _hf_documents(source, text_field)
    return (_field_text(record, text_field, where) for where, record in read_json_records(source, errors=errors))


def _open_binary(source: Source):
    if source.compression == ".gz":
        return gzip.open(source.path, "rb")
    if source.compression == ".zst":
        zstandard = require("zstandard", "data", f"reading {source.path}")
        return zstandard.ZstdDecompressor().stream_reader(open(source.path, "rb"), closefd=True)
    return open(source.path, "rb")


def read_text_blocks(source: Source, *, errors: str = "strict") -> Iterator[str]:
    """The text of a text source (decompressed), block by block, for a reader that cuts the text itself (BPE
    counting cuts it where no pre-token spans the cut, so a file without end-of-text tokens is never held whole);
    invalid UTF-8 names the file and the (decompressed) byte offset."""
    with _open_binary(source) as handle:
        try:
            yield from decode_utf8(source.path, iter(lambda: handle.read(READ_BLOCK), b""), errors)
        except (OSError, EOFError) as error:  # a corrupt .gz / .zst
            raise ValueError(f"{source.path}: cannot decompress ({error})") from None


def decode_utf8(path: str | Path, blocks: Iterable[bytes], errors: str, start: int = 0) -> Iterator[str]:
    """The text of ``blocks``, consecutive non-empty bytes of ``path`` from byte ``start`` on, decoded
    incrementally (a character may span two blocks); invalid UTF-8 is a ValueError naming the file and offset."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors=errors)
    position = start
    for block in itertools.chain(blocks, [b""]):  # the empty block ends the input (final=True)
        pending = len(decoder.getstate()[0])
        try:
            text = decoder.decode(block, final=not block)
        except UnicodeDecodeError as error:
            offset = position - pending + error.start
            raise ValueError(f"{path}: invalid UTF-8 at byte offset {offset} "
                             f"({error.object[error.start:error.end]!r}: {error.reason}); fix the file or use "
                             "--errors replace to substitute U+FFFD") from None
        position += len(block)
        if text:
            yield text


def _text_documents(source: Source, errors: str, end_of_text: str | None) -> Iterator[str]:
    """Documents of a text file, each up to and including an end-of-text token (the last may lack one), so that
    their concatenation is the file's text exactly."""
    if end_of_text is None:
        yield "".join(read_text_blocks(source, errors=errors))
        return
    pending = ""
    for block in read_text_blocks(source, errors=errors):
        # split() cuts only at whole tokens; a token split over two blocks is whole once the tail is re-joined.
        *complete, pending = (pending + block).split(end_of_text)
        yield from (document + end_of_text for document in complete)
    if pending:
        yield pending


def read_json_records(source: Source, *, errors: str = "strict") -> Iterator[tuple[str, object]]:
    """(where, record) of each JSON record of a ``.jsonl`` / ``.json`` source (a JSON array, or JSON lines; blank
    lines skipped): ``where`` is ``FILE:LINE`` (``FILE: record N`` in an array), for messages about the record.
    Malformed JSON is a ValueError naming the file and line."""
    lines = _text_lines(source, errors)
    first = next(lines, None)
    if first is None:
        return
    if source.format == "json" and first[1].lstrip().startswith("["):
        yield from _json_array_records(source, first[1] + "".join(line for _, line in lines))
        return
    for number, line in itertools.chain([first], lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{source.path}:{number}: malformed JSON ({error.msg}, column {error.colno})") from None
        yield f"{source.path}:{number}", record


def _text_lines(source: Source, errors: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a text file, streamed; invalid UTF-8 names the line."""
    with _open_binary(source) as raw:
        handle = io.BufferedReader(raw) if source.compression == ".zst" else raw  # zstd's reader has no readline
        number = 0
        while True:
            try:
                line = handle.readline()
            except (OSError, EOFError) as error:
                raise ValueError(f"{source.path}: cannot decompress ({error})") from None
            if not line:
                return
            number += 1
            try:
                text = line.decode("utf-8", errors=errors)
            except UnicodeDecodeError as error:
                raise ValueError(f"{source.path}:{number}: invalid UTF-8 at column {error.start + 1} "
                                 f"({error.reason}); fix the file or use --errors replace") from None
            yield number, text


def _json_array_records(source: Source, text: str) -> Iterator[tuple[str, object]]:
    try:
        records = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{source.path}:{error.lineno}: malformed JSON ({error.msg}, column {error.colno})") from None
    if not isinstance(records, list):
        raise ValueError(f"{source.path}: expected a JSON array of objects or JSON lines")
    for index, record in enumerate(records):
        yield f"{source.path}: record {index}", record


def _field_text(record: object, text_field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object with a {text_field!r} field, got {_kind(record)}")
    if text_field not in record:
        fields = ", ".join(map(repr, list(record)[:8])) or "none"
        raise ValueError(f"{where}: no field {text_field!r} (fields: {fields}); choose one with --text-field")
    return _checked_text(record[text_field], text_field, where)


def _checked_text(value: object, text_field: str, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {text_field!r} is {_kind(value)}, not text")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(f"{where}: field {text_field!r} holds a lone surrogate {value[error.start]!r} at "
                             f"character {error.start}, which is not text") from None
    return value


def _kind(value: object) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def _parquet_documents(source: Source, text_field: str) -> Iterator[str]:
    parquet = require("pyarrow.parquet", "data", f"reading {source.path}")
    try:
        table = parquet.ParquetFile(source.path)
    except Exception as error:  # noqa: BLE001 pyarrow raises ArrowInvalid and others for a damaged file
        raise ValueError(f"{source.path}: not a readable parquet file ({error})") from None
    columns = table.schema_arrow.names
    if text_field not in columns:
        raise ValueError(f"{source.path}: no column {text_field!r} (columns: {', '.join(map(repr, columns))}); "
                         "choose one with --text-field")
    row = 0
    for batch in table.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_field]):
        for value in batch.column(0).to_pylist():
            yield _checked_text(value, text_field, f"{source.path}: row {row}")
            row += 1


def _hf_documents(source: Source, text_field: str) -> Iterator[str]:
    """Rows of a Hugging Face dataset, streamed (a hub dataset) or memory-mapped (a save_to_disk folder)."""
    datasets = require("datasets", "data", f"reading {source.path}")
    name, config, split = parse_hf_spec(source.path)
    where = f"{HF_PREFIX}{source.path}"
    local = Path(name)
    if (local / "dataset_info.json").is_file() or (local / "dataset_dict.json").is_file():
        rows = datasets.load_from_disk(str(local))
        if isinstance(rows, datasets.DatasetDict):
            if split not in rows:
                raise ValueError(f"{where}: no split {split!r} (splits: {', '.join(rows)})")
            rows = rows[split]
    else:
        try:
            rows = datasets.load_dataset(name, config, split=split, streaming=True)
        except Exception as error:  # noqa: BLE001 datasets raises many types (hub, config, split errors)
            raise ValueError(f"{where}: cannot open dataset ({' '.join(str(error).split())})") from None
    columns = list(rows.column_names or [])
    if columns and text_field not in columns:
        raise ValueError(f"{where}: no column {text_field!r} (columns: {', '.join(map(repr, columns))}); "
                         "choose one with --text-field")
    for row, record in enumerate(rows):
        yield _field_text(record, text_field, f"{where}: row {row}")


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """NAME[:CONFIG][:SPLIT] -> (name, config or None, split); an empty CONFIG means the default one."""
    parts = spec.split(":")
    if not parts[0] or len(parts) > 3:
        raise ValueError(f"{HF_PREFIX}{spec}: expected hf:NAME[:CONFIG][:SPLIT], e.g. hf:roneneldan/TinyStories"
                         "::validation")
    name, config, split = [*parts, "", ""][:3]
    return name, config or None, split or "train"


