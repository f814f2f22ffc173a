"""The Hugging Face Hub, through huggingface_hub: fetch one file of a repository, push one folder to one.

Used by `scratchlm data download hf:OWNER/NAME/PATH` (and `tinystories`) and `scratchlm export hf --push-to-hub`.
huggingface_hub speaks the Hub's protocol: ``hf_hub_download`` caches files under their ETag (``HF_HUB_CACHE``; an
unchanged file is not transferred again, an offline rerun is served from the cache), checks and resumes
transfers; ``create_repo`` + ``upload_folder`` commit a folder; the token is its usual one (``HF_TOKEN`` or
`hf auth login`), ``HF_ENDPOINT`` names a mirror. This module adds the ``hf:OWNER/NAME/PATH`` spelling, and turns
every failure (huggingface_hub's errors and its HTTP client's, whose classes change between its versions) into
one line that names the file or repository and says what to do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from scratchlm.errors import UserError
from scratchlm.extras import require

REPO_TYPES = ("dataset", "model")


class HubError(UserError):
    """The Hub refused a request or could not be reached; the message names the file or repository."""


def require_hub(feature: str) -> ModuleType:
    """huggingface_hub, or a one-line MissingExtra naming the [hub] extra."""
    return require("huggingface_hub", "hub", feature)


@dataclass(frozen=True)
class HubFile:
    """One file of a repository on the Hub; ``filename`` may lie in folders (``data/train.txt``)."""

    repo_id: str  # OWNER/NAME
    filename: str
    repo_type: str = "dataset"
    revision: str | None = None  # a branch, tag or commit; None is the default branch (main)

    @classmethod
    def parse(cls, source: str, *, repo_type: str = "dataset", revision: str | None = None) -> HubFile:
        """``hf:OWNER/NAME/PATH``: the first two parts name the repository, the rest the file in it."""
        owner, _, rest = source.removeprefix("hf:").partition("/")
        name, _, filename = rest.partition("/")
        if not (source.startswith("hf:") and owner and name and filename.strip("/")):
            raise HubError(f"{source!r} is not hf:OWNER/NAME/PATH (a file of a Hub repository, e.g. "
                           f"hf:roneneldan/TinyStories/TinyStoriesV2-GPT4-valid.txt)")
        if repo_type not in REPO_TYPES:
            raise HubError(f"repository type {repo_type!r} is not one of {', '.join(REPO_TYPES)}")
        return cls(f"{owner}/{name}", filename, repo_type, revision)

    def __str__(self) -> str:
        return f"hf:{self.repo_id}/{self.filename} ({self.repo_type}, revision {self.revision or 'main'})"


def fetch(file: HubFile) -> Path:
    """The path of ``file`` in the Hugging Face cache, downloaded first when it is missing there or has changed."""
    hub = require_hub(f"downloading {file}")
    with one_line_errors(str(file)):
        cached = hub.hf_hub_download(file.repo_id, file.filename, repo_type=file.repo_type, revision=file.revision)
    return Path(cached)


def push_folder(folder: Path, repo_id: str, *, private: bool = False) -> str:
    """Upload every file in ``folder`` to the model repository ``repo_id`` (created when missing, private when
    ``private``) in one commit; returns the commit's URL."""
    hub = require_hub("pushing to the Hugging Face Hub")
    api = hub.HfApi()
    with one_line_errors(f"pushing {folder} to {repo_id}"):
        api.create_repo(repo_id, private=private or None, exist_ok=True)  # None: the Hub's default visibility
        commit = api.upload_folder(repo_id=repo_id, folder_path=folder,
                                   commit_message=f"Upload {folder.name} (scratchlm export hf)")
    return commit.commit_url


@contextlib.contextmanager
def one_line_errors(subject: str) -> Iterator[None]:
    """Re-raise any failure of huggingface_hub inside the block as one HubError line: ``SUBJECT: what went wrong``.

    Keep the block to huggingface_hub calls: everything raised inside becomes a HubError (the original is kept as
    its ``__cause__`` for a debugger)."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 its own errors and its HTTP client's (httpx or httpx2, by version)
        raise HubError(f"{subject}: {describe(error)}") from error


def describe(error: Exception) -> str:
    """What went wrong, in one line, with what to do about it."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    login = "log in with `hf auth login` or set HF_TOKEN"
    if isinstance(error, GatedRepoError):  # a kind of RepositoryNotFoundError: asked first
        return f"the repository is gated: accept its conditions on the Hub, then {login}"
    if isinstance(error, RepositoryNotFoundError):
        return f"repository not found (a private one needs a login: {login}; is the repository type right?)"
    if isinstance(error, RevisionNotFoundError):
        return "the repository has no such revision (branch, tag or commit)"
    if isinstance(error, LocalEntryNotFoundError):  # a kind of EntryNotFoundError: asked first
        return (f"the Hub at {constants.ENDPOINT} cannot be reached and the file is not in the Hugging Face cache "
                f"(offline? HF_HUB_OFFLINE set? HF_ENDPOINT names a mirror)")
    if isinstance(error, EntryNotFoundError):
        return "the repository has no such file at this revision"
    if isinstance(error, HfHubHTTPError):
        status = error.response.status_code
        hint = {401: f" ({login})", 403: f" (does your token have write access? {login})"}.get(status, "")
        server = " ".join((error.server_message or "").split())  # the Hub's own words, when it sent some
        return f"HTTP {status}{hint}" + (f": {server}" if server else "")
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else 'no message'}"
