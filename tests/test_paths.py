"""Where the shared corpora are looked for: $SCRATCHLM_DATA_DIR first, each folder named once."""

from __future__ import annotations

from pathlib import Path

import pytest

from scratchlm import paths


def test_env_var_wins_and_each_folder_is_listed_once(tmp_path, monkeypatch):
    (tmp_path / "fixtures").mkdir()
    (tmp_path / "fixtures" / "a.txt").write_text("x")
    monkeypatch.setenv(paths.DATA_DIR_ENV, str(tmp_path))
    monkeypatch.chdir(Path(paths.__file__).resolve().parents[2])  # the checkout: cwd and source agree
    searched = paths.describe_search().split(", ")
    assert searched[0] == str(tmp_path)
    assert len(searched) == len(set(searched)) == 2
    assert paths.shared_data_dir() == tmp_path
    assert paths.shared_data_file("fixtures/a.txt") == tmp_path / "fixtures" / "a.txt"
    assert paths.shared_data_file("fixtures/missing.txt") is None


def test_env_var_naming_a_missing_folder_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.DATA_DIR_ENV, str(tmp_path / "typo"))
    with pytest.raises(FileNotFoundError, match=rf"{paths.DATA_DIR_ENV}=.*typo: no such folder"):
        paths.shared_data_file("fixtures/a.txt")


def test_without_env_var_and_shared_folder_nothing_is_found(tmp_path, monkeypatch):
    monkeypatch.delenv(paths.DATA_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)  # no shared/ beside the working directory
    monkeypatch.setattr(paths, "__file__", str(tmp_path / "src" / "scratchlm" / "paths.py"))  # nor the checkout
    assert paths.shared_data_dir() is None and paths.shared_data_file("fixtures/a.txt") is None
