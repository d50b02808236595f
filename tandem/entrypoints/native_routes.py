"""SGLang's native generation and health routes: POST /generate, POST /abort_request,
GET /health, GET /health_generate, and GET /metrics (with --enable-metrics).

Client mistakes get HTTP 400 with {"error": {"message": ...}} naming the field
(responses.py); the server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from tandem.entrypoints.disconnect import ClientDisconnected, await_or_disconnect
from tandem.entrypoints.health import EngineHealth, GenerationProbe
from tandem.entrypoints.json_body import json_router, read_json_object
from tandem.entrypoints.native_protocol import GenerateReqInput
from tandem.entrypoints.openai.common import sse
from tandem.entrypoints.responses import ended_by_server_response, error_response, json_response
from tandem.entrypoints.streams import Refused, admitted_streams, last_outputs, merge_streams, refusal
from tandem.metrics.collector import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tandem.server_args import ServerArgs
from tandem.tokenizer.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

# How long GET /metrics waits for the scheduler's live counts.
_METRICS_STATE_TIMEOUT_S = 5.0


def native_router(tm: TokenizerManager, server_args: ServerArgs, engine_health: EngineHealth | None) -> APIRouter:
    """The routes, served by TokenizerManager `tm`; with `engine_health`, GET /health also
    checks the subprocesses."""
    router = json_router()
    probe = GenerationProbe(tm)

    @router.get("/health")
    async def health() -> Response:
        """200, or 503 with the reason: a subprocess has exited, a forward step is stuck past
        --watchdog-timeout (draining answers 503 before any route: DrainGate)."""
        problem = engine_health.problem(server_args.watchdog_timeout) if engine_health is not None else None
        if problem is not None:
            return error_response(problem, 503)
        return Response(status_code=200)

    @router.get("/health_generate")
    async def health_generate() -> Response:
        """200 if the engine generates (recent progress, or a shared one-token probe), else 503."""
        problem = await probe.check()
        if problem is not None:
            return error_response(problem, 503)
        return Response(status_code=200)

    @router.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        """{"rid": ...} or {"abort_all": true}: each finishes with finish_reason.type "abort"."""
        try:
            body = await read_json_object(request)
        except ValueError as e:
            return error_response(str(e))
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if not isinstance(abort_all, bool):
            return error_response("abort_all: must be a boolean")
        if not abort_all and not isinstance(rid, str):
            return error_response("rid: give the rid to abort, or abort_all: true")
        tm.abort_request(rid=None if abort_all else rid, abort_all=abort_all)
        return Response(status_code=200)

    @router.post("/generate")
    async def generate(request: Request) -> Response:
        try:
            obj = GenerateReqInput.from_json(await read_json_object(request))
            streams = await tm.generate_request(obj)
        except (ValueError, TypeError) as e:
            return error_response(str(e))
        multi = obj.is_batch or len(streams) > 1  # a batch, or n > 1 samples
        if obj.stream:
            if not multi:
                try:
                    admitted = await admitted_streams(request, streams)
                except Refused as e:
                    return ended_by_server_response(e.message, e.status)
                if admitted is None:
                    return Response(status_code=499)
                streams = admitted

            async def body_iter() -> AsyncIterator[bytes]:
                async for index, chunk in merge_streams(streams):
                    yield sse({**chunk, "index": index} if multi else chunk)
                yield b"data: [DONE]\n\n"

            return StreamingResponse(body_iter(), media_type="text/event-stream")
        try:
            results = await await_or_disconnect(request, last_outputs(streams))
        except ClientDisconnected:
            return Response(status_code=499)
        rejected = refusal(results)
        if rejected is not None:
            return ended_by_server_response(*rejected)
        return json_response(results if multi else results[0])

    if tm.metrics is not None:

        @router.get("/metrics")
        async def metrics() -> Response:
            """Prometheus metrics (--enable-metrics); the scheduler's gauges as of now, or as
            of the last scrape if the scheduler does not answer in time."""
            try:
                tm.metrics.set_server_state(await tm.get_server_state(timeout=_METRICS_STATE_TIMEOUT_S))
            except asyncio.TimeoutError:
                logger.warning("/metrics: the scheduler did not report its state in time")
            return Response(tm.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    return router
