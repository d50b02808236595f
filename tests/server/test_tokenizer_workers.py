"""--tokenizer-worker-num 2 (#12): two HTTP worker processes share the port, and every
output reaches the worker that owns its request. Hundreds of concurrent requests of every
kind answer as the single-worker session server does (greedy); both workers serve;
aborts and control routes work whichever worker gets them; a dead worker takes the
server down; SIGTERM exits 0 leaving nothing behind."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import psutil
import pytest
from http_helpers import assert_memory_idle
from server_launcher import ServerHandle

API_KEY = "sk-workers"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NUM_REQUESTS = 240
LONG = {"max_new_tokens": 1500, "ignore_eos": True}


@pytest.fixture(scope="module")
def workers_server(tiny_llama_dir):
    with ServerHandle(tiny_llama_dir, ["--tokenizer-worker-num", "2", "--api-key", API_KEY]) as handle:
        yield handle


def _fresh_connections(base_url: str, headers: dict | None = None) -> httpx.AsyncClient:
    """A client that opens a new connection per request, so the kernel spreads them over
    the workers (a kept-alive connection stays with one worker)."""
    return httpx.AsyncClient(
        base_url=base_url,
        headers=headers or {},
        timeout=120,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
    )


def _request(i: int) -> tuple[str, dict]:
    params = {"temperature": 0, "max_new_tokens": 8}
    prompt = f"Request number {i} says"
    kind = i % 6
    if kind == 0:
        return "/generate", {"text": prompt, "sampling_params": params}
    if kind == 1:
        return "/generate", {"text": prompt, "sampling_params": params, "stream": True}
    if kind == 2:
        return "/generate", {"text": prompt, "sampling_params": {**params, "n": 2}}
    chat = {"model": "m", "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 8}
    if kind == 3:
        return "/v1/chat/completions", chat
    if kind == 4:
        return "/v1/chat/completions", {**chat, "stream": True}
    return "/v1/completions", {"model": "m", "prompt": prompt, "temperature": 0, "max_tokens": 8}


async def _result(ac: httpx.AsyncClient, path: str, body: dict):
    """What the client sees, in a comparable form: texts and ids (native), contents (OpenAI)."""
    if not body.get("stream"):
        r = await ac.post(path, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        if path == "/generate":
            outs = out if isinstance(out, list) else [out]
            return [(o["text"], o["output_ids"]) for o in outs]
        return [c.get("message", {}).get("content", c.get("text")) for c in out["choices"]]
    events = []
    async with ac.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    if path == "/generate":  # cumulative chunks: the last one holds everything
        return [(events[-1]["text"], events[-1]["output_ids"])]
    return ["".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])]


async def _run_all(base_url: str, headers: dict | None) -> list:
    async with _fresh_connections(base_url, headers) as ac:
        return await asyncio.gather(*(_result(ac, *_request(i)) for i in range(NUM_REQUESTS)))


def _worker_counts(base_url: str, tries: int = 60) -> dict[int, int]:
    """tokenizer_worker_id -> requests it has sent, from /server_info on fresh connections."""
    seen: dict[int, int] = {}
    for _ in range(tries):
        info = httpx.get(base_url + "/server_info", headers=AUTH, timeout=10).json()
        seen[info["tokenizer_worker_id"]] = info["tokenizer_worker_num_requests"]
        if len(seen) == 2:
            break
    return seen


def test_concurrent_requests_match_the_single_worker_server(workers_server, server):
    with_workers = asyncio.run(_run_all(workers_server.base_url, AUTH))
    single = asyncio.run(_run_all(server.base_url, None))
    assert len(with_workers) == NUM_REQUESTS
    mismatched = [i for i in range(NUM_REQUESTS) if with_workers[i] != single[i]]
    assert not mismatched, [(i, _request(i), with_workers[i], single[i]) for i in mismatched[:3]]
    counts = _worker_counts(workers_server.base_url)
    assert sorted(counts) == [0, 1] and all(n > 0 for n in counts.values()), counts
    with httpx.Client(base_url=workers_server.base_url, headers=AUTH) as c:
        assert_memory_idle(c)


def test_api_key_health_and_control_routes_on_every_worker(workers_server, tmp_path):
    for _ in range(8):  # fresh connections: both workers answer
        assert httpx.post(workers_server.base_url + "/generate", json={"text": "hi"}).status_code == 401
        assert httpx.get(workers_server.base_url + "/health").status_code == 200
        assert httpx.get(workers_server.base_url + "/health_generate", timeout=30).status_code == 200
        r = httpx.post(workers_server.base_url + "/flush_cache", headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
    r = httpx.post(
        workers_server.base_url + "/start_profile", headers=AUTH, timeout=60, json={"output_dir": str(tmp_path)}
    )
    assert r.status_code == 200, r.text
    r = httpx.post(workers_server.base_url + "/stop_profile", headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert list(tmp_path.glob("*.trace.json.gz"))


def test_abort_by_rid_reaches_the_owner_from_any_worker(workers_server):
    """Six long requests and six aborts by label, each on its own connection: about half
    of the aborts land on the worker that does not own the request."""
    labels = [f"w-abort-{i}" for i in range(6)]

    async def run() -> list[dict]:
        async with _fresh_connections(workers_server.base_url, AUTH) as ac:
            tasks = [
                asyncio.create_task(ac.post("/generate", json={"text": label, "rid": label, "sampling_params": LONG}))
                for label in labels
            ]
            while (await ac.get("/server_info")).json()["num_running_reqs"] < len(labels):
                await asyncio.sleep(0.05)
            for label in labels:
                assert (await ac.post("/abort_request", json={"rid": label})).status_code == 200
            return [(await t).json() for t in tasks]

    results = asyncio.run(run())
    assert [r["meta_info"]["id"] for r in results] == labels
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results), results
    with httpx.Client(base_url=workers_server.base_url, headers=AUTH) as c:
        assert_memory_idle(c)


def test_abort_all_from_one_worker_stops_every_worker_s_requests(workers_server):
    async def run() -> list[dict]:
        async with _fresh_connections(workers_server.base_url, AUTH) as ac:
            tasks = [
                asyncio.create_task(ac.post("/generate", json={"text": f"all {i}", "sampling_params": LONG}))
                for i in range(6)
            ]
            while (await ac.get("/server_info")).json()["num_running_reqs"] < 6:
                await asyncio.sleep(0.05)
            assert (await ac.post("/abort_request", json={"abort_all": True})).status_code == 200
            return [(await t).json() for t in tasks]

    results = asyncio.run(run())
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results), results


def test_workers_are_named_and_sigterm_exits_0_leaving_nothing(workers_server):
    children = psutil.Process(workers_server.proc.pid).children()
    titles = sorted(" ".join(p.cmdline()).strip() for p in children if "tokenizer_worker" in " ".join(p.cmdline()))
    assert titles == ["tandem::tokenizer_worker_0", "tandem::tokenizer_worker_1"]
    assert workers_server.stop(signal.SIGTERM) == []
    assert workers_server.proc.returncode == 0, workers_server.log_tail()
    assert workers_server.stop_seconds < 10
    assert not workers_server.ipc_dirs()


def test_a_dead_worker_takes_the_server_down(tiny_llama_dir):
    with ServerHandle(tiny_llama_dir, ["--tokenizer-worker-num", "2", "--skip-server-warmup"]) as server:
        worker = next(
            p for p in psutil.Process(server.proc.pid).children() if "tokenizer_worker_1" in " ".join(p.cmdline())
        )
        worker.kill()
        deadline = time.monotonic() + 20
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.proc.returncode == 1, server.log_tail()
    assert not server.ipc_dirs()
