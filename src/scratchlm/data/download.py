"""Fetch public corpora: `scratchlm data download tinystories`.

Downloads the TinyStories V2 (GPT-4) train/valid text files that CS336 assignment 1 uses, from the Hugging
Face dataset repository ``roneneldan/TinyStories``.

Design:
- stdlib ``urllib`` only, streamed in 1 MiB blocks to ``NAME.part`` beside the target, fsynced, then renamed
  onto ``NAME``: a file with the final name is always complete.
- Skip a file that is already present with the size the server announces; resume an interrupted download from
  ``NAME.part`` with an HTTP Range request (restarting from zero when the server ignores ranges).
- A resume is tied to the version of the file the ``.part`` holds: its validator (strong ETag, else
  Last-Modified) is kept in ``NAME.part.version`` and sent as ``If-Range``, so a server whose file changed sends
  it whole instead of new bytes to append to old ones. A ``.part`` that is already complete (killed between the
  fsync and the rename) gets HTTP 416 for its range and is renamed when the server's size is its size.
- Offline or unreachable servers and transfers cut short give one clear error naming the URL, never a traceback.
- A progress bar (tqdm) only on a terminal.
"""

from __future__ import annotations

import http.client
import os
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

TINYSTORIES_BASE_URL = "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main"
TINYSTORIES_FILES = ("TinyStoriesV2-GPT4-train.txt", "TinyStoriesV2-GPT4-valid.txt")
DEFAULT_OUT_DIR = Path("data/tinystories")
BLOCK_SIZE = 1 << 20
TIMEOUT_S = 60


class DownloadError(ValueError):
    """A download failed (offline, HTTP error, truncated transfer); the message names the URL."""


def download_tinystories(out_dir: str | Path = DEFAULT_OUT_DIR, *, base_url: str = TINYSTORIES_BASE_URL,
                         files: Sequence[str] = TINYSTORIES_FILES, progress: bool = True) -> list[Path]:
    """Download each of ``files`` from ``base_url`` into ``out_dir``; returns the local paths in order."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [download_file(f"{base_url.rstrip('/')}/{name}", out / name, progress=progress) for name in files]


def download_file(url: str, target: Path, *, progress: bool = True) -> Path:
    """Download ``url`` to ``target`` atomically; skip when present with the remote size, resume a ``.part``."""
    remote_size = _remote_size(url)
    if target.exists() and remote_size is not None and target.stat().st_size == remote_size:
        return target
    partial = target.with_name(target.name + ".part")
    try:
        _fetch(url, partial, remote_size, progress=progress and sys.stderr.isatty(), label=target.name)
    except (OSError, http.client.HTTPException) as error:  # cut short (reset, timeout, incomplete chunk): keep .part
        raise DownloadError(f"download of {url} interrupted: {error}; rerun to resume from {partial}") from error
    # The version file goes first: killed in between, the complete .part is still found complete (HTTP 416).
    _version_file(partial).unlink(missing_ok=True)
    os.replace(partial, target)
    return target


def _fetch(url: str, partial: Path, remote_size: int | None, *, progress: bool, label: str) -> None:
    """Make ``partial`` a complete copy of ``url``: resume it when the server still has its version, else restart."""
    offset = partial.stat().st_size if partial.exists() else 0
    if remote_size is not None and offset > remote_size:  # a stale .part from a longer version of the file
        offset = 0
    request = urllib.request.Request(url, headers=_resume_headers(partial, offset))
    try:
        response = _open(request)
    except DownloadError as error:
        if not (offset and isinstance(error.__cause__, urllib.error.HTTPError) and error.__cause__.code == 416):
            raise
        # The range starts at or past the end of the server's (same-version) file: complete when the sizes agree.
        if (_range_total(error.__cause__) or remote_size) != offset:
            partial.unlink()
            _fetch(url, partial, remote_size, progress=progress, label=label)
        return
    with response:
        if offset and response.status != 206:  # the server ignored the range, or its file changed: start over
            offset = 0
        if not offset:
            _record_version(_version_file(partial), response)
        expected = _content_length(response)
        total = offset + expected if expected is not None else remote_size
        _stream(response, partial, offset, total, progress=progress, label=label)
    got = partial.stat().st_size
    if total is not None and got != total:
        raise DownloadError(f"download of {url} is truncated: got {got:,} of {total:,} bytes; "
                            f"rerun to resume from {partial}")


def _version_file(partial: Path) -> Path:
    return partial.with_name(partial.name + ".version")


def _resume_headers(partial: Path, offset: int) -> dict[str, str]:
    """Range from ``offset``, with If-Range naming the .part's version when known (else resumed unchecked)."""
    if not offset:
        return {}
    headers = {"Range": f"bytes={offset}-"}
    if (version := _version_file(partial)).exists():
        headers["If-Range"] = version.read_text(encoding="ascii")
    return headers


