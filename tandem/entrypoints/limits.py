"""The request body size limit (--max-request-body-bytes), as ASGI middleware.

A body larger than the limit gets 413 before any route sees it: at once when its
Content-Length says so (the body is not read), else (a chunked body) as soon as the bytes
received pass the limit. The body read here is handed to the app unchanged; afterwards
the app's `receive` is the server's own, so client disconnects are still seen.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# (path, message, status) -> the error response in the shape of that path's API.
ErrorFactory = Callable[[str, str, int], Response]


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, error: ErrorFactory):
        self.app, self.max_bytes, self.error = app, max_bytes, error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send, f"{int(length)} bytes, ")
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client left
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, "")
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(messages, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        message = f"request body: {size}larger than the limit of {self.max_bytes} bytes (--max-request-body-bytes)"
        response = self.error(scope["path"], message, 413)
        response.headers["connection"] = "close"  # the rest of the body is not read
        await response(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A `receive` that returns `messages` first, then defers to `receive`."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
