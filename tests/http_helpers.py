"""Small HTTP helpers shared by the server tests."""

from __future__ import annotations

import json
import time

import httpx

# The start of the 400 message for a rid that a running request already uses (SGLang's words).
DUPLICATE_RID = "Duplicate request ID detected: "


def generate(client: httpx.Client, **body) -> dict:
    """POST /generate and return the JSON body, asserting a 200."""
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream_events(client: httpx.Client, path: str, body: dict) -> list[dict]:
    """POST a streaming request; return its SSE events' JSON, asserting a 200 event stream
    that ends with `data: [DONE]`."""
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines[:-1]), lines
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


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
    """Wait until idle, then check the idle invariant (docs/architecture.md, "KV memory and the
    radix cache"): every KV slot is free or an unlocked cached slot, and nothing is locked."""
    info = wait_idle(client, timeout)
    assert info["free_kv_slots"] + info["evictable_cached_slots"] == info["max_total_num_tokens"], info
    assert info["protected_cached_slots"] == 0, info
    return info
