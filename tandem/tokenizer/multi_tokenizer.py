"""Several tokenizer workers (--tokenizer-worker-num N > 1): who owns a request, and how
each message from the scheduler side reaches its owner alone.

Identity: the internal ids of worker K are "{K}.{random}-{counter}" (`rid_prefix`), and
its control requests' `request_id`s too; `owner_of` reads K back. Each worker binds one
PULL endpoint (`PortArgs.tokenizer_worker(K)`). `OutputSender` splits a batch output by
owner and sends each worker only its share (never a broadcast): the detokenizer sends
with one, and the main process's `TokenizerRouter` uses one for what the scheduler sends
to the tokenizer side (control replies; outputs under --skip-tokenizer-init).
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

import zmq

from tandem.messages import BatchStrOutput, BatchTokenIDOutput
from tandem.server_args import PortArgs
from tandem.utils import zmq_io

logger = logging.getLogger(__name__)

BatchOutput = BatchStrOutput | BatchTokenIDOutput


def rid_prefix(worker_id: int) -> str:
    """The prefix of every internal id a TokenizerManager issues (`{prefix}-{counter}`)."""
    return f"{worker_id}.{uuid.uuid4().hex[:8]}"


def owner_of(rid: str) -> int:
    """The tokenizer worker that issued an internal id (or a control request_id)."""
    return int(rid.split(".", 1)[0])


def split_by_owner(msg: BatchOutput) -> dict[int, BatchOutput]:
    """One message per owning worker with only its requests' records, in their order."""
    parts: dict[int, list] = {}
    for out in msg.outputs:
        parts.setdefault(owner_of(out.rid), []).append(out)
    if len(parts) == 1:
        return {owner: msg for owner in parts}
    return {owner: type(msg)(outputs=outputs) for owner, outputs in parts.items()}


class OutputSender:
    """Sends outputs and control replies to the tokenizer side: with one worker, all to
    `endpoint`; with N, each message (each batch output's share) to the worker that owns
    it."""

    def __init__(self, ctx: zmq.Context, port_args: PortArgs, endpoint: str | None, num_workers: int):
        endpoints = [port_args.tokenizer_worker(k) for k in range(num_workers)] if num_workers > 1 else [endpoint]
        self._socks = [zmq_io.make_socket(ctx, zmq.PUSH, e, bind=False) for e in endpoints]

    def send(self, msg: Any) -> None:
        if len(self._socks) == 1:
            zmq_io.send(self._socks[0], msg)
        elif isinstance(msg, (BatchStrOutput, BatchTokenIDOutput)):
            for owner, part in split_by_owner(msg).items():
                zmq_io.send(self._socks[owner], part)
        else:  # a control reply
            zmq_io.send(self._socks[owner_of(msg.request_id)], msg)


class TokenizerRouter:
    """In the main process under --tokenizer-worker-num N > 1: a daemon thread that binds
    `scheduler_to_tokenizer` (the endpoint a single TokenizerManager binds) and passes each
    message on to its owner."""

    def __init__(self, port_args: PortArgs, num_workers: int):
        self._ctx = zmq.Context(1)
        self._recv = zmq_io.make_socket(self._ctx, zmq.PULL, port_args.scheduler_to_tokenizer, bind=True)
        self._sender = OutputSender(self._ctx, port_args, None, num_workers)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tokenizer-router", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._recv.poll(200):
                continue
            msg = zmq_io.loads(self._recv.recv())
            try:
                self._sender.send(msg)
            except Exception:  # noqa: BLE001 - one bad message must not stop the routing
                logger.exception("tokenizer router could not route a %s", type(msg).__name__)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
        self._ctx.destroy(linger=0)
