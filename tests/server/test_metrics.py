"""--enable-metrics (GET /metrics, SGLang's metric names) and --log-requests, on one
server per tokenizer-worker count: after a known set of requests (a mix of finish
reasons, streamed and not) the counters equal what was sent and the histograms counted
every request; under two workers the counts add up across them."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_launcher import ServerHandle

LONG_TEXT = "hello " * 500  # 3000 characters: --log-requests-level 2 cuts it to 2048


@pytest.fixture(scope="module", params=[1, 2], ids=["one-worker", "two-workers"])
def metrics_server(request, tiny_llama_dir):
    workers = request.param
    with ServerHandle(
        tiny_llama_dir,
        ["--enable-metrics", "--log-requests", "--log-level", "info", "--tokenizer-worker-num", str(workers)],
    ) as handle:
        handle.workers = workers
        deadline = time.monotonic() + 60  # ready when one worker is: wait for every worker's warm-up
        while total(scrape(handle.base_url), "sglang:num_requests_total") < workers:
            assert time.monotonic() < deadline, "the workers' warm-up requests were not counted"
            time.sleep(0.2)
        yield handle


def scrape(base_url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of GET /metrics, by (name, labels); a fresh connection each time (so
    that under several workers any of them may answer)."""
    r = httpx.get(base_url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def total(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def generate(base_url: str, rid: str, params: dict, stream: bool) -> tuple[dict, int]:
    """(the final meta_info, the tokens of the first chunk) of one /generate request."""
    body = {"text": "The quick brown fox", "rid": rid, "sampling_params": params, "stream": stream}
    if not stream:
        r = httpx.post(base_url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        return meta, meta["completion_tokens"]
    chunks = []
    with httpx.stream("POST", base_url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks[-1]["meta_info"], len(chunks[0]["output_ids"])  # output_ids so far (not incremental)


def test_counters_and_histograms_match_what_was_sent(metrics_server):
    url = metrics_server.base_url
    before = scrape(url)
    # (final meta_info, tokens in the first chunk, streamed) of each request sent.
    probe = httpx.post(
        url + "/generate",
        timeout=60,
        json={  # its token: a greedy stop below
            "text": "The quick brown fox",
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        },
    ).json()
    first_token = probe["output_ids"][0]
    runs = [(probe["meta_info"], 1, False)]
    runs += [
        (*generate(url, f"len-{i}", {"max_new_tokens": 5, "ignore_eos": True}, stream=False), False) for i in range(3)
    ]
    runs += [
        (
            *generate(
                url, f"stop-{i}", {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [first_token]}, stream=True
            ),
            True,
        )
        for i in range(2)
    ]
    runs += [
        (*generate(url, f"stream-{i}", {"max_new_tokens": 6, "ignore_eos": True}, stream=True), True) for i in range(2)
    ]
    after = scrape(url)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    n = len(runs)
    assert [m["finish_reason"]["type"] for m, *_ in runs].count("stop") >= 2
    assert delta("sglang:num_requests_total") == n
    assert delta("sglang:num_requests_total", is_streaming="true") == 4
    assert delta("sglang:prompt_tokens_total") == sum(m["prompt_tokens"] for m, *_ in runs)
    assert delta("sglang:generation_tokens_total") == sum(m["completion_tokens"] for m, *_ in runs)
    for reason in ("stop", "length"):
        assert delta("tandem:finished_requests_total", finish_reason=reason) == sum(
            m["finish_reason"]["type"] == reason for m, *_ in runs
        )
    for name in (
        "sglang:e2e_request_latency_seconds",
        "sglang:time_to_first_token_seconds",
        "sglang:prompt_tokens_histogram",
        "sglang:generation_tokens_histogram",
    ):
        assert delta(name + "_count") == n, name
        assert delta(name + "_bucket", le="+Inf") == n, name
    # Streamed requests: one inter-token observation per token after the server's first
    # output. That output holds 1 token up to the client's whole first chunk (a chunk may
    # merge several outputs that arrived together), so the count lies between the two.
    itl = delta("sglang:inter_token_latency_seconds_count")
    assert sum(m["completion_tokens"] - first for m, first, stream in runs if stream) <= itl
    assert itl <= sum(m["completion_tokens"] - 1 for m, _, stream in runs if stream)
    # Every worker ran one warm-up request: the totals are the sum over the workers.
    assert total(after, "sglang:num_requests_total") == n + metrics_server.workers
    assert total(after, "sglang:num_running_reqs") == 0 and total(after, "sglang:num_queue_reqs") == 0
    assert 0 <= total(after, "sglang:token_usage") <= 1 and 0 <= total(after, "sglang:cache_hit_rate") <= 1
    assert all(dict(labels).get("model_name") for (name, labels) in after if name.startswith("sglang:"))
    for _ in range(4):  # whichever worker answers, the same totals
        assert total(scrape(url), "sglang:num_requests_total") == n + metrics_server.workers


def test_log_requests_logs_each_request_truncated(metrics_server):
    url = metrics_server.base_url
    r = httpx.post(url + "/generate", timeout=60, json={"text": LONG_TEXT, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200
    log = metrics_server.log_path.read_text()
    for rid in ("len-0", "stop-1", "stream-0"):
        assert (
            sum("Receive: obj=GenerateReqInput(" in line and f"rid='{rid}'" in line for line in log.splitlines()) == 1
        ), rid
        assert (
            sum(
                "Finish: obj=" in line and f"rid='{rid}'" in line and "'finish_reason':" in line
                for line in log.splitlines()
            )
            == 1
        ), rid
    assert "hello " * 150 in log and LONG_TEXT not in log


def test_metrics_off_by_default(client):
    assert client.get("/metrics").status_code == 404
