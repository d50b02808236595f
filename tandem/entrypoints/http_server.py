"""The HTTP server process: launch the subprocesses, serve the app (app.py) with uvicorn
until SIGTERM or SIGINT, drain, end every child (`launch_server`); and the entry of each
tokenizer worker under --tokenizer-worker-num N > 1.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI

from tandem.entrypoints.app import create_app
from tandem.entrypoints.follower_node import run_follower_node
from tandem.entrypoints.health import EngineHealth
from tandem.entrypoints.shutdown import WORKER_DRAIN_SIGNAL, DrainingServer
from tandem.entrypoints.subprocesses import ServerProcesses, launch_subprocesses
from tandem.entrypoints.tokenizer_workers import serve_with_workers
from tandem.metrics.collector import enable_multiprocess_metrics
from tandem.server_args import PortArgs, ServerArgs
from tandem.tokenizer.tokenizer_manager import TokenizerManager
from tandem.utils.cpu_threads import front_end_cpu, keep_threads_to
from tandem.utils.process import (
    configure_logging,
    exit_now,
    ignore_stop_signals,
    kill_process_tree,
    notify_parent_of_failure,
    set_parent_death_signal,
    set_process_name,
    set_process_title,
)

logger = logging.getLogger(__name__)


def launch_server(server_args: ServerArgs) -> None:
    """Start the subprocesses, serve HTTP until SIGTERM or SIGINT, drain (entrypoints/
    shutdown.py), end every child, remove the ipc directory and return (exit code 0).
    A child that crashes or dies takes the server down with exit code 1."""
    configure_logging(server_args.log_level, "main")
    server_args.validate()
    if server_args.node_rank > 0:  # only this node's scheduler ranks: node 0 serves HTTP
        run_follower_node(server_args)
        return
    set_process_name("tandem::server")  # the command line stays as it was, for scripts
    procs: ServerProcesses = launch_subprocesses(server_args)
    front = front_end_cpu(server_args.device, server_args.local_scheduler_ranks)
    if front is not None and server_args.tokenizer_worker_num == 1:  # after the children started: not theirs
        keep_threads_to(front)  # tandem/utils/cpu_threads.py, "Placement"
    if server_args.enable_metrics:  # before any TokenizerManager, in this process or a worker
        enable_multiprocess_metrics(procs.port_args.ipc_dir)

    def on_child_death(name: str) -> None:
        logger.error("%s died; shutting the server down", name)
        procs.shutdown()
        exit_now(1)

    def on_sigquit(signum, frame) -> None:  # a child reported a crash
        # NOTE: a scheduler rank fails in a collective when another rank died: name the dead.
        dead = procs.exited()
        logger.error("a subprocess crashed%s; shutting the server down", f" ({', '.join(dead)} exited)" if dead else "")
        procs.shutdown()
        exit_now(1)

    signal.signal(signal.SIGQUIT, on_sigquit)
    procs.watch(on_child_death)
    try:
        if server_args.tokenizer_worker_num > 1:
            serve_with_workers(server_args, procs, run_tokenizer_worker_process)
        else:
            tm = TokenizerManager(server_args, procs.port_args, procs.scheduler_info)
            app = create_app(tm, server_args, procs.health())
            DrainingServer(_uvicorn_config(app, server_args), tm, server_args.graceful_shutdown_timeout).run()
    finally:
        procs.shutdown()
        # Any other descendant (multiprocessing's resource tracker, which ignores SIGTERM).
        kill_process_tree(os.getpid(), include_parent=False, sig=signal.SIGKILL)


# An idle keep-alive connection is closed by the server only well after clients drop it
# themselves (httpx and the openai client: 5 s, aiohttp: 15 s). With the two equal, a
# client could send its next request on a connection the server was closing that moment:
# a reset (httpx.ReadError) on a busy server.
KEEP_ALIVE_S = 75


def _uvicorn_config(app: FastAPI, server_args: ServerArgs) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        log_level=server_args.log_level_http or server_args.log_level,
        timeout_keep_alive=KEEP_ALIVE_S,
        access_log=False,
    )


def run_tokenizer_worker_process(
    server_args: ServerArgs,
    port_args: PortArgs,
    scheduler_info: dict[str, Any],
    worker_id: int,
    sock: socket.socket,
    engine_health: EngineHealth,
) -> None:
    """Entry of tokenizer worker `worker_id` (--tokenizer-worker-num N > 1,
    entrypoints/tokenizer_workers.py): its own TokenizerManager and app, serving HTTP on
    the listening socket that every worker shares, until the main process drains it
    (WORKER_DRAIN_SIGNAL, twice to hurry); then it exits 0."""
    name = f"tokenizer_worker_{worker_id}"
    set_parent_death_signal()
    set_process_title(f"tandem::{name}")
    configure_logging(server_args.log_level, name)
    ignore_stop_signals()  # the main process drains us
    signal.signal(WORKER_DRAIN_SIGNAL, signal.SIG_IGN)  # until the server's own handler is in place
    try:
        tm = TokenizerManager(server_args, port_args, scheduler_info, worker_id=worker_id)
        app = create_app(tm, server_args, engine_health)
        DrainingServer(
            _uvicorn_config(app, server_args),
            tm,
            server_args.graceful_shutdown_timeout,
            stop_signals=(WORKER_DRAIN_SIGNAL,),
        ).run(sockets=[sock])
    except Exception:
        logger.exception("%s crashed", name)
        notify_parent_of_failure()
        exit_now(1)
    exit_now(0)
