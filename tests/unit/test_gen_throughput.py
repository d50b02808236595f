"""The scheduler's generation throughput meter (/v1/loads' gen_throughput)."""

from __future__ import annotations

import pytest

from tandem.scheduler.throughput import GenThroughput


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rate_of_a_steady_stream_from_its_start_then_zero_once_idle():
    clock = Clock()
    meter = GenThroughput(window=5.0, clock=clock)
    assert meter.rate() == 0.0
    meter.add(4)  # one batch alone gives no rate: it only starts the span
    assert meter.rate() == 0.0
    for _ in range(20):  # 2 requests, a batch every 50 ms: 40 tok/s
        clock.now += 0.05
        meter.add(2)
    assert meter.rate() == pytest.approx(40.0)
    for _ in range(200):  # 10 s more: only the last 5 s count
        clock.now += 0.05
        meter.add(1)
    assert meter.rate() == pytest.approx(20.0, rel=0.02)
    meter.add(0)  # a batch that produced nothing (a prompt chunk) is not a stamp
    clock.now += 2.5  # idle: the rate decays, then is 0 after the window
    assert 0.0 < meter.rate() < 20.0
    clock.now += 2.5
    assert meter.rate() == 0.0
