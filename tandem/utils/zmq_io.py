"""Sockets and serialization for the pipes between processes, in one place.

Messages are the dataclasses of `tandem.messages`, pickled (protocol 5).
Measured for a BatchTokenIDOutput of 64 requests (one decode step) on the 2-core dev
machine: pickle 10 us encode + 14 us decode (3.8 KB); msgspec msgpack with a typed
decoder 3 us + 9 us (3.2 KB). Both are under 0.3% of a ~10 ms decode step, so pickle
stays: it needs no schema and carries tuples and nested dataclasses as they are. (Those
figures were for parallel lists; with one record per request, pickled as one tuple
each, it is ~35 + 30 us, 2.7 KB, measured under load: still under 1% of a step.)
Swapping it means changing `dumps`/`loads` here only.
"""

from __future__ import annotations

import pickle
from typing import Any

import zmq
import zmq.asyncio


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


def make_socket(ctx: zmq.Context, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
    """Create a one-way socket (PUSH or PULL) with no message limits and no linger."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def send(sock: zmq.Socket, obj: Any) -> None:
    sock.send(dumps(obj), copy=False)


def recv_nowait(sock: zmq.Socket) -> list[Any]:
    """Every message waiting on `sock`, without blocking."""
    out = []
    while True:
        try:
            out.append(loads(sock.recv(zmq.NOBLOCK)))
        except zmq.Again:
            return out


async def recv_async(sock: zmq.asyncio.Socket) -> Any:
    return loads(await sock.recv())
