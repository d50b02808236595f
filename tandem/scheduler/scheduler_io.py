"""The scheduler's I/O behind one small object (docs/architecture.md, "The scheduler loop").

The scheduler never touches a socket: it calls `recv` for the messages that arrived,
`wait` when it has nothing to run, `send_output` for each step's `BatchTokenIDOutput`
and `send_reply` for the answers to control messages. So the loop runs in-process
against any object with these four methods (tests use an in-memory one). Under tensor
parallelism `TpSchedulerIO` wraps the sockets: rank 0 receives and broadcasts the list
to the other ranks, which receive by broadcast and send nothing.
"""

from __future__ import annotations

from typing import Any, Protocol

import zmq

from tandem.distributed import TpGroup
from tandem.messages import DpFinishedReqs, DpReplicaReply
from tandem.server_args import PortArgs
from tandem.utils import zmq_io


class SchedulerIOBase(Protocol):
    def recv(self) -> list[Any]:
        """Every message that has arrived, without blocking (possibly none)."""

    def wait(self, timeout_ms: int) -> None:
        """Block until a message may have arrived, or `timeout_ms` has passed (idle)."""

    def send_output(self, out: Any) -> None:
        """One step's `BatchTokenIDOutput`: to the detokenizer, or straight to the
        tokenizer manager under --skip-tokenizer-init."""

    def send_reply(self, msg: Any) -> None:
        """The answer to a control message, to the tokenizer manager."""

    def close(self) -> None:
        """Close the sockets (the process is ending, or a test is done)."""


class SchedulerIO:
    """The ZeroMQ sockets of scheduler rank 0 (see docs/architecture.md for the endpoints).

    Under --dp-size > 1 (`dp_rank` given) rank 0 of replica `dp_rank` receives what the
    data-parallel controller dispatches to it, and sends the controller its control
    replies (`DpReplicaReply`, answered once for all replicas) and the ids of the
    requests each step finished (`DpFinishedReqs`: the controller's load count); its
    outputs go to the detokenizer (or tokenizer manager) as with one replica."""

    def __init__(self, port_args: PortArgs, skip_tokenizer_init: bool, dp_rank: int | None = None):
        self._ctx = zmq.Context(2)
        self.dp_rank = dp_rank
        recv_endpoint = port_args.tokenizer_to_scheduler if dp_rank is None else port_args.dp_scheduler_input(dp_rank)
        self._recv = zmq_io.make_socket(self._ctx, zmq.PULL, recv_endpoint, bind=True)
        self._to_tokenizer = zmq_io.make_socket(self._ctx, zmq.PUSH, port_args.scheduler_to_tokenizer, bind=False)
        self._to_detokenizer = None
        if not skip_tokenizer_init:
            self._to_detokenizer = zmq_io.make_socket(
                self._ctx, zmq.PUSH, port_args.scheduler_to_detokenizer, bind=False
            )
        self._to_controller = None
        if dp_rank is not None:
            self._to_controller = zmq_io.make_socket(
                self._ctx, zmq.PUSH, port_args.scheduler_to_dp_controller, bind=False
            )
        self._poller = zmq.Poller()
        self._poller.register(self._recv, zmq.POLLIN)

    def recv(self) -> list[Any]:
        return zmq_io.recv_nowait(self._recv)

    def wait(self, timeout_ms: int) -> None:
        self._poller.poll(timeout_ms)

    def send_output(self, out: Any) -> None:
        zmq_io.send(self._to_detokenizer if self._to_detokenizer is not None else self._to_tokenizer, out)
        if self._to_controller is not None:
            finished = [o.rid for o in out.outputs if o.finished_reason is not None]
            if finished:
                zmq_io.send(self._to_controller, DpFinishedReqs(self.dp_rank, finished))

    def send_reply(self, msg: Any) -> None:
        if self._to_controller is not None:
            zmq_io.send(self._to_controller, DpReplicaReply(self.dp_rank, msg))
        else:
            zmq_io.send(self._to_tokenizer, msg)

    def close(self) -> None:
        self._ctx.destroy(linger=0)


class TpSchedulerIO:
    """The I/O of one rank of a tensor-parallel group. Rank 0 holds the sockets and
    broadcasts every list it receives over the group's CPU (gloo) group; the other ranks
    have no socket: `recv` returns rank 0's list, `wait` returns at once (they wait in
    the next `recv`), and what they send goes nowhere. So every rank handles the same
    messages in the same order and forms the same batches; a rank that diverged would
    hang the forward's collectives."""

    def __init__(self, tp: TpGroup, sockets: SchedulerIO | None):
        self.tp = tp
        self.sockets = sockets

    def recv(self) -> list[Any]:
        return self.tp.broadcast_objects(self.sockets.recv() if self.sockets is not None else None)

    def wait(self, timeout_ms: int) -> None:
        if self.sockets is not None:
            self.sockets.wait(timeout_ms)

    def send_output(self, out: Any) -> None:
        if self.sockets is not None:
            self.sockets.send_output(out)

    def send_reply(self, msg: Any) -> None:
        if self.sockets is not None:
            self.sockets.send_reply(msg)

    def close(self) -> None:
        if self.sockets is not None:
            self.sockets.close()


def make_scheduler_io(
    port_args: PortArgs, skip_tokenizer_init: bool, tp: TpGroup, dp_rank: int | None = None
) -> SchedulerIOBase:
    """The sockets alone with one rank; with several, each rank's `TpSchedulerIO`
    (only rank 0 opens sockets). `dp_rank`: the replica, under --dp-size > 1."""
    if tp.size == 1:
        return SchedulerIO(port_args, skip_tokenizer_init, dp_rank)
    return TpSchedulerIO(tp, SchedulerIO(port_args, skip_tokenizer_init, dp_rank) if tp.is_first_rank else None)
