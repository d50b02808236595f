"""GET /health_generate's probe (shared, skipped after recent progress) and the sweep of
ipc directories left by dead servers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

from tandem.entrypoints.health import GenerationProbe
from tandem.utils.ipc_dirs import PREFIX, remove_stale_ipc_dirs


class FakeTM:
    """Counts probe generations; each finishes when `release` is set."""

    def __init__(self):
        self.last_receive_tstamp = 0.0
        self.calls = 0
        self.release = asyncio.Event()

    async def generate_request(self, obj):
        self.calls += 1

        async def stream():
            await self.release.wait()
            self.last_receive_tstamp = time.time()
            yield {"meta_info": {"finish_reason": {"type": "length"}}}

        return [stream()]


def test_concurrent_checks_share_one_probe_and_recent_progress_skips_it():
    async def scenario():
        tm = FakeTM()
        probe = GenerationProbe(tm)
        checks = [asyncio.create_task(probe.check()) for _ in range(5)]
        await asyncio.sleep(0.05)
        assert tm.calls == 1
        tm.release.set()
        assert await asyncio.gather(*checks) == [None] * 5
        assert await probe.check() is None and tm.calls == 1  # output just arrived: no probe
        tm.last_receive_tstamp = 0.0
        assert await probe.check() is None and tm.calls == 2

    asyncio.run(scenario())


def test_a_probe_that_times_out_reports_why():
    async def scenario():
        tm = FakeTM()
        probe = GenerationProbe(tm)
        probe.timeout_s = 0.1
        problem = await probe.check()
        assert problem is not None and problem.startswith("engine did not answer: TimeoutError")

    asyncio.run(scenario())


def test_stale_ipc_dirs_of_dead_owners_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{PREFIX}{os.getpid()}-def"
    other = tmp_path / "tandem-ipc-legacy"
    for d in (stale, live, other):
        d.mkdir()
    (stale / "tokenizer_to_scheduler").touch()
    assert remove_stale_ipc_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()
