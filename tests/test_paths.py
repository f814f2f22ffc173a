"""Where the shared corpora are looked for: $SCRATCHLM_DATA_DIR first, each folder named once."""

from __future__ import annotations

from pathlib import Path

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
