"""Locations of optional, read-only model files shared outside the repository.

The real stories260K checkpoint (Karpathy's llama2.c, TinyStories) lives next to
the repository, in ``<repo>/../shared/models/stories260K``; the environment
variable ``TANDEM_STORIES_DIR`` overrides that location. Tests that need the
files call :func:`stories260k_dir` and skip when it returns ``None``.
"""

from __future__ import annotations

import os
from pathlib import Path

STORIES_ENV_VAR = "TANDEM_STORIES_DIR"
STORIES_FILES = ("stories260K.bin", "tok512.bin")


def repo_root() -> Path:
    """The repository root (the folder holding ``tandem/``)."""
    return Path(__file__).resolve().parents[2]


def _has_stories_files(directory: Path) -> bool:
    return all((directory / name).is_file() for name in STORIES_FILES)


def stories260k_dir() -> Path | None:
    """The stories260K folder, or ``None`` when its files are not available.

    ``TANDEM_STORIES_DIR`` wins when set (and is returned only if it holds the
    files); otherwise ``<repo>/../shared/models/stories260K`` is tried.
    """
    override = os.environ.get(STORIES_ENV_VAR)
    if override:
        candidate = Path(override).expanduser().resolve()
        return candidate if _has_stories_files(candidate) else None
    candidate = (repo_root() / ".." / "shared" / "models" / "stories260K").resolve()
    return candidate if _has_stories_files(candidate) else None
