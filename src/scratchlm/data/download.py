"""Fetch corpora: `scratchlm data download tinystories | hf:OWNER/NAME/PATH | URL`.

``hf:OWNER/NAME/PATH`` is one file of a Hugging Face Hub repository; ``tinystories`` is the two TinyStories V2
(GPT-4) train/valid text files of CS336 assignment 1; a plain http(s) URL names one file anywhere.

huggingface_hub does the transfer (scratchlm/hub.py: cached, size-checked, resumed). The file then gets its name
in ``--out`` as a hard link to the cached copy (no second copy of a 2 GB file), or a copy through a temporary file
and a rename, so a file with the final name is always complete. A file already in ``--out`` is never replaced:
the same bytes are fine (a rerun), other bytes are an error. The TinyStories files are pinned (size and sha256),
a URL's file is checked against ``--sha256``. A failed command leaves no folder it created behind.
"""

from __future__ import annotations

import contextlib
import filecmp
import hashlib
import os
import re
import shutil
import tempfile
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from scratchlm.hub import REPO_TYPES, HubFile, fetch, one_line_errors, require_hub
from scratchlm.write_errors import made_folder

TINYSTORIES_REPO = "roneneldan/TinyStories"
TINYSTORIES_FILES = ("TinyStoriesV2-GPT4-train.txt", "TinyStoriesV2-GPT4-valid.txt")
DEFAULT_OUT_DIR = Path("data/tinystories")
BLOCK_SIZE = 1 << 20


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
    """A downloaded file is not the expected one, or would replace a different file; the message names both."""


def download_tinystories(out_dir: str | Path = DEFAULT_OUT_DIR, *,
                         files: Sequence[str] = TINYSTORIES_FILES) -> list[Path]:
    """Download each of ``files`` from the TinyStories dataset into ``out_dir``; returns the local paths in order."""
    with made_folder(out_dir) as out:
        return [download_hub_file(HubFile(TINYSTORIES_REPO, name), out, expected=PINNED.get(name, Expected()))
                for name in files]


def download_hub_file(file: HubFile, out_dir: str | Path, *, expected: Expected = Expected()) -> Path:
    """Download one Hub file into ``out_dir`` (under its own name, without the repository's folders)."""
    with made_folder(out_dir) as out:
        return _keep(fetch(file).resolve(), out / PurePosixPath(file.filename).name, str(file), expected)


def download_url(url: str, out_dir: str | Path, *, sha256: str | None = None) -> Path:
    """Download one file from ``url`` into ``out_dir`` under the URL's last path segment."""
    name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
    if not name or name in (".", ".."):
        raise DownloadError(f"{url} names no file (its path must end in a file name)")
    if sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", sha256):
        raise DownloadError(f"--sha256 {sha256!r} is not a sha256 (64 hexadecimal digits)")
    require_hub(f"downloading {url}")
    from huggingface_hub.file_download import http_get

    with made_folder(out_dir) as out, _temporary_beside(out / name) as partial:
        with open(partial, "wb") as sink, one_line_errors(url):
            http_get(url, sink)  # no Hub token is sent: the URL may be anybody's server
        return _keep(partial, out / name, url, Expected(sha256=sha256 and sha256.lower()))


def _keep(fetched: Path, target: Path, source: str, expected: Expected) -> Path:
    """Give the downloaded ``fetched`` the name ``target``, once it is what ``expected`` says; a file already at
    ``target`` must hold the same bytes (it is never replaced)."""
    if target.exists():
        if os.path.samefile(target, fetched) or filecmp.cmp(target, fetched, shallow=False):
            return target
        raise DownloadError(f"{target} already exists and differs from {source}; move it away or choose another "
                            "--out")
    _check(fetched, source, expected)
    try:
        os.link(fetched, target)
    except OSError:  # the cache is on another disk, or the file system has no hard links
        with _temporary_beside(target) as partial:  # a copy, renamed when complete
            shutil.copyfile(fetched, partial)
            os.replace(partial, target)
    return target


