"""Fetch public corpora: `scratchlm data download tinystories` (or any URL).

Downloads the TinyStories V2 (GPT-4) train/valid text files that CS336 assignment 1 uses, from the Hugging
Face dataset repository ``roneneldan/TinyStories``, or one file from a URL.

Design:
- Nothing truncated is ever accepted as complete. Known files are pinned (size and sha256, in ``PINNED``): the
  size is checked while streaming, the sha256 (hashed as blocks arrive; a resumed ``.part`` is hashed from disk
  once) before the rename, and a mismatch removes the ``.part`` and names both values. Other files are checked
  against the server's Content-Length; with no length and no ``--sha256`` the download is refused, because a
  connection closed early would look like the end of the file, unless ``allow_unverified`` is asked for.
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

import hashlib
import http.client
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

TINYSTORIES_BASE_URL = "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main"
TINYSTORIES_FILES = ("TinyStoriesV2-GPT4-train.txt", "TinyStoriesV2-GPT4-valid.txt")
DEFAULT_OUT_DIR = Path("data/tinystories")
BLOCK_SIZE = 1 << 20
TIMEOUT_S = 60


@dataclass(frozen=True)
class Expected:
    """What a downloaded file must turn out to be; None where it is not known in advance."""

    size: int | None = None
    sha256: str | None = None


# The Hub's Git LFS size and sha256 of the two files, as three independent CS336 write-ups record them (one read
# from the Hub's metadata, two from their downloads). A changed upstream file is refused, never half-trusted.
PINNED = {
    "TinyStoriesV2-GPT4-train.txt": Expected(2_227_753_162,
                                             "6418d412de72888f52b5142c761ac21a582f7d1166f0bfbdb5f03ccfdec90443"),
    "TinyStoriesV2-GPT4-valid.txt": Expected(22_502_601,
                                             "6874bae9a4c1a4e7edcf0e53b86c17817e9cf881fc75ff2368da457b80c0585d"),
}


class DownloadError(ValueError):
    """A download failed (offline, HTTP error, truncated or mismatched transfer); the message names the URL."""


class DownloadWarning(UserWarning):
    """A file was accepted without any check of its completeness (``allow_unverified``)."""


def download_tinystories(out_dir: str | Path = DEFAULT_OUT_DIR, *, base_url: str = TINYSTORIES_BASE_URL,
                         files: Sequence[str] = TINYSTORIES_FILES, progress: bool = True,
                         verify: bool = False) -> list[Path]:
    """Download each of ``files`` from ``base_url`` into ``out_dir``; returns the local paths in order."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [download_file(f"{base_url.rstrip('/')}/{name}", out / name, expected=PINNED.get(name, Expected()),
                          progress=progress, verify=verify) for name in files]


def download_url(url: str, out_dir: str | Path, *, sha256: str | None = None, allow_unverified: bool = False,
                 progress: bool = True, verify: bool = False) -> Path:
    """Download one file from ``url`` into ``out_dir`` under the URL's last path segment."""
    name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
    if not name or name in (".", ".."):
        raise DownloadError(f"{url} names no file (its path must end in a file name)")
    if sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", sha256):
        raise DownloadError(f"--sha256 {sha256!r} is not a sha256 (64 hexadecimal digits)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return download_file(url, out / name, expected=Expected(sha256=sha256 and sha256.lower()),
                         allow_unverified=allow_unverified, progress=progress, verify=verify)


