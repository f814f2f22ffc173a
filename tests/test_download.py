"""`scratchlm data download`: tested only against a local HTTP server on 127.0.0.1 (no internet here)."""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import re
import socket
import threading
from pathlib import Path

import pytest

from scratchlm.data.download import DownloadError, download_tinystories, register_download

FILES = ("TinyStoriesV2-GPT4-train.txt", "TinyStoriesV2-GPT4-valid.txt")


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """SimpleHTTPRequestHandler plus `Range: bytes=N-` and `If-Range: LAST-MODIFIED` support (416 past the end, as
    real servers do), a request log, and switches to truncate a transfer or cut a chunked one short."""

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
def server(tmp_path):
    """A local server over tmp_path/'remote' holding two small TinyStories-like files (one with UTF-8)."""
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / FILES[0]).write_bytes(("Once upon a time, a cat sat. <|endoftext|>\n" * 3000).encode())
    (remote / FILES[1]).write_bytes("Lily saw a bird – “hi” 🐦\n<|endoftext|>\n".encode() * 50)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(RangeHandler, directory=str(remote)))
    httpd.requests, httpd.honour_ranges, httpd.truncate_get, httpd.cut_chunked = [], True, False, False
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
