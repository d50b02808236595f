"""The CPU compute-thread policy: every core for prefill; decode starts on every core but
one and probes the other count now and then, keeping whichever measured faster. And where
the threads run (placement: which servers bind, and the team's binding itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tandem.forward_batch import ForwardMode
from tandem.kernels import cpu as cpu_kernels
from tandem.utils.cpu_threads import (
    BIND_ENV,
    FIRST_PROBE_AFTER,
    PROBE_EVERY,
    PROBE_STEPS,
    USER_BINDING_ENV,
    ComputeThreads,
    front_end_cpu,
)


def run_decode(policy: ComputeThreads, steps: int, seconds_at: dict[int, float], bs=4) -> list[int]:
    """`steps` decode steps whose duration per request depends on the thread count `apply`
    set; `bs` a batch size, or a function of the step's index; returns the counts used."""
    used = []
    for i in range(steps):
        policy.apply(ForwardMode.DECODE)
        used.append(torch.get_num_threads())
        size = bs(i) if callable(bs) else bs
        policy.observe_decode(seconds_at[torch.get_num_threads()] * size, size)
    return used


PROBE = [2, 1] * PROBE_STEPS  # a probe from one thread: the two counts alternate


def test_decode_switches_to_the_faster_count_and_back():
    before = torch.get_num_threads()
    try:
        policy = ComputeThreads(cores=2, decode=1)
        policy.apply(ForwardMode.EXTEND)
        assert torch.get_num_threads() == 2, "prefill on every core"
        # Two threads twice as fast (a large model, quiet machine): the first probe switches.
        used = run_decode(policy, FIRST_PROBE_AFTER + 2 * PROBE_STEPS + 5, {1: 0.02, 2: 0.01})
        assert used[:FIRST_PROBE_AFTER] == [1] * FIRST_PROBE_AFTER
        assert used[FIRST_PROBE_AFTER : FIRST_PROBE_AFTER + 2 * PROBE_STEPS] == PROBE
        assert policy.decode == 2 and used[-5:] == [2] * 5
        # Then the machine gets loaded: two threads stall. Steps twice as slow as the
        # probe measured probe at once (not after PROBE_EVERY steps): one thread again.
        used = run_decode(policy, 2 + 2 * PROBE_STEPS + 5, {1: 0.02, 2: 0.08})
        # (the median of the last PROBE_STEPS steps crosses after two slow ones)
        assert used == [2, 2] + [1, 2] * PROBE_STEPS + [1] * 5 and policy.decode == 1
    finally:
        torch.set_num_threads(before)


def test_a_probe_that_is_not_clearly_faster_changes_nothing():
    before = torch.get_num_threads()
    try:
        policy = ComputeThreads(cores=2, decode=1)
        used = run_decode(policy, FIRST_PROBE_AFTER + 2 * PROBE_STEPS + PROBE_EVERY, {1: 0.010, 2: 0.0095})
        assert policy.decode == 1 and policy.probes == 1
        assert used.count(2) == PROBE_STEPS, "one probe, then the kept count until the next"
    finally:
        torch.set_num_threads(before)


def test_a_draining_batch_does_not_decide_the_count():
    """The batch shrinks step by step (requests finishing), so each step costs more per
    request than the one before: compared with the steps before it, a probe of a faster
    count would look slower. Alternating steps compare like with like."""
    before = torch.get_num_threads()
    try:
        policy = ComputeThreads(cores=2, decode=1)
        # Per-request cost falls with batch size (fixed weight reads shared by the batch).
        seconds_at = {1: 0.010, 2: 0.007}
        draining = lambda i: max(1, 64 - 6 * i)  # noqa: E731

        def step_seconds(threads: int, size: int) -> float:
            return seconds_at[threads] * (1 + 16 / size)

        used = []
        for i in range(FIRST_PROBE_AFTER + 2 * PROBE_STEPS + 1):
            policy.apply(ForwardMode.DECODE)
            used.append(torch.get_num_threads())
            size = draining(i)
            policy.observe_decode(step_seconds(torch.get_num_threads(), size) * size, size)
        assert policy.decode == 2, "two threads are faster at every batch size"
        assert used[FIRST_PROBE_AFTER + 2 * PROBE_STEPS] == 2
    finally:
        torch.set_num_threads(before)


