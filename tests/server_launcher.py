"""Starts a real Tandem server process for tests and stops it, checking that none of its
processes remains afterwards."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from tandem.utils.process import free_port, pid_alive

LOG_DIR = Path(os.environ.get("TANDEM_TEST_LOG_DIR", "/tmp/tandem-test-logs"))

# Servers started and not yet stopped; conftest stops any left at the end of the session
# (a test that failed before its own cleanup), so no test run leaks a process.
LIVE: set[ServerHandle] = set()


class ServerHandle:
    def __init__(
        self,
        model_path: str,
        extra_args: list[str] | None = None,
        timeout: float = 180.0,
        env: dict[str, str] | None = None,
        new_session: bool = False,
        wait_ready: bool = True,
    ):
        """`new_session`: start the server in its own process group (for tests that kill
        the group). `wait_ready=False`: return once started, for a process that serves no
        HTTP (a node other than node 0 of --nnodes)."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"server-{self.port}.log"
        cmd = [
            sys.executable,
            "-m",
            "tandem.launch_server",
            "--model-path",
            str(model_path),
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *(extra_args or []),
        ]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=new_session,
        )
        self.pids: set[int] = {self.proc.pid}
        self.stop_seconds: float | None = None  # from the signal to the main process's exit
        LIVE.add(self)
        try:
            if wait_ready:
                self._wait_ready(timeout)
        except BaseException:
            self.stop(check=False)
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    self.pids |= self.child_pids()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log_tail()}")

    def child_pids(self) -> set[int]:
        try:
            return {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            return set()

    def ipc_dirs(self) -> list[str]:
        """The server's ipc directories (named after its main process)."""
        return glob.glob(os.path.join(tempfile.gettempdir(), f"tandem-ipc-{self.proc.pid}-*"))

    def log_tail(self, n: int = 40) -> str:
        if not self._log.closed:
            self._log.flush()
        return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])

    def stop(self, sig: int = signal.SIGTERM, check: bool = True, timeout: float = 30.0) -> list[int]:
        """Signal the server, wait for it, and return the pids that survived (then kill them).

        With `check`, raise AssertionError if any of the server's processes survived.
        """
        LIVE.discard(self)
        self.pids |= self.child_pids()
        tic = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout)
            self.stop_seconds = time.monotonic() - tic
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        survivors = []
        deadline = time.monotonic() + 10
        for pid in sorted(self.pids):
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if pid_alive(pid):
                survivors.append(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        self._log.close()
        if check and survivors:
            raise AssertionError(f"server processes survived shutdown: {survivors}")
        return survivors

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop(check=exc[0] is None)
