"""The CPU compute-thread policy: every core for prefill, one left free for short decode
steps, every core once decode steps are long."""

from __future__ import annotations

import torch

from tandem.forward_batch import ForwardMode
from tandem.utils.cpu_threads import LONG_DECODE_STEP_S, ComputeThreads


def test_policy_switches_threads_by_mode_and_step_length():
    before = torch.get_num_threads()
    try:
        policy = ComputeThreads(cores=2, decode=1)
        policy.apply(ForwardMode.EXTEND)
        assert torch.get_num_threads() == 2
        policy.apply(ForwardMode.DECODE)
        assert torch.get_num_threads() == 1
        for _ in range(50):
            policy.observe_decode(LONG_DECODE_STEP_S / 3)
        assert policy.decode == 1, "short steps keep a core free"
        for _ in range(50):
            policy.observe_decode(LONG_DECODE_STEP_S * 3)
        assert policy.decode == 2
        policy.apply(ForwardMode.DECODE)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_no_policy_on_gpu_or_when_omp_threads_are_set(monkeypatch):
    assert ComputeThreads.for_device("cuda") is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert ComputeThreads.for_device("cpu") is None
