"""ServerProcesses.shutdown after a start-up that failed part-way: the children never
started (a later `Process.start()` raised) are skipped, so the start-up's own error is what
the caller sees, not multiprocessing's "can only join a started process"."""

from __future__ import annotations

import multiprocessing as mp
import os

import psutil

from tandem.entrypoints.subprocesses import ServerProcesses
from tandem.server_args import PortArgs


def test_shutdown_skips_children_that_never_started():
    port_args = PortArgs.create()
    ctx = mp.get_context("spawn")
    started = ctx.Process(target=os.getpid, name="started")
    started.start()
    never = ctx.Process(target=os.getpid, name="never")
    handle = ServerProcesses(port_args=port_args, procs=[started, never], scheduler_info={})
    handle.shutdown()
    assert not psutil.pid_exists(started.pid) and never.pid is None
    assert not os.path.exists(port_args.ipc_dir)
