"""Native API features of #3: logprobs against transformers, n > 1, abort, disconnect,
and --skip-tokenizer-init."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import hf_reference
import httpx
import torch
from http_helpers import assert_memory_idle, generate, wait_idle
from server_launcher import ServerHandle

GREEDY = {"temperature": 0}


def test_logprobs_match_transformers(client, tiny_llama_dir):
    prompt = "The little robot walked into the garden and"
    out = generate(
        client,
        text=prompt,
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
        return_text_in_logprobs=True,
        sampling_params={**GREEDY, "max_new_tokens": 8},
    )
    meta = out["meta_info"]
    ids = hf_reference.encode(tiny_llama_dir, prompt)
    full = ids + out["output_ids"]
    tok, model = hf_reference.load(str(tiny_llama_dir))
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), dim=-1)
    # Input token j is scored by position j - 1; position 0 has no logprob.
    inputs = meta["input_token_logprobs"]
    assert len(inputs) == len(ids) and inputs[0][0] is None and inputs[0][1] == ids[0]
    for j in range(1, len(ids)):
        assert inputs[j][1] == ids[j]
        assert abs(inputs[j][0] - ref[j - 1, ids[j]].item()) < 1e-4
    outputs = meta["output_token_logprobs"]
    assert [o[1] for o in outputs] == out["output_ids"]
    for k, (lp, tid, text) in enumerate(outputs):
        pos = len(ids) - 1 + k
        assert abs(lp - ref[pos, tid].item()) < 1e-4
        assert text == tok.decode([tid])
        top = meta["output_top_logprobs"][k]
        assert len(top) == 3 and top[0][1] == tid  # greedy: the chosen token is the best
        ref_top = ref[pos].topk(3)
        assert [t[1] for t in top] == ref_top.indices.tolist()
        assert all(abs(t[0] - v) < 1e-4 for t, v in zip(top, ref_top.values.tolist()))


def test_logprobs_are_of_the_unscaled_distribution(client):
    params = {"temperature": 0.5, "max_new_tokens": 5, "sampling_seed": 3}
    hot = generate(client, text="Logprob check", return_logprob=True, sampling_params=params)
    ids = hot["output_ids"]
    # Score the same tokens again with temperature 1 by prefilling them as input.
    prompt_ids = generate(
        client,
        text="Logprob check",
        return_logprob=True,
        logprob_start_len=0,
        sampling_params={"max_new_tokens": 1, **GREEDY},
    )["meta_info"]["input_token_logprobs"]
    scored = generate(
        client,
        input_ids=[p[1] for p in prompt_ids] + ids,
        return_logprob=True,
        logprob_start_len=len(prompt_ids),
        sampling_params={"max_new_tokens": 1, **GREEDY},
    )
    for (lp, _, _), (ref, _, _) in zip(
        hot["meta_info"]["output_token_logprobs"], scored["meta_info"]["input_token_logprobs"]
    ):
        assert abs(lp - ref) < 1e-4


def test_n_samples(client):
    params = {"temperature": 1.0, "max_new_tokens": 12, "n": 3, "ignore_eos": True}
    outs = generate(client, text="Many samples", sampling_params=params)
    assert isinstance(outs, list) and len(outs) == 3
    assert len({tuple(o["output_ids"]) for o in outs}) > 1, "independent samples should differ"
    greedy = generate(client, text="Many samples", sampling_params={**GREEDY, "max_new_tokens": 6, "n": 2})
    assert greedy[0]["output_ids"] == greedy[1]["output_ids"]
    batch = generate(client, text=["a b", "c d"], sampling_params={**GREEDY, "max_new_tokens": 4, "n": 2})
    assert len(batch) == 4 and batch[0]["output_ids"] == batch[1]["output_ids"]
    assert batch[2]["output_ids"] == batch[3]["output_ids"]
    assert_memory_idle(client)


def _stream_in_thread(base_url: str, body: dict, results: list) -> threading.Thread:
    def run() -> None:
        with httpx.Client(base_url=base_url, timeout=120) as c:
            with c.stream("POST", "/generate", json=body) as r:
                last = None
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        last = json.loads(line[6:])
                results.append(last)

    t = threading.Thread(target=run)
    t.start()
    return t


LONG = 1500  # max_new_tokens of the requests aborted below: far more than they may run
PROMPT_IDS = [1, 50, 60, 70]


def _running(info: dict, num_reqs: int, min_used_tokens: int) -> bool:
    """`num_reqs` requests run and hold at least `min_used_tokens` KV slots between them
    (their prompts and generated tokens)."""
    used = info["max_total_num_tokens"] - info["free_kv_slots"] - info["evictable_cached_slots"]
    return info["num_running_reqs"] >= num_reqs and used >= min_used_tokens


def _wait_running(client: httpx.Client, num_reqs: int, min_used_tokens: int = 0, timeout: float = 60.0) -> None:
    """Wait (for the event, not a guessed time) until `_running`."""
    deadline = time.monotonic() + timeout
    while True:
        info = client.get("/server_info").json()
        if _running(info, num_reqs, min_used_tokens):
            return
        assert time.monotonic() < deadline, info
        time.sleep(0.02)


def _flush_cache(client: httpx.Client) -> None:
    wait_idle(client)
    assert client.post("/flush_cache").status_code == 200
    assert client.get("/server_info").json()["evictable_cached_slots"] == 0


def _tokens_run_by_the_aborted_request(client: httpx.Client) -> int:
    """After one request ran alone on a flushed cache and ended: the radix cache holds its
    prompt and every output token but the last (mem_cache/req_kv.py, `release`), so the
    cached slots say how far it ran. Waits for idle with a deadline, not a guess: a
    request that was not aborted ends after its LONG tokens and fails the caller's bound."""
    return assert_memory_idle(client, timeout=120)["evictable_cached_slots"]