def _check(path: Path, source: str, expected: Expected) -> None:
    size = path.stat().st_size
    if expected.size is not None and size != expected.size:
        raise DownloadError(f"{source} is not the pinned file: expected {expected.size:,} bytes, got {size:,} "
                            "(changed upstream, or HF_ENDPOINT names another server?)")
    if expected.sha256 is not None and (got := _file_sha256(path)) != expected.sha256:
        raise DownloadError(f"{source} failed its sha256 check: expected {expected.sha256}, got {got} "
                            f"({size:,} bytes)")


@contextlib.contextmanager
def _temporary_beside(target: Path) -> Iterator[Path]:
    """A new, hidden temporary file in ``target``'s folder (same disk: it can be renamed or linked), removed on
    exit whatever happens."""
    handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    os.close(handle)
    try:
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while block := source.read(BLOCK_SIZE):
            digest.update(block)
    return digest.hexdigest()


def register_download(data_subparsers) -> None:
    """Add `download` to the `scratchlm data` subcommands."""
    parser = data_subparsers.add_parser(
        "download", help="download a corpus from the Hugging Face Hub or a URL (needs the internet)",
        description="Download the TinyStories V2 (GPT-4) train/valid files used by CS336 assignment 1 (pinned: "
                    "size and sha256 are checked), one file of a Hugging Face Hub repository (hf:OWNER/NAME/PATH), "
                    "or one file from a URL, into --out. Hub files go through the Hugging Face cache "
                    "(HF_HUB_CACHE; HF_ENDPOINT names a mirror; HF_TOKEN or `hf auth login` for private ones). "
                    "A file already in --out is kept when it holds the same bytes and is never replaced. "
                    "Needs the [hub] extra (huggingface_hub).")
    parser.add_argument("source", metavar="tinystories|hf:OWNER/NAME/PATH|URL",
                        help="`tinystories`, a Hub file such as "
                             "hf:roneneldan/TinyStories/TinyStoriesV2-GPT4-valid.txt, or the http(s) URL of one file")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help=f"folder (default: {DEFAULT_OUT_DIR} for tinystories, else the current folder)")
    parser.add_argument("--repo-type", choices=REPO_TYPES, default="dataset",
                        help="kind of Hub repository of an hf: file (default: dataset)")
    parser.add_argument("--revision", metavar="REV", help="branch, tag or commit of an hf: file (default: main)")
    parser.add_argument("--sha256", metavar="HEX", help="a URL's expected sha256, checked after the transfer")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (there is none off a terminal)")
    parser.set_defaults(func=_download_command)


def _download_command(args) -> int:
    if args.quiet:
        require_hub("scratchlm data download")
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()  # for the rest of this process, which is this command
    for path in _download_source(args):
        print(f"{path}  ({path.stat().st_size:,} bytes)")
    return 0


def _download_source(args) -> list[Path]:
    source = args.source
    is_url = urllib.parse.urlsplit(source).scheme in ("http", "https")
    if args.sha256 is not None and not is_url:
        raise DownloadError("--sha256 is for a URL (Hub files are checked against the Hub's size; the TinyStories "
                            "files are pinned already)")
    if (args.revision is not None or args.repo_type != "dataset") and not source.startswith("hf:"):
        raise DownloadError("--revision and --repo-type are for an hf:OWNER/NAME/PATH file")
    if source == "tinystories":
        return download_tinystories(args.out or DEFAULT_OUT_DIR)
    out = args.out or Path(".")
    if source.startswith("hf:"):
        return [download_hub_file(HubFile.parse(source, repo_type=args.repo_type, revision=args.revision), out)]
    if is_url:
        return [download_url(source, out, sha256=args.sha256)]
    raise DownloadError(f"{source!r} is neither `tinystories`, an hf:OWNER/NAME/PATH file nor an http(s) URL")

