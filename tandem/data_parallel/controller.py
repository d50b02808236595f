"""The data-parallel controller (`--dp-size M > 1`): one process between the tokenizer
manager(s) and M replicas, each a TP group of its own (SGLang's DataParallelController).

It binds `tokenizer_to_scheduler` in place of the scheduler, so the tokenizer side is
unchanged, and
- dispatches each `TokenizedGenerateReqInput` to one replica (`LoadBalancer`:
  `--load-balance-method round_robin|shortest_queue`);
- sends every `AbortReq` to all replicas (the one holding the request aborts it; the
  others ignore an id they do not hold, as SGLang does);
- sends every control call to all replicas and answers it once, when each has replied
  (`ReplyCombiner`, `ControlOutput.merge`: `/server_info` gets one state per DP rank).
Outputs do not pass through it: each replica sends them to the detokenizer (or the
tokenizer manager) itself, and tells the controller which requests each step finished
(`DpFinishedReqs`), which is how `shortest_queue` knows each replica's requests in flight.
"""

from __future__ import annotations

import logging
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

import zmq

from tandem.messages import (
    AbortReq,
    ControlOutput,
    ControlReq,
    DpFinishedReqs,
    DpReplicaReply,
    ReadyMessage,
    TokenizedGenerateReqInput,
)
from tandem.server_args import PortArgs, ServerArgs
from tandem.utils import zmq_io
from tandem.utils.process import (
    configure_logging,
    ignore_stop_signals,
    notify_parent_of_failure,
    set_parent_death_signal,
    set_process_title,
)

logger = logging.getLogger(__name__)

PROCESS_NAME = "data_parallel_controller"


class LoadBalancer:
    """Picks the replica of each new request.

    `round_robin`: replicas in turn. `shortest_queue`: the replica with the fewest requests
    in flight (dispatched and not reported finished; ties to the lowest DP rank). The count
    is exact, not sampled: a request is in flight from its dispatch until its replica
    reports it finished (an abort ends in a finish too)."""

    def __init__(self, method: str, dp_size: int):
        self.method = method
        self.in_flight: list[set[str]] = [set() for _ in range(dp_size)]
        self._next = 0

    def pick(self) -> int:
        if self.method == "shortest_queue":
            return min(range(len(self.in_flight)), key=lambda k: len(self.in_flight[k]))
        k, self._next = self._next, (self._next + 1) % len(self.in_flight)
        return k

    def dispatched(self, dp_rank: int, rid: str) -> None:
        self.in_flight[dp_rank].add(rid)

    def finished(self, dp_rank: int, rids: list[str]) -> None:
        self.in_flight[dp_rank].difference_update(rids)


@dataclass
class ReplyCombiner:
    """Collects every replica's reply to a control call; `add` returns the one merged
    reply once the last has arrived."""

    dp_size: int
    pending: dict[str, dict[int, ControlOutput]] = field(default_factory=dict)

    def add(self, dp_rank: int, reply: ControlOutput) -> ControlOutput | None:
        got = self.pending.setdefault(reply.request_id, {})
        got[dp_rank] = reply
        if len(got) < self.dp_size:
            return None
        del self.pending[reply.request_id]
        return type(reply).merge([got[k] for k in range(self.dp_size)])


class DataParallelController:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs):
        self.balancer = LoadBalancer(server_args.load_balance_method, server_args.dp_size)
        self.combiner = ReplyCombiner(server_args.dp_size)
        self._ctx = zmq.Context(2)
        self.from_tokenizer = zmq_io.make_socket(self._ctx, zmq.PULL, port_args.tokenizer_to_scheduler, bind=True)
        self.from_replicas = zmq_io.make_socket(self._ctx, zmq.PULL, port_args.scheduler_to_dp_controller, bind=True)
        self.to_tokenizer = zmq_io.make_socket(self._ctx, zmq.PUSH, port_args.scheduler_to_tokenizer, bind=False)
        self.to_replicas = [
            zmq_io.make_socket(self._ctx, zmq.PUSH, port_args.dp_scheduler_input(k), bind=False)
            for k in range(server_args.dp_size)
        ]
        self._poller = zmq.Poller()
        self._poller.register(self.from_tokenizer, zmq.POLLIN)
        self._poller.register(self.from_replicas, zmq.POLLIN)

    def event_loop(self) -> None:
        while True:
            self._poller.poll()
            for msg in zmq_io.recv_nowait(self.from_replicas):  # finishes first: fresher loads
                self.handle_replica_message(msg)
            for msg in zmq_io.recv_nowait(self.from_tokenizer):
                self.handle_tokenizer_message(msg)

    def handle_tokenizer_message(self, msg: Any) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            k = self.balancer.pick()
            self.balancer.dispatched(k, msg.rid)
            zmq_io.send(self.to_replicas[k], msg)
        elif isinstance(msg, (AbortReq, ControlReq)):
            for sock in self.to_replicas:
                zmq_io.send(sock, msg)
        else:
            logger.error("data-parallel controller got an unknown message %r", type(msg))

    def handle_replica_message(self, msg: Any) -> None:
        if isinstance(msg, DpFinishedReqs):
            self.balancer.finished(msg.dp_rank, msg.rids)
        elif isinstance(msg, DpReplicaReply):
            merged = self.combiner.add(msg.dp_rank, msg.reply)
            if merged is not None:
                zmq_io.send(self.to_tokenizer, merged)
        else:
            logger.error("data-parallel controller got an unknown message %r from a replica", type(msg))


def run_data_parallel_controller_process(server_args: ServerArgs, port_args: PortArgs) -> None:
    """Entry of the controller subprocess (`tandem::data_parallel_controller`): bind its
    sockets, report readiness, route until the parent ends it (SIGKILL); a crash brings
    the server down."""
    set_parent_death_signal()
    set_process_title(f"tandem::{PROCESS_NAME}")
    configure_logging(server_args.log_level, "dp controller")
    ignore_stop_signals()  # the parent drains, then ends us
    ready = zmq_io.make_socket(zmq.Context.instance(), zmq.PUSH, port_args.ready, bind=False)
    try:
        controller = DataParallelController(server_args, port_args)
    except Exception as e:
        logger.error("data-parallel controller failed to start:\n%s", traceback.format_exc())
        zmq_io.send(ready, ReadyMessage(process=PROCESS_NAME, ok=False, error=f"{type(e).__name__}: {e}"))
        sys.exit(1)
    zmq_io.send(ready, ReadyMessage(process=PROCESS_NAME))
    try:
        controller.event_loop()
    except Exception:
        logger.error("data-parallel controller crashed:\n%s", traceback.format_exc())
        notify_parent_of_failure()
        sys.exit(1)
