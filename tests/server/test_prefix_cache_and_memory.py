"""Radix prefix cache and memory limits through a real server (#5): cached_tokens is
what a user expects, flushing, concurrency, and refusals. Outputs under every scheduling
flag and retraction under a small pool are tested in-process (tests/unit/test_scheduling.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from http_helpers import assert_memory_idle
from server_launcher import ServerHandle

GREEDY = {"temperature": 0, "max_new_tokens": 24}
SYSTEM = (
    "You are a helpful assistant who answers questions about the weather, the sea, "
    "and small animals in a friendly and careful way. "
)
PROMPTS = [
    SYSTEM + q
    for q in [
        "What is rain?",
        "Why is the sea salty?",
        "Do cats like boats?",
        "Tell me about clouds.",
        "What do rabbits eat?",
        "Is fog cold?",
    ]
]
PROMPTS += ["A completely different prompt with no shared prefix at all.", SYSTEM]


async def _concurrent(base_url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        return await asyncio.gather(*[client.post("/generate", json=b) for b in bodies])


def run_all(base_url: str, prompts: list[str], params: dict) -> list[dict]:
    responses = asyncio.run(_concurrent(base_url, [{"text": p, "sampling_params": params} for p in prompts]))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    return [r.json() for r in responses]


def assert_idle_invariant(base_url: str) -> dict:
    with httpx.Client(base_url=base_url, timeout=30) as client:
        return assert_memory_idle(client)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Outputs of the default server (radix cache, default chunked prefill, fcfs), one at a time."""
    with ServerHandle(tiny_llama_dir) as server:
        outs = [run_all(server.base_url, [p], GREEDY)[0] for p in PROMPTS]
        yield server, [o["output_ids"] for o in outs]


def test_cached_tokens_and_flush(reference, tiny_llama_dir):
    server, _ = reference
    base = server.base_url
    assert httpx.post(base + "/flush_cache").status_code == 200
    prompt = PROMPTS[0] + " again"
    first = run_all(base, [prompt], GREEDY)[0]
    second = run_all(base, [prompt], GREEDY)[0]
    n = first["meta_info"]["prompt_tokens"]
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == n - 1  # all but the last prompt token
    assert second["output_ids"] == first["output_ids"]
    assert httpx.post(base + "/flush_cache").status_code == 200
    assert assert_idle_invariant(base)["evictable_cached_slots"] == 0
    third = run_all(base, [prompt], GREEDY)[0]
    assert third["meta_info"]["cached_tokens"] == 0
    # A shared system prompt is reused by a different question.
    other = run_all(base, [PROMPTS[0].replace("rain", "snow")], GREEDY)[0]
    assert other["meta_info"]["cached_tokens"] >= len(SYSTEM.split()) // 2


def test_flush_refused_while_running(reference):
    server, _ = reference

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            long = asyncio.create_task(
                client.post(
                    "/generate",
                    json={"text": "keep going", "sampling_params": {"max_new_tokens": 1800, "ignore_eos": True}},
                )
            )
            while (await client.get("/server_info")).json()["num_running_reqs"] == 0:
                await asyncio.sleep(0.05)
            flush = await client.post("/flush_cache")
            return flush, await long

    flush, long = asyncio.run(run())
    assert flush.status_code == 400 and "running" in flush.json()["error"]["message"]
    assert long.status_code == 200
    assert_idle_invariant(server.base_url)


def test_concurrent_shared_prefixes_match_sequential(reference):
    server, expected = reference
    outs = run_all(server.base_url, PROMPTS, GREEDY)
    assert [o["output_ids"] for o in outs] == expected
    assert any(o["meta_info"]["cached_tokens"] > 0 for o in outs)
    assert_idle_invariant(server.base_url)


def test_prompt_longer_than_the_pool_is_refused(tiny_llama_dir):
    """Refused at once with 400, and the server goes on. (Retraction under a small pool,
    and outputs under every scheduling flag, are tested in-process: tests/unit/test_scheduling.py.)"""
    with ServerHandle(tiny_llama_dir, extra_args=["--skip-server-warmup", "--max-total-tokens", "400"]) as server:
        r = httpx.post(server.base_url + "/generate", json={"text": "word " * 500}, timeout=30)
        assert r.status_code == 400 and "KV" in r.json()["error"]["message"]
        assert run_all(server.base_url, [PROMPTS[0]], GREEDY)[0]["meta_info"]["completion_tokens"] > 0
        assert_idle_invariant(server.base_url)


def test_max_queued_requests_gives_503(tiny_llama_dir):
    with ServerHandle(
        tiny_llama_dir, extra_args=["--skip-server-warmup", "--max-running-requests", "1", "--max-queued-requests", "1"]
    ) as server:
        bodies = [
            {"text": f"queue {i}", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}} for i in range(5)
        ]
        responses = asyncio.run(_concurrent(server.base_url, bodies))
        codes = sorted(r.status_code for r in responses)
        assert 503 in codes and 200 in codes
        # SGLang's answer, in its error shape (with Tandem's error object).
        for r in (r for r in responses if r.status_code == 503):
            assert r.json()["error"]["message"] == "The request queue is full."
            assert r.json()["object"] == "error" and r.json()["code"] == 503
        assert all(len(r.json()["output_ids"]) == 200 for r in responses if r.status_code == 200)
        assert_idle_invariant(server.base_url)

        async def streamed() -> list[int]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:

                async def one(i: int) -> int:
                    async with client.stream("POST", "/generate", json={**bodies[i], "stream": True}) as r:
                        await r.aread()
                        return r.status_code

                return await asyncio.gather(*[one(i) for i in range(5)])

        codes = asyncio.run(streamed())
        assert 503 in codes and 200 in codes, codes
        assert_idle_invariant(server.base_url)

        # The OpenAI routes answer a refusal with 503 in OpenAI's error shape, streamed or not.
        async def openai_routes(stream: bool) -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:

                async def one(i: int) -> httpx.Response:
                    route, body = (
                        ("/v1/completions", {"prompt": f"queue {i}"})
                        if i % 2
                        else ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"q {i}"}]})
                    )
                    body = {
                        **body,
                        "model": str(tiny_llama_dir),
                        "max_tokens": 200,
                        "ignore_eos": True,
                        "stream": stream,
                    }
                    async with client.stream("POST", route, json=body) as r:
                        await r.aread()
                        return r

                return await asyncio.gather(*[one(i) for i in range(6)])

        for stream in (False, True):
            responses = asyncio.run(openai_routes(stream))
            codes = sorted(r.status_code for r in responses)
            assert 503 in codes and 200 in codes, (stream, codes)
            for r in responses:
                if r.status_code == 503:
                    err = r.json()
                    assert err["object"] == "error" and err["message"] == "The request queue is full.", err
                    assert err["type"] == "ServiceUnavailableError"
                elif stream:
                    assert r.text.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in r.text
                else:
                    assert r.json()["usage"]["completion_tokens"] == 200
            assert_idle_invariant(server.base_url)
