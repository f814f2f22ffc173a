"""Token files: round-trips in both dtypes, atomic writes, and refusal of truncated, foreign and mismatched files."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from scratchlm.data.token_file import (
    HEADER_SIZE,
    TokenFileWriter,
    open_token_file,
    token_dtype,
    write_token_file,
)

HASH = "ab" * 32


@pytest.mark.parametrize("vocab_size, dtype", [(256, np.uint16), (65536, np.uint16), (65537, np.uint32),
                                               (100_000, np.uint32)])
def test_round_trip(tmp_path, vocab_size, dtype):
    ids = np.random.default_rng(0).integers(0, vocab_size, size=10_001)
    path = write_token_file(tmp_path / "t.tok", ids, vocab_size=vocab_size, tokenizer_hash=HASH)
    opened = open_token_file(path, vocab_size=vocab_size, tokenizer_hash=HASH)
    assert isinstance(opened.tokens, np.memmap) and opened.tokens.dtype == dtype and opened.dtype == dtype
    np.testing.assert_array_equal(opened.tokens, ids)
    assert (opened.num_tokens, opened.vocab_size, opened.tokenizer_hash) == (10_001, vocab_size, HASH)
    assert path.stat().st_size == HEADER_SIZE + 10_001 * np.dtype(dtype).itemsize


def test_streamed_blocks_and_empty_file(tmp_path):
    blocks = [[1, 2, 3], np.array([4, 5], dtype=np.int64), [], range(6, 9)]
    write_token_file(tmp_path / "s.tok", iter(blocks), vocab_size=10)
    opened = open_token_file(tmp_path / "s.tok")
    assert opened.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8] and opened.tokenizer_hash is None
    write_token_file(tmp_path / "e.tok", [], vocab_size=10)
    assert open_token_file(tmp_path / "e.tok").num_tokens == 0
    assert len(open_token_file(tmp_path / "e.tok").tokens) == 0


def test_out_of_range_ids_are_refused_and_nothing_is_written(tmp_path):
    with pytest.raises(ValueError, match=r"token id 10 at position 4 is outside the vocab \(0..9\)"):
        write_token_file(tmp_path / "x.tok", [[1, 2], [3, 4, 10]], vocab_size=10)
    with pytest.raises(ValueError, match=r"token id -1 at position 1"):
        write_token_file(tmp_path / "x.tok", [0, -1], vocab_size=10)
    with pytest.raises(ValueError, match=rf"token id {2**40} at position 1"):  # too big for the fast list path
        write_token_file(tmp_path / "x.tok", [0, 2**40], vocab_size=10)
    with pytest.raises(ValueError, match="1-D sequence of integers"):
        write_token_file(tmp_path / "x.tok", [0, 1.5], vocab_size=10)
    assert list(tmp_path.iterdir()) == []


def test_failed_write_leaves_previous_file_and_no_temporary(tmp_path):
    path = write_token_file(tmp_path / "t.tok", [1, 2, 3], vocab_size=10)
    with pytest.raises(RuntimeError), TokenFileWriter(path, vocab_size=10) as writer:
        writer.write([7, 7, 7, 7])
        raise RuntimeError("interrupted")
    assert open_token_file(path).tokens.tolist() == [1, 2, 3]
    assert [p.name for p in tmp_path.iterdir()] == ["t.tok"]


def test_killed_writer_never_leaves_a_complete_looking_file(tmp_path):
    code = ("import os, sys; from scratchlm.data.token_file import TokenFileWriter\n"
            "w = TokenFileWriter(sys.argv[1], vocab_size=100)\n"
            "w.write(list(range(100)) * 100); w._file.flush(); os._exit(9)\n")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "k.tok")], capture_output=True)
    assert result.returncode == 9, result.stderr
    assert not (tmp_path / "k.tok").exists()
    (leftover,) = tmp_path.iterdir()  # the temporary, named as such, with a zero (magic-less) header
    assert leftover.name.startswith(".k.tok.") and leftover.name.endswith(".partial")
    with pytest.raises(ValueError, match="not a scratchlm token file"):
        open_token_file(leftover)


def test_truncated_foreign_and_empty_files_are_refused(tmp_path):
    path = write_token_file(tmp_path / "t.tok", list(range(50)), vocab_size=100)
    data = path.read_bytes()
    cases = {
        "truncated.tok": (data[:-1], "header promises 50 tokens .*: truncated"),
        "trailing.tok": (data + b"\0\0", "trailing data"),
        "short.tok": (data[:10], "shorter than the 64-byte header"),
        "empty.tok": (b"", "0 bytes is shorter"),
        "foreign.npy": (b"\x93NUMPY" + bytes(200), "not a scratchlm token file"),
        "version.tok": (data[:8] + b"\x07" + data[9:], "unsupported token file version 7"),
        "itemsize.tok": (data[:12] + b"\x04" + data[13:], "header says 4-byte ids"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=message) as error:
            open_token_file(tmp_path / name)
        assert name in str(error.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_token_file(tmp_path / "missing.tok")


def test_expectations_are_checked(tmp_path):
    path = write_token_file(tmp_path / "t.tok", [1, 2], vocab_size=1000, tokenizer_hash=HASH)
    assert open_token_file(path, vocab_size=1024).num_tokens == 2  # a padded model vocab fits
    with pytest.raises(ValueError, match="encoded for vocab size 1000, larger than the expected vocab size 999"):
        open_token_file(path, vocab_size=999)
    with pytest.raises(ValueError, match=f"encoded with tokenizer {HASH}, but tokenizer {'cd' * 32}"):
        open_token_file(path, tokenizer_hash="cd" * 32)
    unhashed = write_token_file(tmp_path / "u.tok", [1], vocab_size=10)
    with pytest.raises(ValueError, match=r"\(unrecorded\)"):
        open_token_file(unhashed, tokenizer_hash=HASH)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="sha256 hex digest"):
        TokenFileWriter(tmp_path / "t.tok", vocab_size=10, tokenizer_hash="xyz")
    with pytest.raises(ValueError, match="vocab_size must be"):
        token_dtype(0)
    for bad in (300.0, True):
        with pytest.raises(ValueError, match=rf"vocab_size must be an integer in 1..2\*\*32, got {bad!r}"):
            TokenFileWriter(tmp_path / "t.tok", vocab_size=bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TokenFileWriter(tmp_path / "no" / "t.tok", vocab_size=10)
    with pytest.raises(ValueError, match="1-D sequence of integers"):
        write_token_file(tmp_path / "f.tok", np.array([1.5]), vocab_size=10)


def test_close_twice_is_harmless_and_a_failed_close_leaves_no_temporary(tmp_path, monkeypatch):
    with TokenFileWriter(tmp_path / "t.tok", vocab_size=10) as writer:
        writer.write([1, 2])
        assert writer.close() == tmp_path / "t.tok"
    assert open_token_file(tmp_path / "t.tok").tokens.tolist() == [1, 2]
    monkeypatch.setattr("os.fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError, match="No space left"), TokenFileWriter(tmp_path / "u.tok", vocab_size=10) as writer:
        writer.write([3])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.tok"]
    aborted = TokenFileWriter(tmp_path / "v.tok", vocab_size=10)
    aborted.abort()
    with pytest.raises(ValueError, match=r"v\.tok was aborted or failed: nothing was written"):
        aborted.close()
