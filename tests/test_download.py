"""`scratchlm data download`: huggingface_hub's real code against a local fake Hub (tests/fake_hub.py; no internet).

What runs is what runs against huggingface.co: a HEAD for the ETag and commit, a GET (resumed with Range when cut
short), the Hugging Face cache, and huggingface_hub's own error classes, turned into one line each.
"""

from __future__ import annotations

import errno
import hashlib
import os
import socket
import sys
from pathlib import Path

import pytest

from fake_hub import COMMIT, TOKEN, serve
from scratchlm.cli import main
from scratchlm.data import download
from scratchlm.data.download import DownloadError, Expected, download_hub_file, download_tinystories, download_url
from scratchlm.hub import HubError, HubFile

pytest.importorskip("huggingface_hub")

FILES = ("TinyStoriesV2-GPT4-train.txt", "TinyStoriesV2-GPT4-valid.txt")
TRAIN = ("Once upon a time, a cat sat. <|endoftext|>\n" * 3000).encode()
VALID = "Lily saw a bird – “hi” 🐦\n<|endoftext|>\n".encode() * 50
REAL_PINNED = dict(download.PINNED)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A fake Hub holding small stand-ins for the two TinyStories files, unpinned unless a test pins them."""
    monkeypatch.setattr(download, "PINNED", {})
    with serve(tmp_path, monkeypatch) as fake:
        fake.add("roneneldan/TinyStories", {FILES[0]: TRAIN, FILES[1]: VALID})
        yield fake


def _resolve(name: str) -> str:
    return f"/datasets/roneneldan/TinyStories/resolve/main/{name}"


def _entries(folder: Path) -> list[str]:
    """Everything in ``folder``, hidden temporary files too ([] when it does not exist)."""
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _dead_port() -> int:
    with socket.socket() as sock:  # a port that nothing listens on once this closes
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _point_at(monkeypatch, url: str) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")


def _no_backoff(monkeypatch) -> None:
    """huggingface_hub waits 1, 2, 4, 8, 8 s between retries of an unreachable server; the test need not."""
    import time

    monkeypatch.setattr(time, "sleep", lambda seconds: None)


# ------------------------------------------------------------------------------------------ Hub files

def test_tinystories_downloads_both_files_exactly(hub, tmp_path):
    out = tmp_path / "out"
    assert download_tinystories(out) == [out / name for name in FILES]
    assert (out / FILES[0]).read_bytes() == TRAIN and (out / FILES[1]).read_bytes() == VALID
    assert _entries(out) == sorted(FILES)  # no temporary file left
    assert hub.gets() == [(_resolve(name), None) for name in FILES]


def test_the_file_is_a_hard_link_to_the_cached_copy_else_a_copy(hub, tmp_path, monkeypatch):
    download_tinystories(tmp_path / "linked", files=FILES[1:])
    assert (tmp_path / "linked" / FILES[1]).stat().st_nlink == 2  # one file on disk, two names

    def no_hard_links(source, target):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_hard_links)
    download_tinystories(tmp_path / "copied", files=FILES[1:])
    copied = tmp_path / "copied" / FILES[1]
    assert copied.read_bytes() == VALID and copied.stat().st_nlink == 1
    assert _entries(tmp_path / "copied") == [FILES[1]]


def test_rerun_transfers_nothing_and_keeps_the_file(hub, tmp_path):
    out = tmp_path / "out"
    download_tinystories(out)
    inodes = [(out / name).stat().st_ino for name in FILES]
    hub.requests.clear()
    download_tinystories(out)
    assert hub.gets() == [] and [method for method, *_ in hub.requests] == ["HEAD", "HEAD"]
    assert [(out / name).stat().st_ino for name in FILES] == inodes


def test_offline_rerun_is_served_from_the_cache(hub, tmp_path, monkeypatch):
    download_tinystories(tmp_path / "first")
    _point_at(monkeypatch, f"http://127.0.0.1:{_dead_port()}")
    assert download_tinystories(tmp_path / "again")[1].read_bytes() == VALID


def _small_blocks(monkeypatch) -> None:
    """huggingface_hub writes what arrives in 10 MB blocks and resumes after the last whole block it wrote; blocks
    of 256 bytes let a small file show it."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 256)


def test_transfer_cut_short_is_resumed_with_a_range_request(hub, tmp_path, monkeypatch):
    _no_backoff(monkeypatch)
    _small_blocks(monkeypatch)
    hub.cut_next_get_after = 4 * 256
    out = tmp_path / "out"
    download_tinystories(out, files=FILES[:1])
    assert (out / FILES[0]).read_bytes() == TRAIN
    assert hub.gets() == [(_resolve(FILES[0]), None), (_resolve(FILES[0]), "bytes=1024-")]