def test_abort_one_request_by_rid(server, client):
    results: list = []
    body = {
        "text": "abort me",
        "rid": "to-abort",
        "stream": True,
        "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True},
    }
    t = _stream_in_thread(server.base_url, body, results)
    _wait_running(client, 1)
    assert client.post("/abort_request", json={"rid": "to-abort"}).status_code == 200
    t.join(timeout=120)
    assert results and results[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert results[0]["meta_info"]["completion_tokens"] < LONG // 2
    assert_memory_idle(client)


def test_abort_all(server, client):
    results: list = []
    threads = [
        _stream_in_thread(
            server.base_url,
            {"text": f"long {i}", "stream": True, "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}},
            results,
        )
        for i in range(4)
    ]
    _wait_running(client, 4)
    assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 4
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results)
    assert all(r["meta_info"]["completion_tokens"] < LONG // 2 for r in results)
    assert_memory_idle(client)
    assert client.post("/abort_request", json={}).status_code == 400


def test_client_disconnect_aborts(server, client):
    """A streaming client that leaves after 3 chunks stops its request: it ran far fewer
    than its LONG tokens (counted in the radix cache afterwards), not all of them."""
    _flush_cache(client)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as ac:
            async with ac.stream(
                "POST",
                "/generate",
                json={
                    "input_ids": PROMPT_IDS,
                    "stream": True,
                    "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True},
                },
            ) as r:
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if n >= 3:
                        break  # leave mid-stream

    asyncio.run(run())
    ran = _tokens_run_by_the_aborted_request(client)
    assert len(PROMPT_IDS) + 2 <= ran < len(PROMPT_IDS) + LONG // 2, ran


def test_non_streaming_disconnect_aborts(server, client):
    """A non-streaming client that hangs up once its request has 16 tokens stops it."""
    _flush_cache(client)
    body = {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}

    async def run() -> None:
        async with (
            httpx.AsyncClient(base_url=server.base_url, timeout=60) as ac,
            httpx.AsyncClient(base_url=server.base_url, timeout=120) as impatient,
        ):
            task = asyncio.create_task(impatient.post("/generate", json=body))
            # Until the request runs and holds its prompt and 16 outputs.
            while not _running((await ac.get("/server_info")).json(), 1, len(PROMPT_IDS) + 16):
                assert not task.done(), "the request ended before the client could hang up"
                await asyncio.sleep(0.02)
            task.cancel()  # hang up: the client's connections close with it
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    ran = _tokens_run_by_the_aborted_request(client)
    assert len(PROMPT_IDS) + 16 <= ran < len(PROMPT_IDS) + LONG // 2, ran


def test_skip_tokenizer_init_matches_normal_mode(tiny_llama_dir, client):
    prompts = [hf_reference.encode(tiny_llama_dir, p) for p in ["hello there", "a longer prompt with words"]]
    params = {**GREEDY, "max_new_tokens": 10}
    normal = [generate(client, input_ids=ids, sampling_params=params)["output_ids"] for ids in prompts]
    with ServerHandle(tiny_llama_dir, extra_args=["--skip-tokenizer-init"]) as raw:
        with httpx.Client(base_url=raw.base_url, timeout=60) as rc:
            outs = [generate(rc, input_ids=ids, sampling_params=params) for ids in prompts]
            assert [o["output_ids"] for o in outs] == normal
            assert all("text" not in o for o in outs)
            r = rc.post("/generate", json={"text": "hi"})
            assert r.status_code == 400 and "input_ids" in r.json()["error"]["message"]
            r = rc.post("/generate", json={"input_ids": prompts[0], "sampling_params": {"stop": ["x"]}})
            assert r.status_code == 400 and "stop" in r.json()["error"]["message"]
            stop_id = normal[0][2]
            out = generate(rc, input_ids=prompts[0], sampling_params={**params, "stop_token_ids": [stop_id]})
            assert out["output_ids"] == normal[0][: normal[0].index(stop_id) + 1]


def test_abort_by_parent_rid_stops_every_sample_only(server, client):
    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as ac:
            long = {"max_new_tokens": 1500, "ignore_eos": True}
            group = asyncio.create_task(
                ac.post(
                    "/generate",
                    json={"text": "group", "rid": "grp", "sampling_params": {**long, "n": 2, "temperature": 1.0}},
                )
            )
            bystander = asyncio.create_task(
                ac.post(
                    "/generate",
                    json={
                        "text": "bystander",
                        "rid": "grp-x",
                        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
                    },
                )
            )
            while (await ac.get("/server_info")).json()["num_running_reqs"] < 3:
                await asyncio.sleep(0.05)
            assert (await ac.post("/abort_request", json={"rid": "grp"})).status_code == 200
            return [(await group).json(), (await bystander).json()]

    samples, bystander = asyncio.run(run())
    assert [s["meta_info"]["finish_reason"]["type"] for s in samples] == ["abort", "abort"]
    assert bystander["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
    assert_memory_idle(client)
