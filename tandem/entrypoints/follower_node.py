"""A node other than node 0 (`--node-rank k > 0` of `--nnodes`): it runs only its
scheduler ranks, which join node 0's TP group at `--dist-init-addr`, and waits. No HTTP
server, tokenizer or detokenizer: only TP rank 0, on node 0, owns sockets.

It goes down, taking its ranks along (they also have the parent-death signal), when
- one of its ranks dies (the child watchdog), or fails: a rank whose collective fails
  because a rank elsewhere died (node 0 included: every rank talks to rank 0 each step)
  logs it and reports to this process (SIGQUIT), exit code 1;
- it gets SIGTERM or SIGINT, exit code 0 (node 0 then loses a peer and goes down too).
"""

from __future__ import annotations

import logging
import signal
import threading

from tandem.entrypoints.subprocesses import launch_subprocesses
from tandem.server_args import ServerArgs
from tandem.utils.process import exit_now, set_process_name

logger = logging.getLogger(__name__)


def run_follower_node(server_args: ServerArgs) -> None:
    """Start this node's scheduler ranks and block until they end or are stopped; return
    after SIGTERM/SIGINT with every child ended, exit the process (code 1) on a failure."""
    node = f"node {server_args.node_rank}"
    set_process_name(f"tandem::node{server_args.node_rank}")
    procs = launch_subprocesses(server_args)
    stop = threading.Event()

    def fail(reason: str) -> None:
        logger.error("%s; shutting %s down", reason, node)
        procs.shutdown()
        exit_now(1)

    def on_sigquit(signum, frame) -> None:  # a rank reported a failure (it logged which)
        dead = procs.exited()
        fail("a scheduler rank failed" + (f" ({', '.join(dead)} exited)" if dead else ""))

    signal.signal(signal.SIGQUIT, on_sigquit)
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    procs.watch(lambda name: fail(f"{name} died"))
    logger.info(
        "%s: scheduler ranks %s ready; node 0 (%s) serves HTTP",
        node,
        ", ".join(p.name for p in procs.procs),
        server_args.dist_init_addr,
    )
    while not stop.wait(1.0):
        pass
    logger.info("%s: stopping", node)
    procs.shutdown()
