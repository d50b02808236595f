"""--tokenizer-worker-num N > 1, the main process's side: start N tokenizer worker
processes (`tandem::tokenizer_worker_K`, each an HTTP server with its own
TokenizerManager), route the scheduler's replies to them, and drain them on SIGTERM/SIGINT.

The listening socket is bound once, here, and handed to every worker (as uvicorn's own
`--workers` does), rather than each worker binding the port with SO_REUSEPORT: it works
on every platform, a port already in use fails the start once in the main process, and
no other process can bind the same port alongside (SO_REUSEPORT lets any process of the
same user join the group and take a share of the connections). The kernel hands each
connection to whichever worker accepts it first; a busy worker accepts later, so load
evens out without a balancer.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Callable

from tandem.entrypoints.shutdown import ABORT_FLUSH_S, CLOSE_TIMEOUT_S, STOP_SIGNALS, WORKER_DRAIN_SIGNAL
from tandem.entrypoints.subprocesses import ServerProcesses
from tandem.server_args import ServerArgs
from tandem.tokenizer.multi_tokenizer import TokenizerRouter

logger = logging.getLogger(__name__)

# After the drain's own bounds (grace period, abort flush, connection close): how much
# longer the main process waits for the workers to exit before it ends them.
_EXIT_SLACK_S = 5.0
_POLL_S = 0.05


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket that child processes can inherit."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve_with_workers(server_args: ServerArgs, procs: ServerProcesses, worker_entry: Callable[..., None]) -> None:
    """Run the workers until a stop signal has drained them all (then return, for the
    caller to end the other children and exit 0). `worker_entry(server_args, port_args,
    scheduler_info, worker_id, sock, health)` is a worker process's entry function. A
    worker that dies otherwise is a child's death (ServerProcesses.watch)."""
    n = server_args.tokenizer_worker_num
    router = TokenizerRouter(procs.port_args, n)
    sock = listening_socket(server_args.host, server_args.port)
    mp_ctx = mp.get_context("spawn")
    health = procs.health()
    workers = [
        mp_ctx.Process(
            target=worker_entry,
            name=f"tokenizer_worker_{k}",
            args=(server_args, procs.port_args, procs.scheduler_info, k, sock, health),
        )
        for k in range(n)
    ]
    drain_started: list[float] = []

    def on_stop_signal(signum, frame) -> None:
        if not drain_started:
            logger.warning("%s received: draining the %d tokenizer workers", signal.Signals(signum).name, n)
            drain_started.append(time.monotonic())
            procs.allow_exit([w.name for w in workers])
        for w in workers:  # a second signal reaches them as a second drain signal: abort now
            if w.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, WORKER_DRAIN_SIGNAL)

    try:
        for w in workers:
            w.start()
        procs.procs.extend(workers)  # watched and ended like every other child
        logger.info("%d tokenizer workers serving http://%s:%d", n, server_args.host, server_args.port)
        for sig in STOP_SIGNALS:
            signal.signal(sig, on_stop_signal)
        bound = server_args.graceful_shutdown_timeout + ABORT_FLUSH_S + CLOSE_TIMEOUT_S + _EXIT_SLACK_S
        while not (drain_started and not any(w.is_alive() for w in workers)):
            if drain_started and time.monotonic() - drain_started[0] > bound:
                logger.error("tokenizer workers still running %.0f s after the drain began; ending them", bound)
                break
            time.sleep(_POLL_S)
    finally:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)  # the caller is ending the children
        sock.close()
        router.close()
