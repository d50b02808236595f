"""Shared fixtures: tiny models built once per session, the stories260K model shipped in
assets/ (converted once per session), and the Hugging Face reference used to check outputs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernels run under Triton's interpreter, which must be chosen
# before anything imports Triton (xgrammar and torch.compile do): set once, here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionfinish(session, exitstatus):
    """Stop any server a failed test left running."""
    from server_launcher import LIVE

    for handle in list(LIVE):
        handle.stop(check=False)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from tandem.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", arch="llama")


@pytest.fixture(scope="session")
def tiny_llama_b_dir(tmp_path_factory) -> Path:
    """The tiny llama's architecture with other weights (another seed): weight updates."""
    from tandem.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama-b", arch="llama", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    from tandem.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", arch="qwen2")


@pytest.fixture(scope="session")
def tiny_mqa_dir(tmp_path_factory) -> Path:
    """The tiny llama's shape with one KV head: tensor parallelism replicates it."""
    from tandem.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-mqa", arch="llama", preset="tiny-mqa")


@pytest.fixture(scope="session")
def stories_dir(tmp_path_factory) -> Path:
    from tandem.tools.convert_llama2c import convert_llama2c
    from tandem.tools.paths import stories260k_dir

    src = stories260k_dir()  # the copy shipped in assets/stories260K
    return convert_llama2c(
        src / "stories260K.bin", src / "tok512.bin", tmp_path_factory.mktemp("models") / "stories260K"
    )


@pytest.fixture(scope="session")
def tiny_llama_gguf_dir(tmp_path_factory) -> Path:
    """make_tiny_model's llama with every matrix dimension a multiple of 256, so that every
    GGUF block type applies to every weight (tests write GGUF files from it)."""
    from tandem.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama-gguf", arch="llama", preset="gguf")
