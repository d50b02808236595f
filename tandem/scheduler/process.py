"""Entry of a scheduler subprocess: set up its TP group, I/O and `Scheduler`, report
readiness to the parent, run the loop; report any failure so the server comes down."""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import traceback
from typing import Any

import zmq

from tandem.distributed import init_tp_group, is_peer_failure
from tandem.distributed.placement import SchedulerRank, describe_other_nodes, gpu_id, init_method
from tandem.messages import ReadyMessage
from tandem.scheduler.scheduler import Scheduler
from tandem.scheduler.scheduler_io import make_scheduler_io
from tandem.server_args import PortArgs, ServerArgs
from tandem.utils import zmq_io
from tandem.utils.cpu_threads import front_end_cpu
from tandem.utils.process import (
    configure_logging,
    ignore_stop_signals,
    report_scheduler_failure,
    set_parent_death_signal,
    set_process_title,
)

logger = logging.getLogger(__name__)


def run_scheduler_process(
    server_args: ServerArgs, port_args: PortArgs, rank: SchedulerRank | None = None, forward_stamp: Any = None
) -> None:
    """Entry of the scheduler subprocess of `rank`: set up, report readiness, then loop
    until the parent ends it (SIGKILL). A crash, a forward past --watchdog-timeout, or a
    collective that fails because another rank (or node) is gone brings the server down
    (`report_scheduler_failure`)."""
    rank = rank if rank is not None else SchedulerRank(0)
    name = rank.name
    set_parent_death_signal()
    set_process_title(f"tandem::{name}")
    configure_logging(server_args.log_level, name.replace("_", " "))
    faulthandler.register(signal.SIGUSR1)
    ignore_stop_signals()  # the parent drains, then ends us
    ready = zmq_io.make_socket(zmq.Context.instance(), zmq.PUSH, port_args.ready, bind=False)
    try:
        tp = init_tp_group(
            rank.tp_rank,
            server_args.tp_size,
            server_args.device,
            init_method(server_args, port_args.ipc_dir, rank.dp_rank),
            gpu_id(server_args, rank),
            timeout_s=server_args.watchdog_timeout,
        )
        io = make_scheduler_io(port_args, server_args.skip_tokenizer_init, tp, rank.dp_rank)
        scheduler = Scheduler(server_args, io, tp_rank=rank.tp_rank, forward_stamp=forward_stamp, dp_rank=rank.dp_rank)
    except Exception as e:  # report the start-up failure, then exit
        logger.error("scheduler failed to start:\n%s", traceback.format_exc())
        zmq_io.send(ready, ReadyMessage(process=name, ok=False, error=f"{type(e).__name__}: {e}"))
        sys.exit(1)
    front = front_end_cpu(server_args.device, server_args.local_scheduler_ranks)
    if front is not None:
        scheduler.executor.bind_cpus(front)
    zmq_io.send(ready, ReadyMessage(process=name, info=scheduler.info()))
    scheduler.watchdog.start(on_timeout=report_scheduler_failure)
    try:
        scheduler.event_loop()
    except Exception as e:
        if tp.size > 1 and is_peer_failure(e):
            others = describe_other_nodes(server_args)
            logger.error(
                "%s: a collective of the TP group failed: another rank%s died or stopped answering (%s); shutting down",
                name,
                f" ({others})" if others else "",
                e,
            )
        else:
            logger.error("scheduler crashed:\n%s", traceback.format_exc())
        report_scheduler_failure()
        sys.exit(1)
