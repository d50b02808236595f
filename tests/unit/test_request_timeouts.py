"""SGLang's request timeouts in the scheduler (SGLANG_REQ_WAITING_TIMEOUT,
SGLANG_REQ_RUNNING_TIMEOUT): requests end with a 503 abort in SGLang's words; requests
the timeouts do not touch produce the same tokens as with them off."""

from __future__ import annotations

import time

import pytest
from scheduler_harness import SchedulerHarness

from tandem.scheduler.scheduler import timeout_from_env

RUNNING = {"type": "abort", "status_code": 503, "message": "Request running timeout reached."}
WAITING = {"type": "abort", "status_code": 503, "message": "Request waiting timeout reached."}


@pytest.fixture(params=["overlap", "normal"])
def loop(request):
    return request.param


def _harness(model_dir, loop, monkeypatch, env: dict[str, str], **args) -> SchedulerHarness:
    for name in ("SGLANG_REQ_WAITING_TIMEOUT", "SGLANG_REQ_RUNNING_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return SchedulerHarness(model_dir, disable_overlap_schedule=loop == "normal", **args)


def test_env_parsing(monkeypatch):
    for raw, want in (("", None), ("0", None), ("-1", None), ("0.5", 0.5), ("30", 30.0)):
        monkeypatch.setenv("SGLANG_REQ_RUNNING_TIMEOUT", raw)
        assert timeout_from_env("SGLANG_REQ_RUNNING_TIMEOUT") == want
    monkeypatch.setenv("SGLANG_REQ_RUNNING_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SGLANG_REQ_RUNNING_TIMEOUT: must be a number"):
        timeout_from_env("SGLANG_REQ_RUNNING_TIMEOUT")


def test_running_timeout_ends_running_requests(tiny_llama_dir, loop, monkeypatch):
    h = _harness(tiny_llama_dir, loop, monkeypatch, {"SGLANG_REQ_RUNNING_TIMEOUT": "0.001"})
    try:
        h.submit("a", max_new_tokens=200)
        h.submit("b", max_new_tokens=200, input_ids=[5, 6, 7])
        finishes = h.run_until_idle()
        assert finishes == {"a": RUNNING, "b": RUNNING}
        assert all(0 < len(h.collected.ids[r]) < 200 for r in "ab")
        h.assert_released_once()
    finally:
        h.close()


def test_waiting_timeout_ends_queued_requests_only(tiny_llama_dir, loop, monkeypatch):
    """--max-running-requests 1: the first request runs to its end; the second, still
    waiting after the timeout, ends with SGLang's 503 (SGLang's test_waiting_timeout)."""
    h = _harness(tiny_llama_dir, loop, monkeypatch, {"SGLANG_REQ_WAITING_TIMEOUT": "0.05"}, max_running_requests=1)
    off = _harness(tiny_llama_dir, loop, monkeypatch, {}, max_running_requests=1)
    try:
        h.submit("a", max_new_tokens=12)
        h.step()  # "a" is admitted
        h.submit("b", max_new_tokens=12)
        h.step()
        time.sleep(0.1)
        finishes = h.run_until_idle()
        assert finishes["b"] == WAITING and h.collected.ids["b"] == []
        assert finishes["a"] == {"type": "length", "length": 12}
        off.submit("a", max_new_tokens=12)
        off.run_until_idle()
        assert h.collected.ids["a"] == off.collected.ids["a"]  # greedy tokens unchanged
        h.assert_released_once(admitted=False)
    finally:
        h.close()
        off.close()


def test_generous_timeouts_change_nothing(tiny_llama_dir, loop, monkeypatch):
    env = {"SGLANG_REQ_WAITING_TIMEOUT": "600", "SGLANG_REQ_RUNNING_TIMEOUT": "600"}
    outs = []
    for e in (env, {}):
        h = _harness(tiny_llama_dir, loop, monkeypatch, e, max_running_requests=2)
        try:
            for k in range(4):
                h.submit(f"r{k}", max_new_tokens=8, input_ids=[1 + k, 2, 3, 4 + k])
            finishes = h.run_until_idle()
            assert all(f["type"] == "length" for f in finishes.values())
            outs.append(dict(h.collected.ids))
        finally:
            h.close()
    assert outs[0] == outs[1]
