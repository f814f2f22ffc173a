"""Token files: a flat array of token ids behind a small header, memory-mapped for training.

Layout (little-endian), a 64-byte header then the ids::

    0  magic      8 bytes  b"SCRLMTOK"
    8  version    uint32   TOKEN_FILE_VERSION
    12 itemsize   uint32   2 (uint16 ids) or 4 (uint32 ids)
    16 vocab_size uint64   ids are < vocab_size
    24 num_tokens uint64
    32 tokenizer  32 bytes sha256 of the tokenizer (``Tokenizer.hash``), all zero when unknown
    64 ids        num_tokens * itemsize bytes

Design: the header is written last. ``TokenFileWriter`` streams ids into a temporary file beside the target,
then writes the real header, fsyncs and renames: a crash or Ctrl-C at any point leaves either no file at the
target or the previous one, never a file that looks complete. ``open_token_file`` checks magic, version and
that the size matches the header exactly, so truncated and foreign files are refused with a clear message.
"""

from __future__ import annotations

import array
import contextlib
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scratchlm.write_errors import naming

MAGIC = b"SCRLMTOK"
TOKEN_FILE_VERSION = 1
HEADER = struct.Struct("<8sIIQQ32s")
HEADER_SIZE = 64
assert HEADER.size <= HEADER_SIZE
_NO_HASH = bytes(32)
SCAN_CHUNK = 1 << 24  # ids per chunk of the out-of-vocab scan: 32-64 MiB of memmap at a time


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    if type(vocab_size) is not int or not 0 < vocab_size <= 2**32:
        raise ValueError(f"vocab_size must be an integer in 1..2**32, got {vocab_size!r}")
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


@dataclass
class TokenFile:
    path: Path
    tokens: np.ndarray  # (num_tokens,) read-only np.memmap (an empty array when num_tokens == 0)
    vocab_size: int
    tokenizer_hash: str | None
    num_tokens: int
    dtype: np.dtype


class TokenFileWriter:
    """Stream ids into a token file; it appears at ``path`` only on a successful ``close``.

    Use as a context manager: an exception inside the block removes the temporary file and leaves ``path``
    untouched. ``durable=False`` skips the fsync before the rename, for scratch files that are deleted after
    use whatever happens (a crash can then leave such a file with zeros where data should be).
    """

    def __init__(self, path: str | Path, *, vocab_size: int, tokenizer_hash: str | None = None,
                 durable: bool = True) -> None:
        self.path = Path(path)
        self.durable = durable
        self.vocab_size = vocab_size
        self.dtype = token_dtype(vocab_size)
        self.tokenizer_hash = _hash_bytes(tokenizer_hash)
        self.num_tokens = 0
        self._written = False  # the file is in place at path (a second close then does nothing)
        if not self.path.parent.is_dir():
            raise FileNotFoundError(f"cannot write token file {self.path}: folder {self.path.parent} does not exist")
        if self.path.is_dir():
            raise IsADirectoryError(f"cannot write token file {self.path}: it is a folder")
        # The pid in the name lets a later encode remove this file when its writer was killed (see data/encode.py).
        handle, name = tempfile.mkstemp(prefix=f".{self.path.name}.{os.getpid()}.", suffix=".partial",
                                        dir=self.path.parent)
        self._temporary = Path(name)
        self._file = os.fdopen(handle, "wb")
        self._file.write(bytes(HEADER_SIZE))  # all zero (no magic) until close: never looks complete

    def write(self, ids) -> None:
        """Append ids (a list or array of ints, each in 0..vocab_size-1)."""
        tokens = _as_array(ids)
        if tokens.size == 0:
            return
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(f"token ids must be a 1-D sequence of integers, got shape {tokens.shape} {tokens.dtype}")
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            position = self.num_tokens + int(np.argmax(tokens == bad))
            raise ValueError(f"token id {bad} at position {position} is outside the vocab (0..{self.vocab_size - 1})")
        data = tokens.astype(self.dtype, copy=False).tobytes()
        with naming(self.path, len(data)):
            self._file.write(data)
        self.num_tokens += tokens.size

    def close(self) -> Path:
        """Write the header, fsync (when durable) and move the file into place; returns its path.

        A failure on the way removes the temporary file; closing again after success does nothing, after an abort
        or a failed close it is an error (nothing was written)."""
        if self._written:
            return self.path
        if self._file.closed:
            raise ValueError(f"token file writer for {self.path} was aborted or failed: nothing was written")
        try:
            with naming(self.path):
                self._file.seek(0)
                self._file.write(HEADER.pack(MAGIC, TOKEN_FILE_VERSION, self.dtype.itemsize, self.vocab_size,
                                             self.num_tokens, self.tokenizer_hash))
                self._file.flush()
                if self.durable:
                    os.fsync(self._file.fileno())
                self._file.close()
                os.chmod(self._temporary, 0o666 & ~_current_umask())  # mkstemp made it owner-only
                os.replace(self._temporary, self.path)
        except BaseException:
            self.abort()
            raise
        self._written = True
        return self.path

    def abort(self) -> None:
        """Drop everything written so far."""
        with contextlib.suppress(OSError):  # flushing the buffer failed (full disk): those bytes are dropped anyway
            self._file.close()
        self._temporary.unlink(missing_ok=True)

    def __enter__(self) -> TokenFileWriter:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _as_array(ids) -> np.ndarray:
    """ids as a numpy array; a list of ints goes through ``array.array``, which copies the ints without inspecting
    each element's type as ``np.asarray`` does (a large share of writing an encoder's output: docs/benchmarks.md)."""
    if type(ids) is list:
        try:
            return np.frombuffer(array.array("I", ids), dtype=np.uint32)
        except (OverflowError, TypeError):  # negative, >= 2**32 or not ints: np.asarray keeps them for the error
            pass
    return np.asarray(ids)


