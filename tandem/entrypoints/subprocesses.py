"""Starts a server's subprocesses (one scheduler per tensor-parallel rank of each
data-parallel replica, the data-parallel controller when there are replicas, the
detokenizer) and waits for their readiness. On a node other than node 0 (`--node-rank`
> 0) only that node's scheduler ranks (distributed/placement.py).

Shared by the HTTP server and the offline Engine: both own a `ServerProcesses` and
call `shutdown()` to end every child. A child that dies unexpectedly is noticed by a
watchdog thread, which calls `on_child_death` (the HTTP server exits; no orphan and no
server answering 200 without an engine behind it); so does any rank's death under
tensor parallelism (the other ranks would hang in a collective). Children ignore SIGINT
and SIGTERM (a terminal or service manager signals the whole group; the main process
drains first), so `shutdown()` ends them with SIGKILL: they hold nothing to flush.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from tandem.data_parallel.controller import PROCESS_NAME as DP_CONTROLLER
from tandem.data_parallel.controller import run_data_parallel_controller_process
from tandem.detokenizer.detokenizer_manager import run_detokenizer_process
from tandem.distributed.placement import local_scheduler_ranks
from tandem.entrypoints.health import EngineHealth
from tandem.messages import ReadyMessage
from tandem.scheduler.forward_watchdog import new_forward_stamp
from tandem.scheduler.process import run_scheduler_process
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
        live = [p for p in self.procs if p.pid is not None and p.is_alive()]
        # NOTE: frozen first, so that no TP rank sees a peer die and reports a crash
        # (SIGQUIT, which ends an offline Engine's caller) before its own SIGKILL lands.
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGSTOP)
        started = [p for p in self.procs if p.pid is not None]  # a failed start-up may not have started all
        for p in started:
            kill_process_tree(p.pid, sig=signal.SIGKILL)
        for p in started:
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


class StartupError(RuntimeError):
    """A subprocess failed to start (it logged the details itself)."""


def launch_subprocesses(server_args: ServerArgs) -> ServerProcesses:
    """Spawn this node's scheduler ranks (`scheduler_TP{k}`, k < --tp-size, or
    `scheduler_DP{d}_TP{k}` for each replica d < --dp-size) and, on node 0, the
    data-parallel controller (--dp-size > 1) and the detokenizer; wait until all report
    ready. The first rank's readiness carries the resolved capacities (node 0).

    Raises StartupError (after cleaning up) when one fails to start. First removes the
    ipc directories of servers that were killed before they could remove their own.
    """
    remove_stale_ipc_dirs()
    port_args = PortArgs.create()
    ctx = zmq.Context.instance()
    ready_sock = zmq_io.make_socket(ctx, zmq.PULL, port_args.ready, bind=True)
    mp_ctx = mp.get_context("spawn")
    forward_stamp = new_forward_stamp(mp_ctx)
    ranks = local_scheduler_ranks(server_args)
    procs = [
        mp_ctx.Process(
            target=run_scheduler_process,
            args=(server_args, port_args, rank, forward_stamp if rank.is_first else None),
            name=rank.name,
        )
        for rank in ranks
    ]
    if server_args.node_rank == 0 and server_args.dp_size > 1:
        procs.append(
            mp_ctx.Process(
                target=run_data_parallel_controller_process, args=(server_args, port_args), name=DP_CONTROLLER
            )
        )
    # Without a tokenizer no detokenization runs; other nodes run only scheduler ranks.
    if server_args.node_rank == 0 and not server_args.skip_tokenizer_init:
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
                    raise StartupError(f"{msg.process} failed to start: {msg.error}")
                waiting.discard(msg.process)
                if msg.process == ranks[0].name and ranks[0].is_first:
                    handle.scheduler_info = msg.info
                continue
            dead = [p.name for p in procs if not p.is_alive()]
            if dead:
                raise StartupError(f"{dead[0]} exited during start-up")
            if time.monotonic() > deadline:
                raise StartupError(f"{sorted(waiting)} not ready after {READY_TIMEOUT_S:.0f} s")
    except BaseException:
        handle.shutdown()
        raise
    finally:
        ready_sock.close()
    return handle
