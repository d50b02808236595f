"""The life of a server's processes, each fault caused on purpose.

SIGTERM and SIGINT drain (new requests and /health get 503, running requests finish
within --graceful-shutdown-timeout or are aborted with a message) and exit 0 with no
process and no ipc directory left, at once when idle (not after the grace period). A child that dies, or a
forward step stuck past --watchdog-timeout, takes the server down (exit 1, nothing left;
the stacks and the batch in the log); with TANDEM_KILLPG_ON_SCHEDULER_EXCEPTION=1 the
whole process group dies at once. Processes carry their names.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from server_launcher import ServerHandle

from tandem.entrypoints.health import RECENT_PROGRESS_S
from tandem.scheduler.forward_watchdog import TEST_FORWARD_SLEEP_LOG
from tandem.utils.ipc_dirs import remove_stale_ipc_dirs

# An idle server exits at once (about 0.3 s here), not after its grace period: the test
# gives it a long one, and the bound is a fraction of it, not a guess at the machine's speed.
IDLE_GRACE_S = 60
SHUTTING_DOWN = "the server is shutting down"


def _children(server: ServerHandle) -> dict[str, psutil.Process]:
    """The server's subprocesses by their title (`tandem::...`, their command line)."""
    children = psutil.Process(server.proc.pid).children(recursive=True)
    return {p.cmdline()[0]: p for p in children if p.cmdline()[0].startswith("tandem::")}


def _wait_log(server: ServerHandle, text: str, timeout: float = 60.0) -> None:
    """Wait until the server's log holds `text` (an event, not a guessed delay)."""
    deadline = time.monotonic() + timeout
    while text not in server.log_path.read_text(errors="replace"):
        assert server.proc.poll() is None, server.log_tail()
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.05)


def _wait_exit(server: ServerHandle, timeout: float) -> int | None:
    try:
        return server.proc.wait(timeout=timeout)
    except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: reported by the caller's assert
        return None


