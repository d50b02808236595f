"""Helpers over the output streams that `TokenizerManager.generate_request` returns,
shared by the native and the OpenAI-compatible routes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from typing import Any

from starlette.requests import Request

from tandem.entrypoints.disconnect import ClientDisconnected, await_or_disconnect


async def merge_streams(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """Interleave the streams' chunks as (stream index, chunk), in arrival order.

    Closing the merged iterator closes every stream (a single one directly, several by
    cancelling their pump tasks), which aborts every unfinished request.
    """
    if len(streams) == 1:  # read in place: no pump task and queue hop for every chunk
        async with contextlib.aclosing(streams[0]) as stream:
            async for chunk in stream:
                yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[dict]) -> None:
        try:
            async for chunk in stream:
                await queue.put((i, chunk))
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, e))
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item[1], Exception):
                raise item[1]
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


async def last_outputs(streams: Iterable[AsyncIterator[dict]]) -> list[dict[str, Any]]:
    """The final dict of every stream, awaited concurrently; on failure the rest are cancelled."""

    async def last(stream: AsyncIterator[dict]) -> dict:
        out: dict = {}
        async for out in stream:  # noqa: B007 - the last one is kept
            pass
        return out

    tasks = [asyncio.create_task(last(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


def refusal(outputs: Iterable[dict[str, Any]]) -> tuple[str, int] | None:
    """(message, HTTP status) when the scheduler refused a request outright (503 when
    --max-queued-requests is reached), else None."""
    for out in outputs:
        reason = out["meta_info"]["finish_reason"] or {}
        if reason.get("status_code"):
            return reason["message"], reason["status_code"]
    return None


async def put_back(first: dict[str, Any], stream: AsyncIterator[dict]) -> AsyncIterator[dict[str, Any]]:
    """`stream` with `first`, already taken from it, in front again. Closing this closes
    `stream` (which aborts its request if unfinished)."""
    try:
        yield first
        async for chunk in stream:
            yield chunk
    finally:
        await stream.aclose()


class Refused(Exception):
    """The scheduler refused the request outright (e.g. busy: status 503)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.message, self.status = message, status


async def admitted_streams(
    request: Request, streams: list[AsyncIterator[dict[str, Any]]]
) -> list[AsyncIterator[dict[str, Any]]] | None:
    """Before a streamed response's status line: wait for the first output of a single
    stream, so that a request the scheduler refuses (busy under --max-queued-requests)
    gets a real status code rather than an aborted stream. Returns the streams to read
    (that output put back), or None when the client left meanwhile; raises `Refused`.
    Several streams start at once; a refused one ends with finish_reason abort."""
    if len(streams) != 1:
        return streams
    try:
        first = await await_or_disconnect(request, anext(streams[0]))
    except ClientDisconnected:
        return None
    refused = refusal([first])
    if refused is not None:
        raise Refused(*refused)
    return [put_back(first, streams[0])]
