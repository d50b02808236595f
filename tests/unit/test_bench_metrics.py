"""Metric math and workload generation of the benchmark tools (no server)."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import numpy as np
import pytest

from tandem.bench_serving import Target, build_payload, send_request
from tandem.benchmarks.datasets import (
    BenchRequest,
    TokenSpace,
    arrival_offsets,
    generate_random_requests,
    generate_shared_prefix_requests,
    sample_lengths,
)
from tandem.benchmarks.metrics import (
    RequestResult,
    compute_metrics,
    percentile,
    summarize,
    throughput,
    tpot,
    ttft_and_itl,
)

SPACE = TokenSpace(vocab_size=100, special_ids=frozenset({0, 1, 2, 3}))


# ---- metrics -----------------------------------------------------------------------
def test_percentile_interpolates_linearly():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 99) == 0.0
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_summarize_scales_and_handles_empty():
    s = summarize([0.001, 0.002, 0.003], scale=1000.0)
    assert s["mean"] == pytest.approx(2.0)
    assert s["median"] == pytest.approx(2.0)
    assert s["p99"] == pytest.approx(2.98)
    assert summarize([]) == {"mean": 0.0, "median": 0.0, "p99": 0.0}


def test_ttft_and_itl_one_token_per_chunk():
    ttft, itl = ttft_and_itl(10.0, [10.5, 10.7, 11.0], [1, 1, 1])
    assert ttft == pytest.approx(0.5)
    assert itl == pytest.approx([0.2, 0.3])


def test_ttft_and_itl_splits_multi_token_chunks_evenly():
    # First chunk brings 2 tokens (no ITL entries for them), then 4 tokens after 0.4 s,
    # an empty chunk (ignored), then 1 token after 0.1 s.
    ttft, itl = ttft_and_itl(0.0, [1.0, 1.4, 1.45, 1.5], [2, 4, 0, 1])
    assert ttft == pytest.approx(1.0)
    assert itl == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.1])
    assert sum(itl) == pytest.approx(1.5 - 1.0)
    assert len(itl) == 7 - 2


def test_ttft_and_itl_rejects_no_tokens():
    with pytest.raises(ValueError):
        ttft_and_itl(0.0, [1.0], [0])
    with pytest.raises(ValueError):
        ttft_and_itl(0.0, [1.0, 2.0], [1])


def test_tpot():
    assert tpot(e2e_latency=1.0, ttft=0.2, output_len=5) == pytest.approx(0.2)
    assert tpot(1.0, 0.2, 1) is None
    assert tpot(1.0, 0.2, 0) is None


def test_throughput():
    assert throughput(10, 2.0) == 5.0
    assert throughput(10, 0.0) == 0.0


def test_compute_metrics():
    results = [
        RequestResult(success=True, prompt_len=10, output_len=5, ttft=0.1, e2e_latency=0.5, itl=[0.1] * 4),
        RequestResult(success=True, prompt_len=20, output_len=1, ttft=0.3, e2e_latency=0.3, itl=[]),
        RequestResult(success=False, prompt_len=30, error="boom"),
    ]
    m = compute_metrics(results, duration=2.0)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["input_throughput"] == pytest.approx(15.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_throughput"] == pytest.approx(18.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    # Only the request with output_len > 1 has a TPOT: (0.5 - 0.1) / 4.
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    assert m["p99_itl_ms"] == pytest.approx(100.0)
    assert m["mean_e2e_latency_ms"] == pytest.approx(400.0)
    assert m["concurrency"] == pytest.approx(0.4)
    json.dumps(m)


# ---- datasets ----------------------------------------------------------------------
def test_sample_lengths_range():
    rng = np.random.default_rng(0)
    lens = sample_lengths(rng, 2000, 100, 0.5)
    assert lens.min() >= 50 and lens.max() <= 100
    assert lens.min() == 50 and lens.max() == 100  # both ends reachable
    assert set(sample_lengths(rng, 50, 7, 1.0)) == {7}
    assert sample_lengths(rng, 100, 3, 0.0).min() >= 1
    with pytest.raises(ValueError):
        sample_lengths(rng, 1, 10, 1.5)


def test_random_requests_lengths_ids_and_seed():
    reqs = generate_random_requests(50, 64, 16, 0.25, SPACE, seed=3)
    assert len(reqs) == 50
    for r in reqs:
        assert 16 <= r.prompt_len <= 64 and 4 <= r.output_len <= 16
        assert all(4 <= t < 100 for t in r.prompt_ids)
    assert generate_random_requests(50, 64, 16, 0.25, SPACE, seed=3) == reqs
    assert generate_random_requests(50, 64, 16, 0.25, SPACE, seed=4) != reqs
    fixed = generate_random_requests(5, 32, 8, 1.0, SPACE, seed=0)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(32, 8)] * 5


def test_shared_prefix_requests():
    reqs = generate_shared_prefix_requests(3, 4, 20, 5, 7, SPACE, seed=1)
    assert len(reqs) == 12
    assert all(r.prompt_len == 25 and r.output_len == 7 for r in reqs)
    prefixes = {tuple(r.prompt_ids[:20]) for r in reqs}
    assert len(prefixes) == 3
    for p in prefixes:
        assert sum(tuple(r.prompt_ids[:20]) == p for r in reqs) == 4
    assert generate_shared_prefix_requests(3, 4, 20, 5, 7, SPACE, seed=1) == reqs


def test_arrival_offsets():
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    offs = arrival_offsets(2000, 10.0, seed=5)
    assert offs[0] == 0.0 and all(b >= a for a, b in zip(offs, offs[1:]))
    assert np.mean(np.diff(offs)) == pytest.approx(0.1, rel=0.1)
    assert arrival_offsets(2000, 10.0, seed=5) == offs
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)


def test_token_space_skips_special_ids():
    allowed = SPACE.allowed_ids()
    assert allowed.size == 96 and allowed.min() == 4


# ---- request bodies and stream parsing (fake transport) ----------------------------
def test_build_payload_shapes():
    req = BenchRequest([5, 6, 7], 9)
    native = build_payload(Target("tandem", "u", None, {"top_k": 1}), req)
    assert native == {
        "input_ids": [5, 6, 7],
        "stream": True,
        "sampling_params": {"max_new_tokens": 9, "temperature": 0.0, "ignore_eos": True, "top_k": 1},
    }
    oai = build_payload(Target("vllm", "u", "m", {}), req)
    assert oai == {
        "model": "m",
        "prompt": [5, 6, 7],
        "max_tokens": 9,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _sse(chunks: list) -> bytes:
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return body + b"data: [DONE]\n\n"


def _run(target_backend: str, body: bytes, status: int = 200) -> RequestResult:
    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, Target(target_backend, "http://x/y", "m", {}), BenchRequest([5] * 4, 3))

    return asyncio.run(go())


def test_send_request_native_counts_cumulative_tokens():
    chunks = [
        {"text": "a", "output_ids": [9], "meta_info": {"completion_tokens": 1, "finish_reason": None}},
        {
            "text": "abc",
            "output_ids": [9, 8, 7],
            "meta_info": {"completion_tokens": 3, "finish_reason": {"type": "length"}},
        },
    ]
    r = _run("tandem", _sse(chunks))
    assert r.success and r.prompt_len == 4 and r.output_len == 3
    assert len(r.itl) == 2 and r.ttft > 0 and r.e2e_latency >= r.ttft


def test_send_request_openai_uses_usage():
    chunks = [
        {"choices": [{"text": "a", "finish_reason": None}]},
        {"choices": [{"text": "", "finish_reason": None}]},
        {"choices": [{"text": "c", "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}},
    ]
    r = _run("openai", _sse(chunks))
    assert r.success and r.output_len == 3 and len(r.itl) == 2


def test_send_request_failures():
    r = _run("tandem", b'{"error": {"message": "bad"}}', status=400)
    assert not r.success and "HTTP 400" in r.error
    aborted = [
        {
            "text": "",
            "output_ids": [],
            "meta_info": {"completion_tokens": 0, "finish_reason": {"type": "abort", "message": "x"}},
        }
    ]
    assert not _run("tandem", _sse(aborted)).success