def test_a_present_file_with_the_same_bytes_is_kept(hub, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / FILES[1]).write_bytes(VALID)
    inode = (out / FILES[1]).stat().st_ino
    download_tinystories(out, files=FILES[1:])
    assert (out / FILES[1]).stat().st_ino == inode and (out / FILES[1]).read_bytes() == VALID


@pytest.mark.parametrize("present", [b"stale", VALID.replace(b"Lily", b"Lucy")])  # shorter; same size
def test_a_present_file_with_other_bytes_is_refused_and_left_alone(hub, tmp_path, present):
    out = tmp_path / "out"
    out.mkdir()
    (out / FILES[1]).write_bytes(present)
    with pytest.raises(DownloadError, match=rf"{FILES[1]} already exists and differs from "
                                            rf"hf:roneneldan/TinyStories/{FILES[1]} \(dataset, revision main\)"):
        download_tinystories(out, files=FILES[1:])
    assert (out / FILES[1]).read_bytes() == present and _entries(out) == [FILES[1]]


def test_model_repository_file_in_a_folder_at_a_commit(hub, tmp_path):
    hub.add("me/tiny", {"data/part-1.txt": b"first part\n"}, repo_type="model")
    file = HubFile.parse("hf:me/tiny/data/part-1.txt", repo_type="model", revision=COMMIT)
    assert download_hub_file(file, tmp_path / "out") == tmp_path / "out" / "part-1.txt"
    assert (tmp_path / "out" / "part-1.txt").read_bytes() == b"first part\n"
    assert hub.gets() == [(f"/me/tiny/resolve/{COMMIT}/data/part-1.txt", None)]  # no datasets/ prefix


def test_hub_requests_carry_the_token(hub, tmp_path):
    download_tinystories(tmp_path / "out", files=FILES[1:])
    assert {authorization for *_, authorization in hub.requests} == {f"Bearer {TOKEN}"}


