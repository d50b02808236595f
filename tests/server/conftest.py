"""A default server on the tiny llama model, shared by the server tests that need no
special flags (one start for the session instead of one per module)."""

from __future__ import annotations

import httpx
import pytest
from server_launcher import ServerHandle


@pytest.fixture(scope="session")
def server(tiny_llama_dir, tmp_path_factory):
    # Profiles asked for without an output_dir go to a test directory, not /tmp.
    profiles = tmp_path_factory.mktemp("profiles")
    with ServerHandle(tiny_llama_dir, env={"TANDEM_TORCH_PROFILER_DIR": str(profiles)}) as handle:
        yield handle


@pytest.fixture(scope="session")
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c
