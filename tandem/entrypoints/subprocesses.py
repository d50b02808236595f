"""Starts a server's subprocesses (one scheduler per tensor-parallel rank, the
detokenizer) and waits for their readiness.

Shared by the HTTP server and the offline Engine: both own a `ServerProcesses` and
call `shutdown()` to end every child. A child that dies unexpectedly is noticed by a
watchdog thread, which calls `on_child_death` (the HTTP server exits; no orphan and no
server answering 200 without an engine behind it); so does any rank's death under
tensor parallelism (the other ranks would hang in a collective). Children ignore SIGINT
and SIGTERM (a terminal or service manager signals the whole group; the main process
drains first), so `shutdown()` ends them with SIGKILL: they hold nothing to flush.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from tandem.managers.detokenizer_manager import run_detokenizer_process
from tandem.entrypoints.health import EngineHealth
from tandem.managers.forward_watchdog import new_forward_stamp
from tandem.managers.io_struct import ReadyMessage
from tandem.managers.scheduler import run_scheduler_process
from tandem.server_args import PortArgs, ServerArgs
from tandem.utils import zmq_io
from tandem.utils.ipc_dirs import remove_stale_ipc_dirs
from tandem.utils.process import kill_process_tree

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0


@dataclass
class ServerProcesses:
    port_args: PortArgs
    procs: list[mp.Process]
    scheduler_info: dict[str, Any]
    # When scheduler rank 0's current forward step started (time.monotonic()), 0.0 between steps.
    forward_stamp: Any = None
    _stopping: threading.Event = field(default_factory=threading.Event)
    # Children whose exit is no longer a failure (tokenizer workers that drained).
    _may_exit: set[str] = field(default_factory=set)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def health(self) -> EngineHealth:
        """What GET /health checks (picklable: tokenizer worker processes check it too)."""
        return EngineHealth({p.name: p.pid for p in self.procs if p.pid is not None}, self.forward_stamp)

    def allow_exit(self, names: list[str]) -> None:
        """From now on the watchdog ignores these children's exit."""
        self._may_exit.update(names)

    def exited(self) -> list[str]:
        """The names of the children that have exited (`scheduler_TP1`, `detokenizer`, ...)."""
        return [p.name for p in self.procs if not p.is_alive()]

    def shutdown(self) -> None:
        """End every subprocess and its descendants (SIGKILL) and remove the ipc directory."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        for p in self.procs:
            if p.pid is not None:
                kill_process_tree(p.pid, sig=signal.SIGKILL)
        for p in self.procs:
            p.join(timeout=5)
        shutil.rmtree(self.port_args.ipc_dir, ignore_errors=True)

    def watch(self, on_child_death: Callable[[str], None], interval: float = 0.5) -> None:
        """Start a daemon thread that calls `on_child_death(name)` if a child exits."""
        def loop() -> None:
            while not self._stopping.wait(interval):
                for p in self.procs:
                    if p.name not in self._may_exit and not p.is_alive():
                        if not self._stopping.is_set():
                            on_child_death(p.name)
                        return

        threading.Thread(target=loop, name="child-watchdog", daemon=True).start()


def launch_subprocesses(server_args: ServerArgs) -> ServerProcesses:
    """Spawn the scheduler ranks (`scheduler_TP{k}`, k < --tp-size) and the detokenizer,
    wait until all report ready. Rank 0's readiness carries the resolved capacities.

    Raises RuntimeError (after cleaning up) when one fails to start. First removes the
    ipc directories of servers that were killed before they could remove their own.
    """
    remove_stale_ipc_dirs()
    port_args = PortArgs.create()
    ctx = zmq.Context.instance()
    ready_sock = zmq_io.make_socket(ctx, zmq.PULL, port_args.ready, bind=True)
    mp_ctx = mp.get_context("spawn")
    forward_stamp = new_forward_stamp(mp_ctx)
    procs = [mp_ctx.Process(target=run_scheduler_process,
                            args=(server_args, port_args, rank, forward_stamp if rank == 0 else None),
                            name=f"scheduler_TP{rank}")
             for rank in range(server_args.tp_size)]
    if not server_args.skip_tokenizer_init:  # without a tokenizer, no detokenization runs
        procs.append(mp_ctx.Process(target=run_detokenizer_process, args=(server_args, port_args), name="detokenizer"))
    handle = ServerProcesses(port_args=port_args, procs=procs, scheduler_info={}, forward_stamp=forward_stamp)
    try:
        for p in procs:
            p.start()
        waiting = {p.name for p in procs}
        deadline = time.monotonic() + READY_TIMEOUT_S
        while waiting:
            if ready_sock.poll(200):
                msg: ReadyMessage = zmq_io.loads(ready_sock.recv())
                if not msg.ok:
                    raise RuntimeError(f"{msg.process} failed to start: {msg.error}")
                waiting.discard(msg.process)
                if msg.process == "scheduler_TP0":
                    handle.scheduler_info = msg.info
                continue
            dead = [p.name for p in procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"{dead[0]} exited during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{sorted(waiting)} not ready after {READY_TIMEOUT_S:.0f} s")
    except BaseException:
        handle.shutdown()
        raise
    finally:
        ready_sock.close()
    return handle
