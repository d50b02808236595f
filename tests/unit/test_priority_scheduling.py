"""SGLang's priority scheduling in the scheduler: the waiting queue by priority, preemption
of running requests outranked by more than the threshold (retracted: outputs kept,
greedy tokens unchanged), and --max-queued-requests' answers."""

from __future__ import annotations

import argparse

import pytest
from scheduler_harness import SchedulerHarness

from tandem.server_args import ServerArgs

QUEUE_FULL = {"type": "abort", "status_code": 503, "message": "The request queue is full."}
OUTRANKED = {"type": "abort", "status_code": 503, "message": "The request is aborted by a higher priority request."}


@pytest.fixture(params=["overlap", "normal"])
def loop(request):
    return request.param


def _harness(model_dir, loop, **args) -> SchedulerHarness:
    return SchedulerHarness(model_dir, disable_overlap_schedule=loop == "normal", **args)


def _submit(h, rid, priority, n=8, prompt=(1, 2, 3, 4)):
    h.submit(rid, max_new_tokens=n, input_ids=list(prompt), logprobs={"priority": priority})


def _alone(model_dir, loop, rid, n, prompt):
    """The greedy tokens of one request served alone."""
    h = _harness(model_dir, loop)
    try:
        h.submit(rid, max_new_tokens=n, input_ids=list(prompt))
        h.run_until_idle()
        return h.collected.ids[rid]
    finally:
        h.close()


def test_flags():
    args = ServerArgs(model_path="m", enable_priority_scheduling=True, schedule_policy="lpm")
    with pytest.raises(ValueError, match="--enable-priority-scheduling: needs --schedule-policy fcfs"):
        args.validate()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    argv = ["--model-path", "m", "--enable-priority-scheduling", "--schedule-low-priority-values-first"]
    parsed = ServerArgs.from_cli_args(parser.parse_args(argv))
    assert parsed.enable_priority_scheduling and parsed.schedule_low_priority_values_first
    assert parsed.priority_scheduling_preemption_threshold == 10


@pytest.mark.parametrize("low_first", [False, True])
def test_waiting_queue_by_priority(tiny_llama_dir, loop, low_first):
    """One running slot: the waiting requests start by priority (ties: arrival), and a
    difference within the threshold preempts nothing."""
    h = _harness(
        tiny_llama_dir,
        loop,
        max_running_requests=1,
        enable_priority_scheduling=True,
        schedule_low_priority_values_first=low_first,
    )
    try:
        _submit(h, "first", 0)
        h.step()
        for rid, p in (("p1", 1), ("p5", 5), ("none", None), ("p5b", 5), ("p3", 3)):
            _submit(h, rid, p)
        finishes = h.run_until_idle()
        order = [r for r in finishes if r != "first"]
        high_first = ["p5", "p5b", "p3", "p1", "none"]
        assert order == (["p1", "p3", "p5", "p5b", "none"] if low_first else high_first)
        assert next(iter(finishes)) == "first" and h.collected.retractions["first"] == 0
    finally:
        h.close()


def test_preemption_keeps_outputs(tiny_llama_dir, loop):
    """A request outranking the running one by more than 10 preempts it: the running
    one is retracted (outputs kept), the newcomer runs, the retracted one resumes; both
    produce the tokens they produce alone."""
    low_prompt, high_prompt = (1, 2, 3, 4), (9, 8, 7)
    h = _harness(tiny_llama_dir, loop, max_running_requests=1, enable_priority_scheduling=True)
    try:
        _submit(h, "low", 0, n=24, prompt=low_prompt)
        for _ in range(4):
            h.step()
        _submit(h, "high", 11, n=6, prompt=high_prompt)
        finishes = h.run_until_idle()
        assert list(finishes) == ["high", "low"]
        assert h.collected.retractions["low"] == 1 and h.collected.retractions["high"] == 0
        h.assert_released_once()
    finally:
        h.close()
    assert h.collected.ids["low"] == _alone(tiny_llama_dir, loop, "low", 24, low_prompt)
    assert h.collected.ids["high"] == _alone(tiny_llama_dir, loop, "high", 6, high_prompt)


def test_within_threshold_or_off_no_preemption(tiny_llama_dir, loop):
    for args, high in (({"enable_priority_scheduling": True}, 10), ({}, 1000)):
        h = _harness(tiny_llama_dir, loop, max_running_requests=1, **args)
        try:
            _submit(h, "low", 0, n=16)
            for _ in range(3):
                h.step()
            _submit(h, "high", high, n=4, prompt=(9, 8, 7))
            finishes = h.run_until_idle()
            assert list(finishes) == ["low", "high"] and h.collected.retractions["low"] == 0
        finally:
            h.close()


def test_max_queued_requests_answers(tiny_llama_dir, loop):
    """SGLang's: a full queue refuses the newcomer ("The request queue is full.", 503),
    unless priority scheduling finds a waiting request it outranks: that one is aborted."""
    off = _harness(tiny_llama_dir, loop, max_running_requests=1, max_queued_requests=1)
    try:
        _submit(off, "a", 0)
        off.step()
        _submit(off, "b", 0)
        _submit(off, "c", 50)
        off.run_until_idle()
        finishes = off.collected.finishes
        assert finishes["c"] == QUEUE_FULL and finishes["b"]["type"] == "length"
    finally:
        off.close()
    on = _harness(tiny_llama_dir, loop, max_running_requests=1, max_queued_requests=1, enable_priority_scheduling=True)
    try:
        _submit(on, "a", 0)
        on.step()
        _submit(on, "b", 0)
        on.step()
        _submit(on, "c", 5)  # outranks b (within the preemption threshold of a)
        on.step()
        _submit(on, "d", 5)  # does not outrank c: refused
        on.run_until_idle()
        finishes = on.collected.finishes
        assert finishes["b"] == OUTRANKED and finishes["d"] == QUEUE_FULL
        assert finishes["a"]["type"] == finishes["c"]["type"] == "length"
        on.assert_released_once(admitted=False)
    finally:
        on.close()
