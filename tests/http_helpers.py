"""Small HTTP helpers shared by the server tests."""

from __future__ import annotations

import time

import httpx

# The start of the 400 message for a rid that a running request already uses (SGLang's words).
DUPLICATE_RID = "Duplicate request ID detected: "


def generate(client: httpx.Client, **body) -> dict:
    """POST /generate and return the JSON body, asserting a 200."""
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(client: httpx.Client, timeout: float = 20.0) -> dict:
    """Poll /server_info until nothing runs or waits; return it."""
    deadline = time.monotonic() + timeout
    while True:
        info = client.get("/server_info").json()
        if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.1)


def assert_memory_idle(client: httpx.Client, timeout: float = 20.0) -> dict:
    """Wait until idle, then check DESIGN.md §5's invariant: every KV slot is free or an
    unlocked cached slot, and nothing is locked."""
    info = wait_idle(client, timeout)
    assert info["free_kv_slots"] + info["evictable_cached_slots"] == info["max_total_num_tokens"], info
    assert info["protected_cached_slots"] == 0, info
    return info