class _Stream(threading.Thread):
    """A streaming /generate in a thread: every chunk, the first one signalled."""

    def __init__(self, base_url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = base_url + "/generate", {**body, "stream": True}
        self.chunks: list[dict] = []
        self.started = threading.Event()
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.chunks.append(httpx.Response(200, content=line[6:]).json())
                        self.started.set()
        except Exception as e:  # noqa: BLE001 - checked by the test
            self.error = e
        finally:
            self.started.set()

    def finish_reason(self) -> dict:
        self.join(timeout=60)
        assert not self.is_alive() and self.error is None and self.chunks, (self.error, self.chunks[-1:])
        return self.chunks[-1]["meta_info"]["finish_reason"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_when_idle_exits_0_and_leaves_nothing(tiny_llama_dir, sig):
    server = ServerHandle(
        tiny_llama_dir, extra_args=["--skip-server-warmup", "--graceful-shutdown-timeout", str(IDLE_GRACE_S)]
    )
    try:
        assert psutil.Process(server.proc.pid).name() == "tandem::server"
        assert "tandem.launch_server" in " ".join(psutil.Process(server.proc.pid).cmdline())
        assert set(_children(server)) == {"tandem::scheduler_TP0", "tandem::detokenizer"}
        [ipc_dir] = server.ipc_dirs()
        r = httpx.post(server.base_url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200
    finally:
        survivors = server.stop(sig=sig, check=False)
    assert server.proc.returncode == 0, server.log_tail()
    assert survivors == []
    assert not os.path.exists(ipc_dir)
    assert server.stop_seconds < IDLE_GRACE_S / 4, server.stop_seconds
    assert "Traceback" not in server.log_tail(200)


def test_sigterm_drains_running_requests_then_aborts_the_rest(tiny_llama_dir):
    """Each forward sleeps 20 ms (test hook). A 1000-token request cannot finish within the
    10 s grace period whatever the machine (its sleeps alone take 20 s); a 20-token one
    (0.4 s of sleeps, a second or two on a loaded machine) does."""
    server = ServerHandle(
        tiny_llama_dir,
        extra_args=["--skip-server-warmup", "--graceful-shutdown-timeout", "10"],
        env={"TANDEM_TEST_FORWARD_SLEEP_S": "0.02"},
    )
    try:
        [ipc_dir] = server.ipc_dirs()
        params = {"temperature": 0, "ignore_eos": True}
        short = _Stream(server.base_url, {"text": "short", "sampling_params": {**params, "max_new_tokens": 20}})
        long = _Stream(server.base_url, {"text": "long", "sampling_params": {**params, "max_new_tokens": 1000}})
        assert short.started.wait(30) and long.started.wait(30)
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while httpx.get(server.base_url + "/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        health = httpx.get(server.base_url + "/health")
        assert health.status_code == 503 and health.json()["error"]["message"] == SHUTTING_DOWN
        refused = httpx.post(server.base_url + "/generate", json={"text": "new", "sampling_params": params})
        assert refused.status_code == 503 and refused.json()["error"]["message"] == SHUTTING_DOWN
        assert httpx.get(server.base_url + "/health_generate").status_code == 503
        assert (
            httpx.post(
                server.base_url + "/v1/completions", json={"model": str(tiny_llama_dir), "prompt": "x"}
            ).status_code
            == 503
        )
        assert short.finish_reason() == {"type": "length", "length": 20}
        aborted = long.finish_reason()
        assert aborted["type"] == "abort" and SHUTTING_DOWN in aborted["message"], aborted
        assert _wait_exit(server, 30) == 0, server.log_tail()
    finally:
        survivors = server.stop(check=False)
    assert survivors == []
    assert not os.path.exists(ipc_dir)


def test_child_death_takes_the_server_down(tiny_llama_dir):
    server = ServerHandle(tiny_llama_dir, extra_args=["--skip-server-warmup"])
    try:
        [ipc_dir] = server.ipc_dirs()
        os.kill(_children(server)["tandem::detokenizer"].pid, signal.SIGKILL)
        assert _wait_exit(server, 20) == 1, "main process kept running after a child died"
    finally:
        survivors = server.stop(check=False)
    assert survivors == []
    assert not os.path.exists(ipc_dir)


def test_stuck_forward_fails_health_then_the_watchdog_takes_the_server_down(tiny_llama_dir):
    """Every forward sleeps 60 s (test hook); --watchdog-timeout 4. The scheduler is frozen
    (SIGSTOP) mid-forward so that /health is seen answering 503 before its watchdog acts."""
    server = ServerHandle(
        tiny_llama_dir,
        extra_args=["--skip-server-warmup", "--watchdog-timeout", "4"],
        env={"TANDEM_TEST_FORWARD_SLEEP_S": "60"},
    )
    try:
        [ipc_dir] = server.ipc_dirs()
        scheduler = _children(server)["tandem::scheduler_TP0"]
        stuck = _Stream(server.base_url, {"text": "stuck", "sampling_params": {"max_new_tokens": 2}})
        _wait_log(server, TEST_FORWARD_SLEEP_LOG)  # its forward step is under way
        scheduler.suspend()
        try:
            deadline = time.monotonic() + 15
            while (health := httpx.get(server.base_url + "/health")).status_code == 200:
                assert time.monotonic() < deadline, "/health kept answering 200 with a stuck forward"
                time.sleep(0.2)
            assert health.status_code == 503 and "--watchdog-timeout 4" in health.json()["error"]["message"]
        finally:
            scheduler.resume()
        assert _wait_exit(server, 30) == 1, server.log_tail()
        stuck.join(timeout=10)
        assert stuck.error is not None or not stuck.chunks  # the connection went down with the server
    finally:
        survivors = server.stop(check=False)
    log = server.log_tail(400)
    assert "past --watchdog-timeout 4 s" in log
    assert "most recent call first" in log and "in watching" in log  # faulthandler's stack dump
    assert "the batch being forwarded: EXTEND of 1 requests" in log and "prompt_len=" in log
    assert survivors == []
    assert not os.path.exists(ipc_dir)


def test_killpg_on_scheduler_exception_kills_the_group(tiny_llama_dir):
    """TANDEM_KILLPG_ON_SCHEDULER_EXCEPTION=1: the failing scheduler SIGKILLs its whole
    process group; the ipc directory it leaves is removed by the next start-up's sweep."""
    server = ServerHandle(
        tiny_llama_dir,
        extra_args=["--skip-server-warmup", "--watchdog-timeout", "1"],
        env={"TANDEM_TEST_FORWARD_SLEEP_S": "60", "TANDEM_KILLPG_ON_SCHEDULER_EXCEPTION": "1"},
        new_session=True,
    )
    try:
        [ipc_dir] = server.ipc_dirs()
        _Stream(server.base_url, {"text": "stuck", "sampling_params": {"max_new_tokens": 2}})
        assert _wait_exit(server, 30) == -signal.SIGKILL, server.log_tail()
    finally:
        survivors = server.stop(check=False)
    assert survivors == []
    assert "TANDEM_KILLPG_ON_SCHEDULER_EXCEPTION is set" in server.log_tail(400)
    assert os.path.exists(ipc_dir)
    assert ipc_dir in remove_stale_ipc_dirs() and not os.path.exists(ipc_dir)


def test_health_generate_answers_from_progress_or_a_probe(tiny_llama_dir):
    with ServerHandle(
        tiny_llama_dir, extra_args=["--skip-server-warmup"], env={"TANDEM_HEALTH_CHECK_TIMEOUT": "2"}
    ) as server:
        assert httpx.get(server.base_url + "/health_generate", timeout=30).status_code == 200
        spawned = list(_children(server).values())
        for p in spawned:
            p.suspend()
        try:
            # Output came less than RECENT_PROGRESS_S ago: healthy without running the model.
            assert httpx.get(server.base_url + "/health_generate", timeout=30).status_code == 200
            time.sleep(RECENT_PROGRESS_S)
            r = httpx.get(server.base_url + "/health_generate", timeout=30)
            assert r.status_code == 503 and "engine did not answer" in r.json()["error"]["message"]
            assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200  # processes alive, idle
        finally:
            for p in spawned:
                p.resume()
        assert httpx.get(server.base_url + "/health_generate", timeout=30).status_code == 200


def _allowed_cpus(proc: psutil.Process) -> dict[int, set[int]]:
    """The CPUs each thread of `proc` may run on, by thread id."""
    return {t.id: os.sched_getaffinity(t.id) for t in proc.threads()}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="placement needs two CPUs")
def test_one_scheduler_on_cpu_binds_its_compute_threads_and_keeps_the_rest_to_the_last_cpu(tiny_llama_dir):
    """tandem/utils/cpu_threads.py, "Placement": the scheduler's forward thread on the first
    CPU, every thread of the HTTP and detokenizer processes on the last; TANDEM_CPU_BIND=0
    leaves every thread free."""
    cpus = sorted(os.sched_getaffinity(0))
    first, last = {cpus[0]}, {cpus[-1]}
    prompt = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    with ServerHandle(tiny_llama_dir, extra_args=["--skip-server-warmup"]) as server:
        assert httpx.post(server.base_url + "/generate", json=prompt).status_code == 200  # a forward: bound by now
        children = _children(server)
        scheduler = _allowed_cpus(children["tandem::scheduler_TP0"])
        assert scheduler[children["tandem::scheduler_TP0"].pid] == first, scheduler
        assert all(len(allowed) == 1 for allowed in scheduler.values()), scheduler
        assert last in scheduler.values(), "its other threads (ZMQ I/O, OpenMP's last) on the last CPU"
        for proc in (children["tandem::detokenizer"], psutil.Process(server.proc.pid)):
            allowed = _allowed_cpus(proc)
            assert all(a == last for a in allowed.values()), (proc.name(), allowed)
    with ServerHandle(tiny_llama_dir, extra_args=["--skip-server-warmup"], env={"TANDEM_CPU_BIND": "0"}) as server:
        assert httpx.post(server.base_url + "/generate", json=prompt).status_code == 200
        procs = [psutil.Process(server.proc.pid), *_children(server).values()]
        assert all(a == set(cpus) for p in procs for a in _allowed_cpus(p).values())
