"""Locations of the model files that ship with the repository.

llama2.c's stories260K checkpoint (Karpathy, TinyStories; MIT licence) ships in
``<repo>/assets/stories260K`` with its licence notice; ``make serve`` converts it into
``models/stories260K``, its default model, and tests convert it per session. The
environment variable ``TANDEM_STORIES_DIR`` points elsewhere (a folder holding the
same two files).
"""

from __future__ import annotations

import os
from pathlib import Path

STORIES_ENV_VAR = "TANDEM_STORIES_DIR"
STORIES_FILES = ("stories260K.bin", "tok512.bin")


def repo_root() -> Path:
    """The repository root (the folder holding ``tandem/``)."""
    return Path(__file__).resolve().parents[2]


def stories260k_dir() -> Path:
    """The folder holding ``stories260K.bin`` and ``tok512.bin``: ``$TANDEM_STORIES_DIR``
    when set, else the copy shipped in ``<repo>/assets/stories260K``.

    Raises FileNotFoundError naming the folder when a file is missing.
    """
    override = os.environ.get(STORIES_ENV_VAR)
    directory = Path(override).expanduser().resolve() if override else repo_root() / "assets" / "stories260K"
    missing = [name for name in STORIES_FILES if not (directory / name).is_file()]
    if missing:
        raise FileNotFoundError(f"stories260K: {', '.join(missing)} not found in {directory}")
    return directory
