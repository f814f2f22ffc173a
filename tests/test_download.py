"""`scratchlm data download`: tested only against a local HTTP server on 127.0.0.1 (no internet here)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import http.server
import os
import re
import socket
import threading
from pathlib import Path

import pytest

from scratchlm.data import download
from scratchlm.data.download import DownloadError, Expected, download_tinystories, download_url, register_download

FILES = ("TinyStoriesV2-GPT4-train.txt", "TinyStoriesV2-GPT4-valid.txt")


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """SimpleHTTPRequestHandler plus `Range: bytes=N-` and `If-Range: LAST-MODIFIED` support (416 past the end, as
    real servers do), a request log, and switches to truncate a transfer, cut a chunked one short, or send no
    Content-Length (to HEAD and GET)."""

    def log_message(self, *args):  # keep test output clean
        pass

    def send_head(self):
        self.server.requests.append((self.command, self.path, self.headers.get("Range"), self.headers.get("If-Range")))
        if self.server.cut_chunked and self.command == "GET":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            return _BytesFile(b"100\r\n" + b"x" * 10)  # a 256-byte chunk, cut after 10 bytes by the closed connection
        match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        path = Path(self.translate_path(self.path))
        if self.server.no_length and path.is_file():  # HTTP/1.0: the body ends where the connection closes
            self.send_response(200)
            self.end_headers()
            return _BytesFile(path.read_bytes())
        if not match or not self.server.honour_ranges or not path.is_file() or not self._same_version(path):
            return super().send_head()
        data = path.read_bytes()
        start = int(match.group(1))
        if start >= len(data):
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(data)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        body = data[start:]
        self.send_response(206)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        return _BytesFile(body)

    def _same_version(self, path: Path) -> bool:
        validator = self.headers.get("If-Range")
        return validator is None or validator == self.date_time_string(int(path.stat().st_mtime))

    def copyfile(self, source, outputfile):
        data = source.read()
        if self.server.truncate_get and self.command == "GET":
            data = data[: len(data) // 2]
        outputfile.write(data)


class _BytesFile:
    def __init__(self, data: bytes):
        self.data = data

    def read(self, *_):
        data, self.data = self.data, b""
        return data

    def close(self):
        pass


@pytest.fixture
def server(tmp_path, monkeypatch):
    """A local server over tmp_path/'remote' holding two small TinyStories-like files (one with UTF-8), unpinned
    (checked against Content-Length) unless a test pins them with `_pin`."""
    monkeypatch.setattr(download, "PINNED", {})
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / FILES[0]).write_bytes(("Once upon a time, a cat sat. <|endoftext|>\n" * 3000).encode())
    (remote / FILES[1]).write_bytes("Lily saw a bird – “hi” 🐦\n<|endoftext|>\n".encode() * 50)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(RangeHandler, directory=str(remote)))
    httpd.requests, httpd.honour_ranges, httpd.truncate_get, httpd.cut_chunked = [], True, False, False
    httpd.no_length = False
    httpd.remote = remote
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _gets(server):
    return [r for r in server.requests if r[0] == "GET"]


def test_downloads_both_files_exactly(server, tmp_path):
    out = tmp_path / "out"
    paths = download_tinystories(out, base_url=server.url, progress=False)
    assert paths == [out / name for name in FILES]
    for name in FILES:
        assert (out / name).read_bytes() == (server.remote / name).read_bytes()
    assert not list(out.glob("*.part"))


def test_skips_file_already_present_with_same_size(server, tmp_path):
    out = tmp_path / "out"
    download_tinystories(out, base_url=server.url, progress=False)
    server.requests.clear()
    download_tinystories(out, base_url=server.url, progress=False)
    assert _gets(server) == []  # only HEAD requests the second time


def test_redownloads_file_with_wrong_size(server, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / FILES[1]).write_bytes(b"stale")
    download_tinystories(out, base_url=server.url, files=FILES[1:], progress=False)
    assert (out / FILES[1]).read_bytes() == (server.remote / FILES[1]).read_bytes()


@pytest.mark.parametrize("honour_ranges", [True, False])
def test_resumes_from_partial_file(server, tmp_path, honour_ranges):
    server.honour_ranges = honour_ranges
    out = tmp_path / "out"
    out.mkdir()
    full = (server.remote / FILES[0]).read_bytes()
    (out / (FILES[0] + ".part")).write_bytes(full[:1000])
    download_tinystories(out, base_url=server.url, files=FILES[:1], progress=False)
    assert (out / FILES[0]).read_bytes() == full
    assert _gets(server)[0][2] == "bytes=1000-"  # it asked to resume either way


def test_truncated_transfer_keeps_part_and_no_final_file(server, tmp_path):
    server.truncate_get = True
    out = tmp_path / "out"
    with pytest.raises(DownloadError, match=re.escape(FILES[0])):
        download_tinystories(out, base_url=server.url, files=FILES[:1], progress=False)
    assert not (out / FILES[0]).exists()
    assert (out / (FILES[0] + ".part")).exists()
    server.truncate_get = False  # a rerun resumes and completes
    download_tinystories(out, base_url=server.url, files=FILES[:1], progress=False)
    assert (out / FILES[0]).read_bytes() == (server.remote / FILES[0]).read_bytes()


@pytest.mark.parametrize("head_refused", [False, True])
def test_complete_part_left_before_the_rename_is_finished(server, tmp_path, monkeypatch, head_refused):
    if head_refused:  # the size then comes from the 416's Content-Range
        monkeypatch.setattr(RangeHandler, "do_HEAD", lambda self: self.send_error(405), raising=False)
    out = tmp_path / "out"
    out.mkdir()
    full = (server.remote / FILES[0]).read_bytes()
    (out / (FILES[0] + ".part")).write_bytes(full)
    for _ in range(2):  # and a rerun skips the finished file
        download_tinystories(out, base_url=server.url, files=FILES[:1], progress=False)
    assert (out / FILES[0]).read_bytes() == full
    assert sorted(p.name for p in out.iterdir()) == [FILES[0]]


@pytest.mark.parametrize("new_size", ["longer", "same"])
def test_part_of_an_older_version_is_not_resumed(server, tmp_path, new_size):
    out = tmp_path / "out"
    server.truncate_get = True  # half of the old version lands in the .part, its version beside it
    with pytest.raises(DownloadError, match="truncated"):
        download_tinystories(out, base_url=server.url, files=FILES[:1], progress=False)
    server.truncate_get = False
    remote = server.remote / FILES[0]
    old = remote.read_bytes()
    (out / (FILES[0] + ".part")).write_bytes(old[: len(old) // 2] if new_size == "longer" else old)
    remote.write_bytes(b"A new version. " * (len(old) // 10) if new_size == "longer" else old.upper())
    os.utime(remote, (remote.stat().st_mtime + 10,) * 2)
    download_tinystories(out, base_url=server.url, files=FILES[:1], progress=False)
    assert (out / FILES[0]).read_bytes() == remote.read_bytes()
    assert _gets(server)[-1][3] is not None  # it resumed with If-Range; the server sent the new version whole


def test_transfer_cut_short_is_a_download_error_keeping_the_part(server, tmp_path):
    server.cut_chunked = True
    out = tmp_path / "out"
    with pytest.raises(DownloadError, match=rf"{re.escape(FILES[0])} interrupted: IncompleteRead.*rerun to resume"):
        download_tinystories(out, base_url=server.url, files=FILES[:1], progress=False)
    assert (out / (FILES[0] + ".part")).exists() and not (out / FILES[0]).exists()


def test_missing_file_is_a_clear_http_error(server, tmp_path):
    with pytest.raises(DownloadError, match=r"nope\.txt: HTTP 404"):
        download_tinystories(tmp_path / "out", base_url=server.url, files=["nope.txt"], progress=False)


def test_offline_is_a_clear_error_naming_the_url(tmp_path):
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/mirror"
    with pytest.raises(DownloadError, match=re.escape(f"cannot reach {url}/{FILES[0]}")):
        download_tinystories(tmp_path / "out", base_url=url, progress=False)


def test_command_downloads_and_prints_paths(server, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    register_download(parser.add_subparsers())
    args = parser.parse_args(["download", "tinystories", "--out", str(tmp_path / "o"), "--base-url", server.url,
                              "--quiet"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    for name in FILES:
        assert str(tmp_path / "o" / name) in printed
        assert (tmp_path / "o" / name).read_bytes() == (server.remote / name).read_bytes()


def test_server_refusing_head_still_downloads(server, tmp_path, monkeypatch):
    monkeypatch.setattr(RangeHandler, "do_HEAD", lambda self: self.send_error(405), raising=False)
    out = tmp_path / "out"
    download_tinystories(out, base_url=server.url, files=FILES[1:], progress=False)
    assert (out / FILES[1]).read_bytes() == (server.remote / FILES[1]).read_bytes()


# --- Verification: nothing truncated is accepted as complete -------------------------------------------------

def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _pin(server, monkeypatch, name: str, *, size: int | None = None, sha256: str | None = None) -> bytes:
    """Pin ``name`` to its served bytes, or to the given size/sha256; returns the served bytes."""
    data = (server.remote / name).read_bytes()
    pin = Expected(len(data) if size is None else size, _sha256(data) if sha256 is None else sha256)
    monkeypatch.setattr(download, "PINNED", {name: pin})
    return data


def _only_file(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir()) if out.exists() else []


def test_real_pins_refuse_a_server_whose_files_differ(server, tmp_path, monkeypatch):
    monkeypatch.undo()  # the real PINNED: the served stand-ins are not the Hub's 2.2 GB file
    with pytest.raises(DownloadError, match=r"expected 2,227,753,162 bytes, the server sends 129,000"):
        download_tinystories(tmp_path / "out", base_url=server.url, progress=False)
    assert _only_file(tmp_path / "out") == []


def test_no_length_and_cut_short_is_refused_with_one_line(server, tmp_path):
    server.no_length = server.truncate_get = True
    with pytest.raises(DownloadError, match=r"sends no size and no sha256 is known.*--sha256 HEX") as error:
        download_url(f"{server.url}/{FILES[0]}", tmp_path / "out", progress=False)
    assert "\n" not in str(error.value)
    assert _only_file(tmp_path / "out") == []


def test_no_length_cut_short_with_the_full_files_sha256_is_a_mismatch_leaving_nothing(server, tmp_path):
    server.no_length = server.truncate_get = True
    full = (server.remote / FILES[0]).read_bytes()
    half = full[: len(full) // 2]
    with pytest.raises(DownloadError, match=rf"sha256 check: expected {_sha256(full)}, got {_sha256(half)} "
                                            rf"\(64,500 bytes\)"):
        download_url(f"{server.url}/{FILES[0]}", tmp_path / "out", sha256=_sha256(full), progress=False)
    assert _only_file(tmp_path / "out") == []


def test_no_length_with_the_right_sha256_is_accepted(server, tmp_path):
    server.no_length = True
    full = (server.remote / FILES[1]).read_bytes()
    path = download_url(f"{server.url}/{FILES[1]}", tmp_path / "out", sha256=_sha256(full).upper(), progress=False)
    assert path.read_bytes() == full and _only_file(tmp_path / "out") == [FILES[1]]


def test_allow_unverified_accepts_with_one_warning(server, tmp_path):
    server.no_length = server.truncate_get = True
    with pytest.warns(download.DownloadWarning, match=r"accepted unverified \(64,500 bytes\)"):
        path = download_url(f"{server.url}/{FILES[0]}", tmp_path / "out", allow_unverified=True, progress=False)
    assert path.stat().st_size == 64_500


def test_with_content_length_the_size_must_be_reached(server, tmp_path):
    server.truncate_get = True  # Content-Length says 129,000; half arrives
    with pytest.raises(DownloadError, match=r"truncated: got 64,500 of 129,000 bytes"):
        download_url(f"{server.url}/{FILES[0]}", tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / FILES[0]).exists()


def test_pinned_file_is_downloaded_without_head_and_verified(server, tmp_path, monkeypatch):
    data = _pin(server, monkeypatch, FILES[1])
    out = tmp_path / "out"
    download_tinystories(out, base_url=server.url, files=FILES[1:], progress=False)
    assert (out / FILES[1]).read_bytes() == data
    assert [r[0] for r in server.requests] == ["GET"]  # the pin gives the size: no HEAD


@pytest.mark.parametrize("pinned", ["smaller", "larger"])
def test_pinned_size_mismatch_is_refused_naming_both(server, tmp_path, monkeypatch, pinned):
    served = len((server.remote / FILES[1]).read_bytes())
    size = served - 7 if pinned == "smaller" else served + 7
    _pin(server, monkeypatch, FILES[1], size=size)
    with pytest.raises(DownloadError, match=rf"expected {size:,} bytes, the server sends {served:,}"):
        download_tinystories(tmp_path / "out", base_url=server.url, files=FILES[1:], progress=False)
    assert _only_file(tmp_path / "out") == []


def test_pinned_size_checked_while_streaming_when_the_server_sends_no_length(server, tmp_path, monkeypatch):
    server.no_length = True
    served = len((server.remote / FILES[0]).read_bytes())
    _pin(server, monkeypatch, FILES[0], size=served - 1000)
    with pytest.raises(DownloadError, match=rf"too long: expected {served - 1000:,} bytes, got more"):
        download_tinystories(tmp_path / "out", base_url=server.url, files=FILES[:1], progress=False)
    assert _only_file(tmp_path / "out") == []


def test_pinned_sha256_mismatch_removes_the_part_naming_both(server, tmp_path, monkeypatch):
    data = _pin(server, monkeypatch, FILES[1], sha256="0" * 64)
    with pytest.raises(DownloadError, match=rf"expected {'0' * 64}, got {_sha256(data)}"):
        download_tinystories(tmp_path / "out", base_url=server.url, files=FILES[1:], progress=False)
    assert _only_file(tmp_path / "out") == []


@pytest.mark.parametrize("honour_ranges", [True, False])
def test_resumed_part_is_hashed_with_the_new_bytes(server, tmp_path, monkeypatch, honour_ranges):
    server.honour_ranges = honour_ranges
    data = _pin(server, monkeypatch, FILES[0])
    out = tmp_path / "out"
    out.mkdir()
    (out / (FILES[0] + ".part")).write_bytes(data[:5000])
    download_tinystories(out, base_url=server.url, files=FILES[:1], progress=False)
    assert (out / FILES[0]).read_bytes() == data
    corrupt = data[:100] + b"X" + data[101:5000]  # a damaged .part: the new bytes alone cannot reveal it
    (out / FILES[0]).unlink()
    (out / (FILES[0] + ".part")).write_bytes(corrupt)
    with pytest.raises(DownloadError, match="sha256 check") if honour_ranges else _no_error():
        download_tinystories(out, base_url=server.url, files=FILES[:1], progress=False)
    assert _only_file(out) == ([] if honour_ranges else [FILES[0]])


def test_complete_part_found_by_416_is_hashed(server, tmp_path, monkeypatch):
    data = _pin(server, monkeypatch, FILES[1], sha256="f" * 64)
    out = tmp_path / "out"
    out.mkdir()
    (out / (FILES[1] + ".part")).write_bytes(data)
    with pytest.raises(DownloadError, match=rf"expected {'f' * 64}, got {_sha256(data)}"):
        download_tinystories(out, base_url=server.url, files=FILES[1:], progress=False)
    assert _only_file(out) == []


def test_present_file_checked_by_size_and_with_verify_by_sha256(server, tmp_path, monkeypatch):
    data = _pin(server, monkeypatch, FILES[1])
    out = tmp_path / "out"
    out.mkdir()
    (out / FILES[1]).write_bytes(data.replace(b"Lily", b"Lucy"))  # same size, other bytes
    download_tinystories(out, base_url=server.url, files=FILES[1:], progress=False)
    assert server.requests == []  # the pinned size matches: kept, with no network at all
    with pytest.raises(DownloadError, match=rf"is corrupt: sha256 expected {_sha256(data)}, got "):
        download_tinystories(out, base_url=server.url, files=FILES[1:], progress=False, verify=True)
    (out / FILES[1]).write_bytes(data)
    download_tinystories(out, base_url=server.url, files=FILES[1:], progress=False, verify=True)
    assert server.requests == []


def test_bad_sha256_argument_is_one_line(tmp_path):
    with pytest.raises(DownloadError, match=r"--sha256 'abc' is not a sha256"):
        download_url("http://127.0.0.1:9/f.txt", tmp_path, sha256="abc")


def _no_error():
    return contextlib.nullcontext()


def _run_command(argv):
    parser = argparse.ArgumentParser()
    register_download(parser.add_subparsers())
    args = parser.parse_args(["download", *argv, "--quiet"])
    return args.func(args)


def test_command_url_refused_then_accepted_with_allow_unverified(server, tmp_path, capsys):
    server.no_length = True
    url = f"{server.url}/{FILES[1]}"
    with pytest.raises(DownloadError, match="--allow-unverified"):
        _run_command([url, "--out", str(tmp_path / "o")])
    assert _run_command([url, "--out", str(tmp_path / "o"), "--allow-unverified"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "warning:" in captured.err and "accepted unverified" in captured.err
    assert str(tmp_path / "o" / FILES[1]) in captured.out


def test_command_sha256_with_tinystories_is_refused(tmp_path):
    with pytest.raises(DownloadError, match="--sha256 is for a URL"):
        _run_command(["tinystories", "--sha256", "0" * 64, "--out", str(tmp_path)])


def test_command_source_neither_tinystories_nor_url(tmp_path):
    with pytest.raises(DownloadError, match="neither `tinystories` nor an http"):
        _run_command(["owt", "--out", str(tmp_path)])
