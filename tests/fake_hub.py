"""A local stand-in for the Hugging Face Hub that speaks enough of its HTTP protocol for huggingface_hub's own code.

Tests point huggingface_hub at it and run its real code paths (nothing inside the library is mocked):

- ``hf_hub_download``: ``HEAD``, then ``GET /[datasets/]OWNER/NAME/resolve/REVISION/PATH``. The HEAD answer carries
  what huggingface_hub insists on: ``X-Repo-Commit`` (the commit the revision resolves to), ``ETag`` (its cache
  key) and ``Content-Length``. A GET honours ``Range: bytes=N-`` (206 Partial Content), which huggingface_hub
  sends to resume a transfer cut short. Errors carry the Hub's ``X-Error-Code`` (RepoNotFound, RevisionNotFound,
  EntryNotFound), from which huggingface_hub picks its exception class.
- ``HfApi.create_repo``: ``POST /api/repos/create`` with a JSON body (200 and the repository's URL; 409 when it
  exists, which ``exist_ok=True`` accepts).
- ``HfApi.upload_folder``: ``POST /api/{type}s/OWNER/NAME/preupload/REVISION`` (answered "regular" for every file:
  there is no LFS or Xet storage here, so contents travel inline), then ``POST .../commit/REVISION`` with an NDJSON
  body: a header line with the commit message, then one line per file with its content in base64.
- ``/plain/NAME``: a file on an ordinary web server (no Hub headers), for plain URL downloads.

Writes need ``Authorization: Bearer TOKEN``. The protocol is as read in huggingface_hub 2.4 (file_download.py,
utils/_http.py's hf_raise_for_status, _commit_api.py, hf_api.py). huggingface_hub reads HF_ENDPOINT and HF_HUB_CACHE
once, when it is imported (maybe by an earlier test), so ``serve`` patches the constants derived from them.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import re
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

TOKEN = "hf_fake_token_for_tests"
COMMIT = "c0ffee" + "0" * 34  # the one commit every repository is at (40 hex digits, as huggingface_hub checks)
_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_RESOLVE = re.compile(r"/(?:(datasets|spaces)/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)")
_REPO_API = re.compile(r"/api/(models|datasets|spaces)/([^/]+/[^/]+)/(preupload|commit)/[^/]+")


@dataclass
class FakeHub:
    url: str = ""
    repos: dict[tuple[str, str], dict[str, bytes]] = field(default_factory=dict)  # (type, OWNER/NAME) -> files
    visibility: dict[tuple[str, str], str | None] = field(default_factory=dict)  # what create_repo asked for
    commit_messages: list[str] = field(default_factory=list)
    plain: dict[str, bytes] = field(default_factory=dict)  # /plain/NAME
    # (method, path, Range header, Authorization header) of every request
    requests: list[tuple[str, str, str | None, str | None]] = field(default_factory=list)
    cut_next_get_after: int | None = None  # the next whole-file GET sends this many bytes and hangs up

    def add(self, repo_id: str, files: dict[str, bytes], *, repo_type: str = "dataset") -> None:
        self.repos[(repo_type, repo_id)] = dict(files)

    def gets(self) -> list[tuple[str, str | None]]:
        """(path, Range) of every GET so far."""
        return [(path, byte_range) for method, path, byte_range, _ in self.requests if method == "GET"]


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "FakeHub/1"

    @property
    def hub(self) -> FakeHub:
        return self.server.hub

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def do_HEAD(self) -> None:
        self._get(body=False)

    def do_GET(self) -> None:
        self._get(body=True)

    def do_POST(self) -> None:
        path = self._record()
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._json(401, {"error": "Invalid credentials in Authorization header"})
        elif path == "/api/repos/create":
            self._create_repo(json.loads(self._body()))
        elif match := _REPO_API.fullmatch(path):
            self._repo_api(match[1].removesuffix("s"), match[2], match[3])
        else:
            self._json(404, {"error": f"no route {path}"})

    # ----------------------------------------------------------------------------------------------- download

    def _get(self, *, body: bool) -> None:
        path = self._record()
        if path.startswith("/plain/"):  # an ordinary web server: no Hub headers, a plain 404
            data = self.hub.plain.get(path.removeprefix("/plain/"))
            return self._json(404, {"error": "Not Found"}) if data is None else self._file(data, {}, body)
        match = _RESOLVE.fullmatch(path)
        if match is None:
            return self._json(404, {"error": f"no route {path}"})
        repo_type = {"datasets": "dataset", "spaces": "space", None: "model"}[match[1]]
        files = self.hub.repos.get((repo_type, match[2]))
        revision, filename = urllib.parse.unquote(match[3]), urllib.parse.unquote(match[4])
        if files is None:
            return self._json(404, {"error": "Repository not found"}, error_code="RepoNotFound")
        if revision not in ("main", COMMIT):
            return self._json(404, {"error": "Invalid rev id"}, error_code="RevisionNotFound")
        if filename not in files:
            return self._json(404, {"error": "Entry not found"}, error_code="EntryNotFound")
        data = files[filename]
        self._file(data, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}, body)

    def _file(self, data: bytes, headers: dict[str, str], body: bool) -> None:
        """The file, or its end from ``Range: bytes=N-``; the connection closes after it (HTTP/1.0)."""
        match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        start = int(match[1]) if match and body else 0
        self.send_response(206 if start else 200)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if not body:
            return
        cut = self.hub.cut_next_get_after
        if cut is not None and not start:  # announce the whole file, send a part, hang up
            self.hub.cut_next_get_after = None
            data = data[:cut]
        self.wfile.write(data[start:])

    # ----------------------------------------------------------------------------------------------- upload

    def _create_repo(self, payload: dict) -> None:
        repo_type = payload.get("type") or "model"
        key = (repo_type, f"{payload['organization']}/{payload['name']}")
        url = f"{self.hub.url}/{_PREFIX[repo_type]}{key[1]}"
        if key in self.hub.repos:
            return self._json(409, {"error": "You already created this repo", "url": url})
        self.hub.repos[key] = {}
        self.hub.visibility[key] = payload.get("visibility")
        self._json(200, {"url": url})

    def _repo_api(self, repo_type: str, repo_id: str, action: str) -> None:
        files = self.hub.repos.get((repo_type, repo_id))
        if files is None:
            return self._json(404, {"error": "Repository not found"}, error_code="RepoNotFound")
        if action == "preupload":
            asked = json.loads(self._body())["files"]
            return self._json(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                              for f in asked]})
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        header, operations = lines[0], lines[1:]
        if any(op["key"] != "file" or op["value"]["encoding"] != "base64" for op in operations):
            return self._json(400, {"error": "the fake Hub takes only files sent inline in base64"})
        for op in operations:
            files[op["value"]["path"]] = base64.b64decode(op["value"]["content"])
        self.hub.commit_messages.append(header["value"]["summary"])
        self._json(200, {"commitUrl": f"{self.hub.url}/{_PREFIX[repo_type]}{repo_id}/commit/{COMMIT}",
                         "commitOid": COMMIT})

    # ----------------------------------------------------------------------------------------------- plumbing

    def _record(self) -> str:
        path = urllib.parse.urlsplit(self.path).path
        self.hub.requests.append((self.command, path, self.headers.get("Range"), self.headers.get("Authorization")))
        return path

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _json(self, status: int, document: dict, *, error_code: str | None = None) -> None:
        data = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if error_code is not None:
            self.send_header("X-Error-Code", error_code)
            self.send_header("X-Error-Message", document["error"])
        if error_code == "EntryNotFound":
            self.send_header("X-Repo-Commit", COMMIT)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


@contextmanager
def serve(tmp_path: Path, monkeypatch) -> Iterator[FakeHub]:
    """Run a FakeHub on 127.0.0.1 and point huggingface_hub at it, with its cache in ``tmp_path`` and the test
    token in HF_TOKEN (no token the machine may hold is read or sent)."""
    from huggingface_hub import constants

    hub = FakeHub()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.hub = hub
    hub.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    patches = {"ENDPOINT": hub.url, "HUGGINGFACE_CO_URL_TEMPLATE": hub.url + "/{repo_id}/resolve/{revision}/{filename}",
               "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "HF_HUB_OFFLINE": False, "HF_HUB_DISABLE_TELEMETRY": True,
               "HF_TOKEN_PATH": str(tmp_path / "no-token"), "HF_STORED_TOKENS_PATH": str(tmp_path / "no-tokens")}
    for name, value in patches.items():
        monkeypatch.setattr(constants, name, value)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        httpd.shutdown()
        httpd.server_close()