def write_token_file(path: str | Path, ids, *, vocab_size: int, tokenizer_hash: str | None = None) -> Path:
    """Write ids (an array, or an iterable of arrays/lists of ids) atomically as a token file."""
    with TokenFileWriter(path, vocab_size=vocab_size, tokenizer_hash=tokenizer_hash) as writer:
        if isinstance(ids, np.ndarray) or (isinstance(ids, list | tuple) and not _is_nested(ids)):
            writer.write(ids)
        else:
            for block in ids:
                writer.write(block)
    return Path(path)


def open_token_file(path: str | Path, *, vocab_size: int | None = None,
                    tokenizer_hash: str | None = None) -> TokenFile:
    """Memory-map a token file, checking it is complete and (optionally) made for this vocab and tokenizer.

    ``vocab_size``: the file's vocab size must not exceed it, and every id in the body must be below the file's
    vocab size (a scan of the whole body, in chunks): a damaged body is refused here, naming the position, not
    deep inside an embedding lookup.
    ``tokenizer_hash``: must equal the hash the file recorded.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token file {path} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as handle:
        header = handle.read(HEADER_SIZE)
    if len(header) < HEADER_SIZE:
        raise ValueError(f"{path} is not a scratchlm token file: {size} bytes is shorter than the "
                         f"{HEADER_SIZE}-byte header (empty or truncated)")
    magic, version, itemsize, stored_vocab, num_tokens, stored_hash = HEADER.unpack(header[:HEADER.size])
    if magic != MAGIC:
        raise ValueError(f"{path} is not a scratchlm token file (magic {magic!r}, expected {MAGIC!r}); "
                         "an unfinished write, or a file from another tool (write one with `scratchlm data encode`)")
    if version != TOKEN_FILE_VERSION:
        raise ValueError(f"{path}: unsupported token file version {version} (this scratchlm reads "
                         f"version {TOKEN_FILE_VERSION})")
    if not 0 < stored_vocab <= 2**32:
        raise ValueError(f"{path}: header says vocab size {stored_vocab}, outside 1..2**32 (a damaged header)")
    dtype = token_dtype(stored_vocab)
    if itemsize != dtype.itemsize:
        raise ValueError(f"{path}: header says {itemsize}-byte ids, but vocab size {stored_vocab} needs {dtype}")
    expected = HEADER_SIZE + num_tokens * itemsize
    if size != expected:
        raise ValueError(f"{path}: file is {size} bytes but its header promises {num_tokens} tokens "
                         f"({expected} bytes): {'truncated' if size < expected else 'trailing data'}")
    found_hash = None if stored_hash == _NO_HASH else stored_hash.hex()
    if num_tokens == 0:
        tokens = np.zeros(0, dtype=dtype)
    else:
        tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_SIZE, shape=(num_tokens,))
    opened = TokenFile(path, tokens, stored_vocab, found_hash, num_tokens, dtype)
    check_token_file(opened, vocab_size=vocab_size, tokenizer_hash=tokenizer_hash)
    return opened


def check_token_file(opened: TokenFile, *, vocab_size: int | None = None, tokenizer_hash: str | None = None) -> None:
    """``open_token_file``'s checks of ``vocab_size`` and ``tokenizer_hash``, for a file opened before they were
    known (train opens its token files once, and learns the vocabulary from the train file's header)."""
    # A model may pad its vocab (e.g. 50257 -> 50304): the file fits when all its ids are below vocab_size.
    if vocab_size is not None and opened.vocab_size > vocab_size:
        raise ValueError(f"{opened.path} was encoded for vocab size {opened.vocab_size}, larger than the expected "
                         f"vocab size {vocab_size}: its ids may not fit; re-encode it with the matching tokenizer")
    if tokenizer_hash is not None and tokenizer_hash != opened.tokenizer_hash:
        raise ValueError(f"{opened.path} was encoded with tokenizer {opened.tokenizer_hash or '(unrecorded)'}, but "
                         f"tokenizer {tokenizer_hash} was expected: re-encode it with this tokenizer")
    if vocab_size is not None:
        check_ids_below(opened.path, opened.tokens, opened.vocab_size)


def check_ids_below(path: Path, tokens: np.ndarray, limit: int) -> None:
    """ValueError naming the first id >= limit and its position; a vectorised max per chunk, bounded memory."""
    for start in range(0, len(tokens), SCAN_CHUNK):
        chunk = tokens[start:start + SCAN_CHUNK]
        if int(chunk.max()) >= limit:
            offset = int(np.argmax(chunk >= limit))
            raise ValueError(f"{path}: token id {int(chunk[offset])} at position {start + offset:,} is outside the "
                             f"file's vocab (0..{limit - 1}): the file is damaged; re-encode it")


def _hash_bytes(tokenizer_hash: str | None) -> bytes:
    if tokenizer_hash is None:
        return _NO_HASH
    try:
        raw = bytes.fromhex(tokenizer_hash)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"tokenizer_hash must be a sha256 hex digest (64 hex digits), got {tokenizer_hash!r}")
    return raw


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _is_nested(ids: list | tuple) -> bool:
    return bool(ids) and not isinstance(ids[0], int | np.integer)
