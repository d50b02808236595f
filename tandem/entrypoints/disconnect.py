"""Abort work whose HTTP client went away.

Streaming responses are cancelled by the server when the client disconnects, which
closes the output stream and aborts the request. A non-streaming handler is not, so it
awaits its result through `await_or_disconnect`, which polls the connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from starlette.requests import Request

POLL_S = 0.25


class ClientDisconnected(Exception):
    pass


async def await_or_disconnect(request: Request, awaitable: Awaitable[Any]) -> Any:
    """Await `awaitable`; if the client disconnects first, cancel it (closing its output
    streams, which aborts their requests) and raise ClientDisconnected."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
