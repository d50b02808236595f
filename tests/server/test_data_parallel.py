"""Data parallelism on a real server (--dp-size 2 --tp-size 2: two replicas of two TP
ranks each behind the data-parallel controller, --load-balance-method shortest_queue,
8-token prefill chunks, the radix cache and the overlap loop (--enable-overlap-schedule); round_robin and the
controller's routing are tested in-process in tests/unit/test_data_parallel_controller.py).

Concurrent greedy requests give --dp-size 1 --tp-size 1's outputs (the session server,
same model), prompts chunked and prefixes reused
and both replicas serve some of them (visible per DP rank in /server_info's
internal_states); an abort reaches whichever replica holds the request; /flush_cache
and /server_info are answered once for both replicas."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from http_helpers import assert_memory_idle, generate, stream_events
from server_launcher import ServerHandle

PROMPTS = [f"Prompt number {i} says that the little dragon read a book about the sea" for i in range(8)]
PARAMS = {"max_new_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def dp2_server(tiny_llama_dir):
    with ServerHandle(
        tiny_llama_dir,
        extra_args=[
            "--dp-size",
            "2",
            "--tp-size",
            "2",
            "--load-balance-method",
            "shortest_queue",
            "--chunked-prefill-size",
            "8",
            "--enable-overlap-schedule",
        ],
    ) as h:
        yield h


@pytest.fixture(scope="module")
def dp2_client(dp2_server):
    with httpx.Client(base_url=dp2_server.base_url, timeout=120) as c:
        yield c


def _finished_per_replica(client: httpx.Client) -> list[int]:
    return [s["num_finished_reqs"] for s in client.get("/server_info").json()["internal_states"]]


def test_one_process_per_replica_and_the_controller(dp2_server):
    names = {p.cmdline()[0] for p in psutil.Process(dp2_server.proc.pid).children(recursive=True)}
    assert {
        "tandem::scheduler_DP0_TP0",
        "tandem::scheduler_DP0_TP1",
        "tandem::scheduler_DP1_TP0",
        "tandem::scheduler_DP1_TP1",
        "tandem::data_parallel_controller",
        "tandem::detokenizer",
    } <= names


def test_concurrent_greedy_outputs_equal_dp1_and_both_replicas_work(client, dp2_client):
    want = [generate(client, text=p, sampling_params=PARAMS)["output_ids"] for p in PROMPTS]
    before = _finished_per_replica(dp2_client)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda p: generate(dp2_client, text=p, sampling_params=PARAMS), PROMPTS))
    assert [o["output_ids"] for o in outs] == want
    again = generate(dp2_client, text=PROMPTS[0], sampling_params=PARAMS)  # both replicas cached the prefix
    assert again["output_ids"] == want[0] and again["meta_info"]["cached_tokens"] > 0
    done = [b - a for a, b in zip(before, _finished_per_replica(dp2_client))]
    assert sum(done) == len(PROMPTS) + 1 and all(n > 0 for n in done), done
    info = assert_memory_idle(dp2_client)  # the sums over the replicas
    for state in info["internal_states"]:  # and each replica's own
        assert state["free_kv_slots"] + state["evictable_cached_slots"] == state["max_total_num_tokens"], state
    loads = dp2_client.get("/v1/loads").json()["loads"]
    assert [entry["dp_rank"] for entry in loads] == [0, 1]


def test_abort_reaches_whichever_replica_holds_the_request(dp2_server, dp2_client):
    results: dict[str, list] = {}

    def run(rid: str) -> None:
        with httpx.Client(base_url=dp2_server.base_url, timeout=120) as c:
            results[rid] = stream_events(
                c,
                "/generate",
                {
                    "text": f"abort {rid}",
                    "rid": rid,
                    "stream": True,
                    "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
                },
            )

    def in_flight() -> list[int]:
        states = dp2_client.get("/server_info").json()["internal_states"]
        return [s["num_running_reqs"] + s["num_waiting_reqs"] for s in states]

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.02)

    threads = [threading.Thread(target=run, args=(rid,)) for rid in ("a-0", "a-1")]
    # The second starts once a replica holds the first (an event, not a guessed 0.3 s):
    # shortest_queue then gives it to the other replica.
    threads[0].start()
    wait_for(lambda: sum(in_flight()) == 1, "the first request reaches a replica")
    threads[1].start()
    wait_for(lambda: in_flight() == [1, 1], "one request on each replica")
    for rid in ("a-1", "a-0"):
        assert dp2_client.post("/abort_request", json={"rid": rid}).status_code == 200
    for t in threads:
        t.join(timeout=120)
    for rid in ("a-0", "a-1"):
        meta = results[rid][-1]["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 1500 // 2, meta
    assert_memory_idle(dp2_client)


def test_flush_cache_is_answered_once_for_both_replicas(dp2_server, dp2_client):
    generate(dp2_client, text="cache me", sampling_params=PARAMS)
    r = dp2_client.post("/flush_cache")
    assert r.status_code == 200 and r.json() == {"success": True}
    states = dp2_client.get("/server_info").json()["internal_states"]
    assert [s["evictable_cached_slots"] for s in states] == [0, 0]
    # While one replica runs a request, it refuses, and the one answer is its refusal.
    results: list = []

    def run() -> None:
        with httpx.Client(base_url=dp2_server.base_url, timeout=120) as c:
            results.append(
                generate(c, text="busy", rid="busy", sampling_params={"max_new_tokens": 1500, "ignore_eos": True})
            )

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while dp2_client.get("/server_info").json()["num_running_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = dp2_client.post("/flush_cache")
    assert dp2_client.post("/abort_request", json={"rid": "busy"}).status_code == 200
    t.join(timeout=60)
    assert r.status_code == 400 and "while requests are running" in r.text, r.text
    assert results[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert_memory_idle(dp2_client)
