"""SGLang features of #26 end to end: stop_regex on the native and OpenAI routes; the
request timeouts (SGLANG_REQ_RUNNING_TIMEOUT, SGLANG_REQ_WAITING_TIMEOUT); priority
scheduling (--enable-priority-scheduling, a request's `priority`)."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
from server_launcher import ServerHandle

GREEDY = {"temperature": 0, "ignore_eos": True}


def _stop_pattern(client) -> tuple[str, str, str]:
    """(pattern, text before its first match, the greedy output without it) on this model:
    a 3-character piece from the middle of the greedy output, escaped."""
    text = client.post("/generate", json={"text": "Hello there", "sampling_params": {**GREEDY, "max_new_tokens": 24}})
    text = text.json()["text"]
    piece = next(text[k : k + 3] for k in range(len(text) // 3, len(text) - 3) if text[k : k + 3].strip())
    pattern = re.escape(piece)
    return pattern, text[: re.search(pattern, text).start()], text


def test_stop_regex_native(client):
    pattern, before, _ = _stop_pattern(client)
    body = {"text": "Hello there", "sampling_params": {**GREEDY, "max_new_tokens": 24, "stop_regex": pattern}}
    out = client.post("/generate", json=body).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert out["text"] == before
    kept = client.post("/generate", json={**body, "sampling_params": {**body["sampling_params"], "no_stop_trim": True}})
    assert re.search(pattern, kept.json()["text"]) and kept.json()["text"].startswith(before)
    # A list; the stream never shows the match and ends with the same text.
    body["sampling_params"]["stop_regex"] = ["zzzq", pattern]
    streamed = ""
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert before.startswith(chunk["text"]), chunk["text"]
                streamed = chunk["text"]
    assert streamed == before and chunk["meta_info"]["finish_reason"]["matched"] == pattern
    bad = client.post("/generate", json={"text": "x", "sampling_params": {"stop_regex": "(a"}})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("sampling_params.stop_regex: invalid")


def test_stop_regex_openai(client, server):
    pattern, before, _ = _stop_pattern(client)
    body = {"prompt": "Hello there", "max_tokens": 24, "stop_regex": pattern, **GREEDY}
    out = client.post("/v1/completions", json=body).json()["choices"][0]
    assert (out["finish_reason"], out["matched_stop"], out["text"]) == ("stop", pattern, before)
    text = ""
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["text"]
                    assert before.startswith(text)
    assert text == before
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, **GREEDY}
    plain = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    piece = re.escape(plain[len(plain) // 2 : len(plain) // 2 + 2])
    out = client.post("/v1/chat/completions", json={**chat, "stop_regex": [piece]}).json()["choices"][0]
    assert out["finish_reason"] == "stop" and out["matched_stop"] == piece
    assert out["message"]["content"] == plain[: re.search(piece, plain).start()]
    r = httpx.post(server.base_url + "/v1/chat/completions", json={**chat, "stop_regex": "[a-"})
    assert r.status_code == 400 and r.json()["param"] == "stop_regex" and "invalid regex" in r.json()["message"]


def test_running_timeout_ends_with_sglangs_503(tiny_llama_dir):
    """SGLang's test_abort.TestAbortWithRunningTimeout: the request ends with
    {"object": "error", "code": 503}; the OpenAI routes answer 503 in OpenAI's shape. A
    stream that ends so with its first output gets the 503 status (as a refused one); one
    that ended later, its last chunk's finish_reason (which of the two is timing)."""
    with ServerHandle(tiny_llama_dir, env={"SGLANG_REQ_RUNNING_TIMEOUT": "0.001"}) as server:
        body = {"text": "Today is ", "sampling_params": {"temperature": 0, "max_new_tokens": 512, "ignore_eos": True}}
        r = httpx.post(server.base_url + "/generate", json=body, timeout=120)
        assert r.status_code == 503 and r.json()["object"] == "error" and r.json()["code"] == 503, r.text
        assert r.json()["message"] == "Request running timeout reached."
        with httpx.stream("POST", server.base_url + "/generate", json={**body, "stream": True}, timeout=120) as s:
            if s.status_code == 503:  # it ended with its first output: a real status, before the stream
                s.read()
                assert s.json()["object"] == "error" and s.json()["code"] == 503, s.text
            else:  # it ended after its first token: the stream's last chunk says so
                assert s.status_code == 200
                last = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")][-1]
                assert last["meta_info"]["finish_reason"]["status_code"] == 503
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 512, "ignore_eos": True}
        r = httpx.post(server.base_url + "/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 503 and r.json()["object"] == "error" and r.json()["code"] == 503, r.text


def test_waiting_timeout_ends_the_queued_request(tiny_llama_dir):
    """SGLang's WaitingTimeoutMixin: with --max-running-requests 1, of two concurrent
    requests exactly one ends with {"object": "error", "code": 503}."""
    env = {"SGLANG_REQ_WAITING_TIMEOUT": "0.001"}
    with ServerHandle(tiny_llama_dir, ["--max-running-requests", "1"], env=env) as server:
        body = {"text": "Today is ", "sampling_params": {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}}
        with ThreadPoolExecutor(2) as pool:
            results = list(
                pool.map(lambda _: httpx.post(server.base_url + "/generate", json=body, timeout=120), [0, 1])
            )
        errors = [r.json() for r in results if r.json().get("object") == "error"]
        assert len(errors) == 1 and errors[0]["code"] == 503, [r.text for r in results]
        assert errors[0]["message"] == "Request waiting timeout reached."


def test_priority_preempts_and_keeps_outputs(tiny_llama_dir):
    """One running slot: a request of priority 100 (OpenAI extra_body) preempts a running
    one of priority 0 (native, streamed: it is known to run), finishes first; the
    preempted one resumes with its outputs kept and ends with the greedy tokens it
    produces alone."""
    args = ["--max-running-requests", "1", "--enable-priority-scheduling", "--skip-server-warmup"]
    with ServerHandle(tiny_llama_dir, args) as server:
        low = {"text": "Once upon a time", "sampling_params": {**GREEDY, "max_new_tokens": 1500}}
        alone = httpx.post(server.base_url + "/generate", json=low, timeout=300).json()["output_ids"]
        running, done = threading.Event(), []

        def run_low():
            last = None
            body = {**low, "priority": 0, "stream": True}
            with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=300) as s:
                for line in s.iter_lines():
                    if line.startswith("data: {"):
                        last = json.loads(line[6:])
                        running.set()
            done.append("low")
            return last

        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(run_low)
            assert running.wait(120)
            chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "priority": 100, **GREEDY}
            r = httpx.post(server.base_url + "/v1/chat/completions", json=chat, timeout=300)
            done.append("high")
            out = fut.result()
        assert r.status_code == 200 and done == ["high", "low"], (r.text, done)
        assert out["output_ids"] == alone and out["meta_info"]["finish_reason"]["type"] == "length"
        assert out["meta_info"]["num_retractions"] == 1  # preempted while running, not merely queued
        bad = httpx.post(server.base_url + "/generate", json={**low, "priority": "high"}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("priority: must be an integer")
