"""Read and check a safetensors file's header without loading any tensor.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON ({name: {dtype, shape,
data_offsets: [begin, end]}, optional "__metadata__"}), then the raw tensor bytes. `import hf` reads the header
first so that a hostile or broken file (truncated, a header that claims more bytes than the file holds, shapes
whose bytes do not match their offsets, unknown dtypes) is refused with one line naming the file, before a model
is built or a byte of weights is read. Parsing it here (instead of through the safetensors library) is what
lets every problem carry the file's name and the tensor's.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

# Bytes per element of each safetensors dtype name.
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit: a larger header is a hostile file


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets within the data section (after the header)
    end: int


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors a safetensors file declares, checked against the file's real size; ValueError naming `path`."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: {size} bytes is too short for a safetensors file (8-byte header length)")
        (header_length,) = struct.unpack("<Q", prefix)
        if header_length > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path}: header claims {header_length:,} bytes but the file has {size - 8:,} after "
                             f"the length (truncated, or not a safetensors file)")
        raw = handle.read(header_length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: safetensors header is not valid JSON ({error})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    entries = {name: _entry(path, name, fields) for name, fields in header.items()}
    _check_layout(path, entries, data_bytes=size - 8 - header_length)
    return entries


def _entry(path: Path, name: str, fields) -> TensorEntry:
    if not isinstance(fields, dict):
        raise ValueError(f"{path}: tensor {name!r} has no dtype/shape/data_offsets object")
    dtype, shape, offsets = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise ValueError(f"{path}: tensor {name!r} has shape {shape!r}, not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(n) for n in offsets)
            and offsets[0] <= offsets[1]):
        raise ValueError(f"{path}: tensor {name!r} has data_offsets {offsets!r}, not [begin, end] with begin <= end")
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise ValueError(f"{path}: tensor {name!r} ({dtype} {tuple(shape)}) needs {nbytes:,} bytes but its "
                         f"data_offsets span {offsets[1] - offsets[0]:,}")
    return TensorEntry(dtype, tuple(shape), offsets[0], offsets[1])


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_layout(path: Path, entries: dict[str, TensorEntry], data_bytes: int) -> None:
    """Tensors tile the data section exactly: no overlap, no gap, and it ends where the file ends."""
    position = 0
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            what = "overlaps the tensor before it" if entry.begin < position else f"leaves a gap at byte {position:,}"
            raise ValueError(f"{path}: tensor {name!r} starts at byte {entry.begin:,} and {what}")
        position = entry.end
    if position != data_bytes:
        state = "truncated" if position > data_bytes else "has trailing bytes"
        raise ValueError(f"{path}: header describes {position:,} bytes of tensors but the file holds {data_bytes:,} "
                         f"after its header ({state})")
