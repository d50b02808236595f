"""Request identity (#8 item 2): inside the server a request is known by an internal id
that is never reused; the client's `rid` is a label echoed back in meta_info["id"]."""

from __future__ import annotations

import asyncio

import httpx
from http_helpers import DUPLICATE_RID, assert_memory_idle

LONG = {"max_new_tokens": 1500, "ignore_eos": True}


async def _post_until_admitted(ac: httpx.AsyncClient, body: dict) -> httpx.Response:
    """POST /generate, retrying while the server still runs an earlier request with the
    same rid (it answers 400 until it has noticed that client's disconnect)."""
    while True:
        r = await ac.post("/generate", json=body)
        if r.status_code != 400 or DUPLICATE_RID not in r.text:
            return r
        await asyncio.sleep(0.01)


def test_reused_rid_never_gets_the_old_requests_abort(server, client):
    async def run() -> list[httpx.Response]:
        answers = []
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as ac:
            for _ in range(10):
                async with ac.stream(
                    "POST",
                    "/generate",
                    json={"text": "reused rid", "rid": "reused", "stream": True, "sampling_params": LONG},
                ) as r:
                    chunks = 0
                    async for line in r.aiter_lines():
                        chunks += line.startswith("data: ")
                        if chunks >= 2:
                            break  # disconnect mid-stream
                answers.append(
                    await _post_until_admitted(
                        ac,
                        {
                            "text": "reused rid",
                            "rid": "reused",
                            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
                        },
                    )
                )
        return answers

    for r in asyncio.run(run()):
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["id"] == "reused"
        assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert_memory_idle(client)


def test_rid_of_a_running_request_is_refused_and_abort_by_rid_stops_it(server, client):
    async def run() -> tuple[httpx.Response, dict]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as ac:
            first = asyncio.create_task(
                ac.post("/generate", json={"text": "first", "rid": "busy", "sampling_params": LONG})
            )
            while (await ac.get("/server_info")).json()["num_running_reqs"] < 1:
                await asyncio.sleep(0.02)
            second = await ac.post("/generate", json={"text": "second", "rid": "busy"})
            assert (await ac.post("/abort_request", json={"rid": "busy"})).status_code == 200
            return second, (await first).json()

    second, first = asyncio.run(run())
    assert second.status_code == 400 and second.json()["error"]["message"] == DUPLICATE_RID + "busy"
    assert first["meta_info"]["id"] == "busy"
    assert first["meta_info"]["finish_reason"]["type"] == "abort"
    assert_memory_idle(client)