def _record_version(version: Path, response) -> None:
    """Remember the version a fresh .part holds: a strong ETag, else Last-Modified (If-Range takes no weak ETag)."""
    etag = response.headers.get("ETag")
    validator = etag if etag and not etag.startswith("W/") else response.headers.get("Last-Modified")
    if validator:
        version.write_text(validator, encoding="ascii")
    else:
        version.unlink(missing_ok=True)


def _range_total(error: urllib.error.HTTPError) -> int | None:
    """The file size from a 416 response's ``Content-Range: bytes */SIZE``, or None when it does not say."""
    match = re.fullmatch(r"bytes \*/(\d+)", error.headers.get("Content-Range") or "")
    return int(match.group(1)) if match else None


def _open(request: urllib.request.Request):
    """urlopen with errors turned into one clear DownloadError (offline, DNS, HTTP status)."""
    try:
        return urllib.request.urlopen(request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as error:
        raise DownloadError(f"cannot download {request.full_url}: HTTP {error.code} {error.reason}") from error
    except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
        reason = getattr(error, "reason", error)
        raise DownloadError(f"cannot reach {request.full_url}: {reason} (offline? use --base-url for a mirror; "
                            "`scratchlm demo --data FILE` trains on local text instead)") from error


def _remote_size(url: str) -> int | None:
    """The file's size from a HEAD request, or None when the server does not say (or refuses HEAD)."""
    try:
        with _open(urllib.request.Request(url, method="HEAD")) as response:
            return _content_length(response)
    except DownloadError as error:
        if isinstance(error.__cause__, urllib.error.HTTPError):
            return None  # e.g. 405 from a mirror without HEAD; the GET that follows reports real HTTP errors
        raise


def _content_length(response) -> int | None:
    value = response.headers.get("Content-Length")
    return int(value) if value is not None and value.isdigit() else None


def _stream(response, partial: Path, offset: int, total: int | None, *, progress: bool, label: str) -> None:
    """Copy the response body to ``partial`` (appending at ``offset``), then fsync it."""
    with open(partial, "r+b" if offset else "wb") as sink, \
            tqdm(total=total, initial=offset, unit="B", unit_scale=True, desc=label, disable=not progress) as bar:
        sink.seek(offset)
        sink.truncate()
        while block := response.read(BLOCK_SIZE):
            sink.write(block)
            bar.update(len(block))
        sink.flush()
        os.fsync(sink.fileno())


def register_download(data_subparsers) -> None:
    """Add `download` to the `scratchlm data` subcommands."""
    parser = data_subparsers.add_parser(
        "download", help="download a public corpus (needs the internet)",
        description="Download the TinyStories V2 (GPT-4) train/valid text files used by CS336 assignment 1. "
                    "Files already present with the right size are skipped; interrupted downloads resume.")
    parser.add_argument("dataset", choices=["tinystories"], help="which corpus to fetch")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR, help=f"folder (default: {DEFAULT_OUT_DIR})")
    parser.add_argument("--base-url", default=TINYSTORIES_BASE_URL, help="mirror URL holding the files")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=_download_command)


def _download_command(args) -> int:
    paths = download_tinystories(args.out, base_url=args.base_url, progress=not args.quiet)
    for path in paths:
        print(f"{path}  ({path.stat().st_size:,} bytes)")
    return 0
