"""Bounded load (#8): hundreds of concurrent streams, a fifth of the clients leaving at
random points and sending again at once with the same rid. No response is lost, the
server stays healthy, and the idle memory invariant holds afterwards. Idle connections
stay open past the time clients reuse them."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import select

import httpx
from http_helpers import DUPLICATE_RID, assert_memory_idle

NUM_CLIENTS = 250
SEED = 8


async def _stream(ac: httpx.AsyncClient, body: dict, leave_after: int | None) -> dict | None:
    """Stream /generate; the last chunk, or None when leaving after `leave_after` chunks.
    A 400 for a rid still running (an earlier stream not yet noticed gone) is retried."""
    while True:
        async with ac.stream("POST", "/generate", json=body) as r:
            if r.status_code == 400:
                text = (await r.aread()).decode()
                assert DUPLICATE_RID in text, text
                await asyncio.sleep(0.01)
                continue
            assert r.status_code == 200, (r.status_code, await r.aread())
            last, chunks = None, 0
            async for line in r.aiter_lines():
                if leave_after is not None and chunks >= leave_after:
                    return None  # disconnect
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[6:])
                    chunks += 1
            return last


async def _client(ac: httpx.AsyncClient, i: int, rng: random.Random) -> list[tuple[dict, dict | None]]:
    """One client: its request bodies and their last chunks (None for the one it left)."""
    max_new = rng.randint(4, 16)
    body = {
        "text": f"load test prompt {i} " * rng.randint(1, 4),
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 1.0},
    }
    if i % 5:
        return [(body, await _stream(ac, body, None))]
    body["rid"] = f"load-{i}"
    await _stream(ac, body, leave_after=rng.randint(0, max_new - 1))
    return [(body, await _stream(ac, body, None))]  # the same rid again, at once


def test_hundreds_of_streams_with_disconnects_and_reused_rids(server, client):
    rng = random.Random(SEED)

    async def run() -> list[tuple[dict, dict | None]]:
        limits = httpx.Limits(max_connections=2 * NUM_CLIENTS, max_keepalive_connections=2 * NUM_CLIENTS)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as ac:
            per_client = await asyncio.gather(*(_client(ac, i, rng) for i in range(NUM_CLIENTS)))
        return [answer for answers in per_client for answer in answers]

    answers = asyncio.run(run())
    assert len(answers) == NUM_CLIENTS
    for body, last in answers:
        assert last is not None, body  # nothing lost
        max_new = body["sampling_params"]["max_new_tokens"]
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": max_new}, (body, last)
        assert len(last["output_ids"]) == max_new
        assert last["meta_info"]["id"] == body.get("rid", last["meta_info"]["id"])
    assert client.get("/health").status_code == 200
    assert_memory_idle(client)


HTTPX_KEEPALIVE_EXPIRY_S = 5.0  # httpx's default (the openai client's too)


def test_an_idle_connection_outlives_the_clients_keep_alive(server):
    """The server keeps an idle connection open past the time clients reuse one: a client
    must never send on a connection the server is closing (a reset under load)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().read() is not None
        readable, _, _ = select.select([conn.sock], [], [], HTTPX_KEEPALIVE_EXPIRY_S + 1)
        assert not readable, "the server closed an idle connection that clients still reuse"
        conn.request("GET", "/health")  # the same connection, still served
        assert conn.getresponse().status == 200
    finally:
        conn.close()