def test_a_batch_twice_as_large_probes_again():
    """A server's warm-up request decodes alone, where two threads gain nothing, and the
    decision made then must not hold when a burst of requests decodes together."""
    before = torch.get_num_threads()
    try:
        policy = ComputeThreads(cores=2, decode=1)
        run_decode(policy, FIRST_PROBE_AFTER + 2 * PROBE_STEPS + 4, {1: 0.010, 2: 0.010}, bs=1)
        assert policy.decode == 1 and policy.probes == 1
        used = run_decode(policy, 3 * PROBE_STEPS + 4, {1: 0.002, 2: 0.001}, bs=16)
        assert policy.probes == 2 and policy.decode == 2, "probed again at 16 requests, well before PROBE_EVERY"
        assert used[-4:] == [2] * 4
        # A batch of similar size does not probe again before PROBE_EVERY steps.
        run_decode(policy, 20, {1: 0.002, 2: 0.001}, bs=24)
        assert policy.probes == 2
    finally:
        torch.set_num_threads(before)


def test_a_larger_batch_keeps_every_core_without_probing():
    """Once every core won, a batch that grows does not probe (its steps on fewer threads
    would only cost time); one that shrinks to half does."""
    before = torch.get_num_threads()
    try:
        policy = ComputeThreads(cores=2, decode=1)
        run_decode(policy, FIRST_PROBE_AFTER + 2 * PROBE_STEPS + 4, {1: 0.004, 2: 0.002}, bs=4)
        assert policy.decode == 2 and policy.probes == 1
        used = run_decode(policy, 20, {1: 0.002, 2: 0.001}, bs=64)
        assert policy.probes == 1 and used == [2] * 20
        used = run_decode(policy, 3 * PROBE_STEPS + 4, {1: 0.004, 2: 0.002}, bs=2)
        assert policy.probes == 2 and 1 in used and policy.decode == 2
    finally:
        torch.set_num_threads(before)


def test_one_core_never_probes():
    policy = ComputeThreads(cores=1, decode=1)
    assert run_decode(policy, FIRST_PROBE_AFTER + 20, {1: 0.01}) == [1] * (FIRST_PROBE_AFTER + 20)
    assert policy.probes == 0


def test_no_policy_on_gpu_or_when_omp_threads_are_set(monkeypatch):
    assert ComputeThreads.for_device("cuda") is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert ComputeThreads.for_device("cpu") is None


def test_the_front_end_cpu_only_for_one_scheduler_on_a_cpu(monkeypatch):
    monkeypatch.delenv(BIND_ENV, raising=False)
    for var in USER_BINDING_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 1, 2})
    assert front_end_cpu("cpu", 1) == 3, "the last CPU this process may use"
    assert front_end_cpu("cuda", 1) is None
    assert front_end_cpu("cpu", 2) is None, "ranks split the cores: nothing bound"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert front_end_cpu("cpu", 1) is None, "one CPU: nothing to keep apart"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv(BIND_ENV, "0")
    assert front_end_cpu("cpu", 1) is None
    monkeypatch.delenv(BIND_ENV)
    monkeypatch.setenv("OMP_PROC_BIND", "close")
    assert front_end_cpu("cpu", 1) is None, "the user binds OpenMP's threads"


# Run in a child process: binding would pin the test process's own threads.
BIND_CHILD = """
import json, os, threading, torch
from tandem.kernels import cpu
ops = cpu.load()
cpus = sorted(os.sched_getaffinity(0))[:2]
first = list(ops.bind_threads(cpus))
torch.set_num_threads(1)
torch.ones(1 << 20).sum()
torch.set_num_threads(2)
(torch.ones(1 << 22) * 2).sum()  # regions of PyTorch's own, on the same team
second = list(ops.bind_threads(cpus))
allowed = {t: sorted(os.sched_getaffinity(t)) for t in first}
print(json.dumps({"cpus": cpus, "first": first, "second": second, "allowed": allowed, "me": threading.get_native_id()}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding needs two CPUs")
def test_bind_threads_binds_each_member_of_the_team_to_its_cpu():
    if cpu_kernels.load() is None:
        pytest.skip("the C++ kernels are not built")
    out = subprocess.run([sys.executable, "-c", BIND_CHILD], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    cpus, first = got["cpus"], got["first"]
    assert len(first) == 2 and len(set(first)) == 2
    assert first[0] == got["me"], "the calling thread is member 0"
    assert got["second"] == first, "later regions reuse the same threads, member for member"
    assert [got["allowed"][str(t)] for t in first] == [[c] for c in cpus]