@pytest.mark.parametrize("argv, says", [
    (["hf:nobody/nothing/a.txt"], "hf:nobody/nothing/a.txt (dataset, revision main): repository not found "
                                  "(a private one needs a login: log in with `hf auth login` or set HF_TOKEN; "
                                  "is the repository type right?)"),
    (["hf:roneneldan/TinyStories/a.txt"], "hf:roneneldan/TinyStories/a.txt (dataset, revision main): the "
                                          "repository has no such file at this revision"),
    (["hf:roneneldan/TinyStories/a.txt", "--repo-type", "model"], "(model, revision main): repository not found"),
    ([f"hf:roneneldan/TinyStories/{FILES[1]}", "--revision", "v9"], "(dataset, revision v9): the repository has no "
                                                                    "such revision (branch, tag or commit)"),
])
def test_hub_errors_are_one_line_naming_the_file(hub, tmp_path, capsys, argv, says):
    assert main(["data", "download", *argv, "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("scratchlm data: error: ") and says in err, err
    assert not (tmp_path / "out").exists()


def test_unreachable_hub_is_one_line(hub, tmp_path, monkeypatch):
    _no_backoff(monkeypatch)
    dead = f"http://127.0.0.1:{_dead_port()}"
    _point_at(monkeypatch, dead)
    with pytest.raises(HubError) as caught:
        download_tinystories(tmp_path / "out", files=FILES[1:])
    assert str(caught.value) == (f"hf:roneneldan/TinyStories/{FILES[1]} (dataset, revision main): the Hub at {dead} "
                                 "cannot be reached and the file is not in the Hugging Face cache (offline? "
                                 "HF_HUB_OFFLINE set? HF_ENDPOINT names a mirror)")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ pins

def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_real_pins_refuse_files_that_differ(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(download, "PINNED", REAL_PINNED)
    with pytest.raises(DownloadError, match=r"TinyStoriesV2-GPT4-train.txt \(dataset, revision main\) is not the "
                                            r"pinned file: expected 2,227,753,162 bytes, got 129,000"):
        download_tinystories(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_pinned_sha256_is_checked_before_the_file_gets_its_name(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(download, "PINNED", {FILES[1]: Expected(len(VALID), "0" * 64)})
    with pytest.raises(DownloadError, match=rf"failed its sha256 check: expected {'0' * 64}, got {_sha256(VALID)} "
                                            rf"\({len(VALID):,} bytes\)"):
        download_tinystories(tmp_path / "out", files=FILES[1:])
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(download, "PINNED", {FILES[1]: Expected(len(VALID), _sha256(VALID))})
    assert download_tinystories(tmp_path / "out", files=FILES[1:])[0].read_bytes() == VALID


# ------------------------------------------------------------------------------------------ plain URLs

def test_url_downloads_without_the_hub_token(hub, tmp_path):
    hub.plain["notes.txt"] = VALID
    path = download_url(f"{hub.url}/plain/notes.txt", tmp_path / "out", sha256=_sha256(VALID).upper())
    assert path == tmp_path / "out" / "notes.txt" and path.read_bytes() == VALID
    assert _entries(tmp_path / "out") == ["notes.txt"]
    assert [authorization for *_, authorization in hub.requests] == [None]  # the URL may be anybody's server


def test_url_with_the_wrong_sha256_leaves_nothing(hub, tmp_path):
    hub.plain["notes.txt"] = VALID
    with pytest.raises(DownloadError, match=rf"notes.txt failed its sha256 check: expected {'a' * 64}, got "):
        download_url(f"{hub.url}/plain/notes.txt", tmp_path / "out", sha256="a" * 64)
    assert not (tmp_path / "out").exists()


def test_url_cut_short_is_resumed(hub, tmp_path, monkeypatch):
    _no_backoff(monkeypatch)
    _small_blocks(monkeypatch)
    hub.plain["train.txt"] = TRAIN
    hub.cut_next_get_after = 2 * 256
    assert download_url(f"{hub.url}/plain/train.txt", tmp_path / "out").read_bytes() == TRAIN
    assert hub.gets() == [("/plain/train.txt", None), ("/plain/train.txt", "bytes=512-")]


def test_url_errors_are_one_line(hub, tmp_path, monkeypatch):
    with pytest.raises(HubError, match=rf"^{hub.url}/plain/missing.txt: HTTP 404: Not Found$"):
        download_url(f"{hub.url}/plain/missing.txt", tmp_path / "out")
    _no_backoff(monkeypatch)
    dead = f"http://127.0.0.1:{_dead_port()}/a.txt"
    with pytest.raises(HubError, match=rf"^{dead}: ConnectError: "):
        download_url(dead, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("url, says", [
    ("http://127.0.0.1:9/", "names no file"),
    ("http://127.0.0.1:9/f.txt", "--sha256 'abc' is not a sha256"),
])
def test_bad_url_arguments_are_one_line(tmp_path, url, says):
    with pytest.raises(DownloadError, match=says):
        download_url(url, tmp_path, sha256="abc")


# ------------------------------------------------------------------------------------------ the command

def test_command_prints_paths_and_sizes(hub, tmp_path, capsys):
    assert main(["data", "download", "tinystories", "--out", str(tmp_path / "o"), "--quiet"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{tmp_path / 'o' / FILES[0]}  (129,000 bytes)",
                                                    f"{tmp_path / 'o' / FILES[1]}  ({len(VALID):,} bytes)"]


def test_command_default_folders(hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["data", "download", "tinystories"]) == 0  # where the demo looks for it
    assert _entries(tmp_path / "data" / "tinystories") == sorted(FILES)
    assert main(["data", "download", f"hf:roneneldan/TinyStories/{FILES[1]}"]) == 0  # the current folder
    assert (tmp_path / FILES[1]).read_bytes() == VALID


@pytest.mark.parametrize("argv, says", [
    (["tinystories", "--sha256", "0" * 64], "--sha256 is for a URL"),
    (["hf:a/b/c.txt", "--sha256", "0" * 64], "--sha256 is for a URL"),
    (["tinystories", "--revision", "v1"], "--revision and --repo-type are for an hf:OWNER/NAME/PATH file"),
    (["http://127.0.0.1:9/a.txt", "--repo-type", "model"], "--revision and --repo-type are for an hf:"),
    (["owt"], "'owt' is neither `tinystories`, an hf:OWNER/NAME/PATH file nor an http(s) URL"),
    (["hf:roneneldan/TinyStories"], "'hf:roneneldan/TinyStories' is not hf:OWNER/NAME/PATH"),
])
def test_command_refuses_bad_arguments_in_one_line(tmp_path, capsys, argv, says):
    assert main(["data", "download", *argv, "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("source", ["tinystories", "hf:a/b/c.txt", "https://example.org/a.txt"])
def test_without_the_hub_extra_one_line_names_it(tmp_path, capsys, monkeypatch, source):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # as if not installed
    assert main(["data", "download", source, "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs the huggingface_hub package" in err and "scratchlm[hub]" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("source, repo_id, filename", [
    ("hf:roneneldan/TinyStories/TinyStoriesV2-GPT4-valid.txt", "roneneldan/TinyStories",
     "TinyStoriesV2-GPT4-valid.txt"),
    ("hf:me/data/folder/sub/file.jsonl", "me/data", "folder/sub/file.jsonl"),
])
def test_hub_file_spelling(source, repo_id, filename):
    assert HubFile.parse(source) == HubFile(repo_id, filename, "dataset", None)


@pytest.mark.parametrize("source", ["hf:", "hf:me", "hf:me/data", "hf:me/data/", "hf:/data/a.txt", "hf:me//a.txt",
                                    "me/data/a.txt"])
def test_hub_file_spelling_refused(source):
    with pytest.raises(HubError, match=r"is not hf:OWNER/NAME/PATH"):
        HubFile.parse(source)
