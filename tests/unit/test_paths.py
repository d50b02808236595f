"""tandem.tools.paths: the stories260K copy shipped in assets/ (with its licence), and the
TANDEM_STORIES_DIR override."""

from __future__ import annotations

import hashlib

import pytest

from tandem.tools.paths import STORIES_ENV_VAR, STORIES_FILES, repo_root, stories260k_dir

SHA256 = {
    "stories260K.bin": "b0a507e7ad0f626624f17112325e66691f9076d622e1d3274d103d00299f2696",
    "tok512.bin": "037cb335abb25d1fa9e8ecae30ed2a3a8ace9302862ebcdc05d51a6bbb10c312",
}


def test_shipped_copy_is_llama2c_unchanged_with_its_licence(monkeypatch):
    monkeypatch.delenv(STORIES_ENV_VAR, raising=False)
    directory = stories260k_dir()
    assert directory == repo_root() / "assets" / "stories260K"
    for name in STORIES_FILES:
        assert hashlib.sha256((directory / name).read_bytes()).hexdigest() == SHA256[name]
    licence = (directory / "LICENSE").read_text()
    assert licence.startswith("MIT License") and "Copyright (c) 2023 Andrej" in licence


def test_override_and_missing_files(monkeypatch, tmp_path):
    monkeypatch.setenv(STORIES_ENV_VAR, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="stories260K.bin, tok512.bin not found"):
        stories260k_dir()
    for name in STORIES_FILES:
        (tmp_path / name).write_bytes(b"x")
    assert stories260k_dir() == tmp_path.resolve()