def download_file(url: str, target: Path, *, expected: Expected = Expected(), allow_unverified: bool = False,
                  progress: bool = True, verify: bool = False) -> Path:
    """Download ``url`` to ``target`` atomically and verified; skip it when present, resume a ``.part``.

    A present file is checked by size (a pinned one offline, else against the server's); ``verify`` also hashes
    it when a sha256 is known. With neither a size nor a sha256 the download is refused unless
    ``allow_unverified``, which warns (DownloadWarning) that the file was accepted unchecked.
    """
    size = expected.size if expected.size is not None else _remote_size(url)
    if target.exists() and _present_is_complete(target, size, expected.sha256, verify=verify):
        return target
    partial = target.with_name(target.name + ".part")
    try:
        digest, total = _fetch(url, partial, expected, size, allow_unverified=allow_unverified,
                               progress=progress and sys.stderr.isatty(), label=target.name)
    except (OSError, http.client.HTTPException) as error:  # cut short (reset, timeout, incomplete chunk): keep .part
        raise DownloadError(f"download of {url} interrupted: {error}; rerun to resume from {partial}") from error
    if expected.sha256 is not None and digest != expected.sha256:
        got = partial.stat().st_size
        _discard(partial)
        raise DownloadError(f"download of {url} failed its sha256 check: expected {expected.sha256}, got {digest} "
                            f"({got:,} bytes); the partial file was removed")
    if expected.sha256 is None and total is None:
        warnings.warn(f"{target}: accepted unverified ({partial.stat().st_size:,} bytes): the server sent no size "
                      "and no sha256 was given, so a transfer cut short would look complete", DownloadWarning,
                      stacklevel=2)
    # The version file goes first: killed in between, the complete .part is still found complete (HTTP 416).
    _version_file(partial).unlink(missing_ok=True)
    os.replace(partial, target)
    return target


def _present_is_complete(target: Path, size: int | None, sha256: str | None, *, verify: bool) -> bool:
    """Whether ``target`` is already the wanted file: by size when one is known (hashed too with ``verify``),
    else by sha256; False sends it to be downloaded again. A right-sized file with a wrong hash is an error."""
    if size is None:
        return sha256 is not None and _file_sha256(target) == sha256
    if target.stat().st_size != size:
        return False
    if verify and sha256 is not None and (got := _file_sha256(target)) != sha256:
        raise DownloadError(f"{target} is corrupt: sha256 expected {sha256}, got {got}; delete it and rerun")
    return True


def _fetch(url: str, partial: Path, expected: Expected, size: int | None, *, allow_unverified: bool,
           progress: bool, label: str) -> tuple[str, int | None]:
    """Make ``partial`` a complete copy of ``url``: resume it when the server still has its version, else restart.

    ``size`` is the pinned size, else the one HEAD announced. Returns the .part's sha256 and the size it was
    checked against (None when none was known).
    """
    offset = partial.stat().st_size if partial.exists() else 0
    if size is not None and offset > size:  # a stale .part from a longer version of the file
        offset = 0
    request = urllib.request.Request(url, headers=_resume_headers(partial, offset))
    try:
        response = _open(request)
    except DownloadError as error:
        if not (offset and isinstance(error.__cause__, urllib.error.HTTPError) and error.__cause__.code == 416):
            raise
        # The range starts at or past the end of the server's (same-version) file: complete when the sizes agree.
        if (size if expected.size is not None else _range_total(error.__cause__) or size) != offset:
            partial.unlink()
            return _fetch(url, partial, expected, size, allow_unverified=allow_unverified, progress=progress,
                          label=label)
        return _file_sha256(partial), offset
    with response:
        if offset and response.status != 206:  # the server ignored the range, or its file changed: start over
            offset = 0
        length = _content_length(response)
        announced = offset + length if length is not None else None
        total = _checked_total(url, partial, expected, announced, size, allow_unverified=allow_unverified)
        if not offset:
            _record_version(_version_file(partial), response)
        digest = _stream(response, partial, offset, total, progress=progress, label=label)
    got = partial.stat().st_size
    if total is not None and got > total:
        _discard(partial)
        raise DownloadError(f"download of {url} is too long: expected {total:,} bytes, got more; "
                            "the partial file was removed")
    if total is not None and got != total:
        raise DownloadError(f"download of {url} is truncated: got {got:,} of {total:,} bytes; "
                            f"rerun to resume from {partial}")
    return digest, total


