"""Every process of a server ends with it: on SIGTERM, on Ctrl-C, and when a child dies."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from server_launcher import ServerHandle


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_ends_every_process(tiny_llama_dir, sig):
    server = ServerHandle(tiny_llama_dir, extra_args=["--skip-server-warmup"])
    try:
        children = server.child_pids()
        assert len(children) >= 2, "scheduler and detokenizer should be running"
        r = httpx.post(server.base_url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200
    finally:
        survivors = server.stop(sig=sig, check=False)
    assert survivors == []
    assert not [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_scheduler_death_takes_the_server_down(tiny_llama_dir):
    server = ServerHandle(tiny_llama_dir, extra_args=["--skip-server-warmup"])
    try:
        children = psutil.Process(server.proc.pid).children(recursive=True)
        spawned = [p for p in children if "spawn_main" in " ".join(p.cmdline())]
        assert len(spawned) == 2, "scheduler and detokenizer"
        os.kill(spawned[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.proc.poll() is not None, "main process kept running after a child died"
    finally:
        survivors = server.stop(check=False)
    assert survivors == []


def test_health_generate_reports_a_stuck_engine(tiny_llama_dir):
    with ServerHandle(tiny_llama_dir, extra_args=["--skip-server-warmup"],
                      env={"TANDEM_HEALTH_CHECK_TIMEOUT": "2"}) as server:
        assert httpx.get(server.base_url + "/health_generate", timeout=30).status_code == 200
        spawned = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
                   if "spawn_main" in " ".join(p.cmdline())]
        for p in spawned:
            p.suspend()
        try:
            r = httpx.get(server.base_url + "/health_generate", timeout=30)
            assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
            assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
        finally:
            for p in spawned:
                p.resume()
        assert httpx.get(server.base_url + "/health_generate", timeout=30).status_code == 200
