"""The HTTP server: a FastAPI app over the TokenizerManager, served by uvicorn.

Routes: POST /generate (SGLang's native API), GET /health, GET /health_generate,
GET /model_info, GET /server_info, POST /abort_request, POST /flush_cache, and the OpenAI-compatible
routes under /v1 (entrypoints/openai). Client mistakes get HTTP 400 with
{"error": {"message": ...}} naming the field; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from typing import Any, AsyncIterator

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tandem.entrypoints.openai.router import add_api_key_middleware, add_openai_routes
from tandem.entrypoints.disconnect import ClientDisconnected, await_or_disconnect
from tandem.entrypoints.streams import Refused, admitted_streams, last_outputs, merge_streams, refusal
from tandem.entrypoints.subprocesses import ServerProcesses, launch_subprocesses
from tandem.managers.io_struct import GenerateReqInput
from tandem.managers.tokenizer_manager import TokenizerManager
from tandem.server_args import ServerArgs
from tandem.utils.process import configure_logging, kill_process_tree

logger = logging.getLogger(__name__)

# How long /health_generate waits for its one-token generation before answering 503;
# TANDEM_HEALTH_CHECK_TIMEOUT overrides it (as SGLANG_HEALTH_CHECK_TIMEOUT does in SGLang).
HEALTH_GENERATE_TIMEOUT_S = 20.0
# On SIGTERM/SIGINT uvicorn stops accepting connections and lets running requests finish,
# for at most this long; then every process of the server ends.
GRACEFUL_SHUTDOWN_S = 30


def error_response(message: str, status: int = 400) -> Response:
    kind = {400: "BadRequestError", 503: "ServiceUnavailableError"}.get(status, "ServerError")
    return json_response({"error": {"message": message, "type": kind, "code": status}}, status)


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


async def read_json_object(request: Request) -> dict:
    """The request body as a JSON object; ValueError with a client-facing message."""
    try:
        body = json.loads(await request.body())
    except ValueError as e:
        raise ValueError(f"request body: invalid JSON ({e})") from e
    if not isinstance(body, dict):
        raise ValueError("request body: must be a JSON object")
    return body


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def create_app(tokenizer_manager: TokenizerManager, server_args: ServerArgs) -> FastAPI:
    tm = tokenizer_manager
    health_timeout = float(os.environ.get("TANDEM_HEALTH_CHECK_TIMEOUT", HEALTH_GENERATE_TIMEOUT_S))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not server_args.skip_server_warmup:
            await _warmup(tm)
        logger.info("The server is fired up and ready to roll! (http://%s:%d)", server_args.host, server_args.port)
        yield

    app = FastAPI(title="Tandem", lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
        try:
            [stream] = tm.generate_request(obj)
            async with asyncio.timeout(health_timeout):
                async for _ in stream:
                    pass
        except Exception as e:  # noqa: BLE001 - any failure means unhealthy
            return error_response(f"engine did not answer: {type(e).__name__}: {e}", 503)
        return Response(status_code=200)

    @app.get("/model_info")
    async def model_info() -> dict:
        return {
            "model_path": server_args.model_path,
            "tokenizer_path": server_args.tokenizer_path,
            "served_model_name": server_args.served_model_name,
            "is_generation": True,
        }

    @app.get("/server_info")
    async def server_info() -> Response:
        """Resolved arguments, capacities, and the scheduler's live memory counts."""
        try:
            return json_response(await tm.server_info())
        except asyncio.TimeoutError:
            return error_response("the scheduler did not answer", 503)

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        """Empty the prefix cache; 400 with the reason while requests run or wait."""
        try:
            result = await tm.flush_cache()
        except asyncio.TimeoutError:
            return error_response("the scheduler did not answer", 503)
        if not result.success:
            return error_response(f"cache not flushed: {result.message}", 400)
        return json_response({"success": True})

    @app.post("/abort_request")
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

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        try:
            obj = GenerateReqInput.from_json(await read_json_object(request))
            streams = tm.generate_request(obj)
        except (ValueError, TypeError) as e:
            return error_response(str(e))
        multi = obj.is_batch or len(streams) > 1  # a batch, or n > 1 samples
        if obj.stream:
            if not multi:
                try:
                    admitted = await admitted_streams(request, streams)
                except Refused as e:
                    return error_response(e.message, e.status)
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
            return error_response(*rejected)
        return json_response(results if multi else results[0])

    add_openai_routes(app, tm, server_args)
    add_api_key_middleware(app, server_args.api_key)
    return app


async def _warmup(tm: TokenizerManager) -> None:
    params = {"max_new_tokens": 4, "temperature": 0}
    if tm.tokenizer is not None:
        obj = GenerateReqInput(text="Hello", sampling_params=params)
    else:
        obj = GenerateReqInput(input_ids=[0, 1], sampling_params=params)
    [stream] = tm.generate_request(obj)
    await last_outputs([stream])


def launch_server(server_args: ServerArgs) -> None:
    """Start the subprocesses, then serve HTTP until SIGINT/SIGTERM; end every child on exit."""
    configure_logging(server_args.log_level, "main")
    server_args.validate()
    procs: ServerProcesses = launch_subprocesses(server_args)

    def on_child_death(name: str) -> None:
        logger.error("%s died; shutting the server down", name)
        procs.shutdown()
        os._exit(1)

    def on_sigquit(signum, frame) -> None:  # a child reported a crash
        logger.error("a subprocess crashed; shutting the server down")
        procs.shutdown()
        os._exit(1)

    signal.signal(signal.SIGQUIT, on_sigquit)
    procs.watch(on_child_death)
    try:
        tm = TokenizerManager(server_args, procs.port_args, procs.scheduler_info)
        app = create_app(tm, server_args)
        config = uvicorn.Config(app, host=server_args.host, port=server_args.port,
                                log_level=server_args.log_level,
                                timeout_keep_alive=5, access_log=False,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        uvicorn.Server(config).run()
    finally:
        procs.shutdown()
        kill_process_tree(os.getpid(), include_parent=False)