def _checked_total(url: str, partial: Path, expected: Expected, announced: int | None, size: int | None, *,
                   allow_unverified: bool) -> int | None:
    """The size the transfer must reach; refuses a server contradicting the pinned size, or an unverifiable one."""
    if expected.size is not None and announced is not None and announced != expected.size:
        _discard(partial)
        raise DownloadError(f"{url} is not the pinned file: expected {expected.size:,} bytes, the server sends "
                            f"{announced:,} (changed upstream, or a wrong --base-url?)")
    total = expected.size if expected.size is not None else announced if announced is not None else size
    if total is None and expected.sha256 is None and not allow_unverified:
        raise DownloadError(f"{url} sends no size and no sha256 is known, so a transfer cut short would look "
                            "complete: pass --sha256 HEX to verify it (or --allow-unverified to accept it as is)")
    return total


def _discard(partial: Path) -> None:
    """Remove a .part (and its version) that can never become the wanted file."""
    partial.unlink(missing_ok=True)
    _version_file(partial).unlink(missing_ok=True)


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


def _stream(response, partial: Path, offset: int, total: int | None, *, progress: bool, label: str) -> str:
    """Copy the response body to ``partial`` (appending at ``offset``), fsync it, and return its sha256.

    Bytes already in a resumed .part are hashed from disk once; new blocks are hashed as they arrive. With a known
    ``total`` it reads at most one byte past it, enough to tell an overlong body without storing all of it.
    """
    digest = hashlib.sha256()
    with open(partial, "r+b" if offset else "wb") as sink, \
            tqdm(total=total, initial=offset, unit="B", unit_scale=True, desc=label, disable=not progress) as bar:
        if offset:
            _hash_blocks(sink, digest)  # reads to the end, which is ``offset``
        sink.truncate()
        while block := response.read(BLOCK_SIZE if total is None else min(BLOCK_SIZE, total + 1 - sink.tell())):
            digest.update(block)
            sink.write(block)
            bar.update(len(block))
        sink.flush()
        os.fsync(sink.fileno())
    return digest.hexdigest()


def _hash_blocks(source, digest) -> None:
    while block := source.read(BLOCK_SIZE):
        digest.update(block)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        _hash_blocks(source, digest)
    return digest.hexdigest()


def register_download(data_subparsers) -> None:
    """Add `download` to the `scratchlm data` subcommands."""
    parser = data_subparsers.add_parser(
        "download", help="download a public corpus (needs the internet)",
        description="Download the TinyStories V2 (GPT-4) train/valid text files used by CS336 assignment 1 "
                    "(pinned: size and sha256 are checked), or one file from a URL. Files already present with "
                    "the right size are skipped; interrupted downloads resume. A file the server sends without "
                    "a size is refused unless --sha256 or --allow-unverified is given.")
    parser.add_argument("source", metavar="tinystories|URL", help="`tinystories`, or the http(s) URL of one file")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR, help=f"folder (default: {DEFAULT_OUT_DIR})")
    parser.add_argument("--base-url", default=TINYSTORIES_BASE_URL, help="mirror URL holding the TinyStories files")
    parser.add_argument("--sha256", metavar="HEX", help="a URL's expected sha256, checked after the transfer")
    parser.add_argument("--allow-unverified", action="store_true",
                        help="accept a URL's file even when neither its size nor its sha256 is known")
    parser.add_argument("--verify", action="store_true", help="also hash files already present (slow for 2 GB)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=_download_command)


def _download_command(args) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DownloadWarning)
        paths = _download_source(args)
    for warning in caught:  # one line each, not Python's two-line warning format
        print(f"scratchlm data: warning: {warning.message}", file=sys.stderr)
    for path in paths:
        print(f"{path}  ({path.stat().st_size:,} bytes)")
    return 0


def _download_source(args) -> list[Path]:
    if args.source == "tinystories":
        if args.sha256 is not None:
            raise DownloadError("--sha256 is for a URL; the TinyStories files are pinned already")
        return download_tinystories(args.out, base_url=args.base_url, progress=not args.quiet, verify=args.verify)
    if urllib.parse.urlsplit(args.source).scheme not in ("http", "https"):
        raise DownloadError(f"{args.source!r} is neither `tinystories` nor an http(s) URL")
    return [download_url(args.source, args.out, sha256=args.sha256, allow_unverified=args.allow_unverified,
                         progress=not args.quiet, verify=args.verify)]
