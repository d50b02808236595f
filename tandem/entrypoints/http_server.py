"""The HTTP server: a FastAPI app over the TokenizerManager, served by uvicorn.

Routes: POST /generate (SGLang's native API), GET /health, GET /health_generate,
POST /abort_request, SGLang's information and control routes (entrypoints/sglang_routes:
/model_info, /server_info, /flush_cache, /ping, /v1/loads, /start_profile, /stop_profile),
GET /metrics (with --enable-metrics), GET / (a chat page: entrypoints/chat_page)
and the OpenAI-compatible routes under /v1 (entrypoints/openai). Client mistakes get HTTP 400 with
{"error": {"message": ...}} naming the field; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tandem.entrypoints.chat_page import add_chat_page
from tandem.entrypoints.json_body import JSONBodyRoute, parse_json_body
from tandem.entrypoints.limits import BodySizeLimit
from tandem.entrypoints.openai.common import sse
from tandem.entrypoints.openai.errors import OpenAIError, json_response
from tandem.entrypoints.openai.router import add_api_key_middleware, add_openai_routes
from tandem.entrypoints.sglang_routes import add_sglang_routes
from tandem.entrypoints.weight_routes import add_weight_routes
from tandem.entrypoints.disconnect import ClientDisconnected, await_or_disconnect
from tandem.entrypoints.health import EngineHealth, GenerationProbe
from tandem.entrypoints.shutdown import DRAINING_MESSAGE, WORKER_DRAIN_SIGNAL, DrainGate, DrainingServer
from tandem.entrypoints.streams import Refused, admitted_streams, last_outputs, merge_streams, refusal
from tandem.entrypoints.follower_node import run_follower_node
from tandem.entrypoints.subprocesses import ServerProcesses, launch_subprocesses
from tandem.entrypoints.tokenizer_workers import serve_with_workers
from tandem.entrypoints.native_protocol import GenerateReqInput
from tandem.tokenizer.tokenizer_manager import SchedulerTimeout, TokenizerManager
from tandem.metrics.collector import CONTENT_TYPE as METRICS_CONTENT_TYPE, enable_multiprocess_metrics
from tandem.server_args import PortArgs, ServerArgs
from tandem.utils.process import (
    configure_logging, exit_now, ignore_stop_signals, kill_process_tree, notify_parent_of_failure,
    set_parent_death_signal, set_process_name, set_process_title,
)

logger = logging.getLogger(__name__)

# How long GET /metrics waits for the scheduler's live counts.
_METRICS_STATE_TIMEOUT_S = 5.0



def error_response(message: str, status: int = 400) -> Response:
    kind = {400: "BadRequestError", 503: "ServiceUnavailableError"}.get(status, "ServerError")
    return json_response({"error": {"message": message, "type": kind, "code": status}}, status)


def error_for_path(path: str, message: str, status: int) -> Response:
    """An error in the shape of the API that `path` belongs to (OpenAI's under /v1)."""
    if path.startswith("/v1/"):
        return OpenAIError(message, status).response()
    return error_response(message, status)


async def read_json_object(request: Request) -> dict:
    """The request body as a JSON object; ValueError with a client-facing message."""
    body = parse_json_body(await request.body())
    if not isinstance(body, dict):
        raise ValueError("request body: must be a JSON object")
    return body


def create_app(tokenizer_manager: TokenizerManager, server_args: ServerArgs,
               engine_health: EngineHealth | None = None) -> FastAPI:
    """The app; with `engine_health`, GET /health also checks the subprocesses."""
    tm = tokenizer_manager
    probe = GenerationProbe(tm)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not server_args.skip_server_warmup:
            await _warmup(tm)
        logger.info("The server is fired up and ready to roll! (http://%s:%d)", server_args.host, server_args.port)
        yield

    app = FastAPI(title="Tandem", lifespan=lifespan)
    app.router.route_class = JSONBodyRoute  # JSON bodies parsed by orjson (json_body.py)

    @app.exception_handler(SchedulerTimeout)
    async def scheduler_timeout(request: Request, exc: SchedulerTimeout) -> Response:
        """A control call (server state, flush, profile, weights) the scheduler did not answer."""
        return error_response("the scheduler did not answer", 503)

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, exc: RecursionError) -> Response:
        """A value nested deeply enough (JSON allows 1024 levels) to exhaust Python's stack
        somewhere (a chat template's message fields, a library's copy) is the client's 400."""
        logger.warning("%s %s: RecursionError on a deeply nested request value", request.method, request.url.path)
        return error_for_path(request.url.path, "request body: a value is nested too deeply", 400)

    @app.get("/health")
    async def health() -> Response:
        """200, or 503 with the reason: a subprocess has exited, a forward step is stuck past
        --watchdog-timeout (draining answers 503 before any route: DrainGate)."""
        problem = engine_health.problem(server_args.watchdog_timeout) if engine_health is not None else None
        if problem is not None:
            return error_response(problem, 503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """200 if the engine generates (recent progress, or a shared one-token probe), else 503."""
        problem = await probe.check()
        if problem is not None:
            return error_response(problem, 503)
        return Response(status_code=200)

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
            streams = await tm.generate_request(obj)
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

    if tm.metrics is not None:
        @app.get("/metrics")
        async def metrics() -> Response:
            """Prometheus metrics (--enable-metrics); the scheduler's gauges as of now, or as
            of the last scrape if the scheduler does not answer in time."""
            try:
                tm.metrics.set_server_state(await tm.get_server_state(timeout=_METRICS_STATE_TIMEOUT_S))
            except asyncio.TimeoutError:
                logger.warning("/metrics: the scheduler did not report its state in time")
            return Response(tm.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    add_sglang_routes(app, tm, server_args)
    add_weight_routes(app, tm)
    add_openai_routes(app, tm, server_args)
    add_chat_page(app)
    app.add_middleware(BodySizeLimit, max_bytes=server_args.max_request_body_bytes, error=error_for_path)
    add_api_key_middleware(app, server_args.api_key)
    app.add_middleware(DrainGate, tm=tm, refusal=lambda: error_response(DRAINING_MESSAGE, 503))
    return app


async def _warmup(tm: TokenizerManager) -> None:
    params = {"max_new_tokens": 4, "temperature": 0}
    if tm.tokenizer is not None:
        obj = GenerateReqInput(text="Hello", sampling_params=params)
    else:
        obj = GenerateReqInput(input_ids=[0, 1], sampling_params=params)
    await last_outputs(await tm.generate_request(obj))


def launch_server(server_args: ServerArgs) -> None:
    """Start the subprocesses, serve HTTP until SIGTERM or SIGINT, drain (entrypoints/
    shutdown.py), end every child, remove the ipc directory and return (exit code 0).
    A child that crashes or dies takes the server down with exit code 1."""
    configure_logging(server_args.log_level, "main")
    server_args.validate()
    if server_args.node_rank > 0:  # only this node's scheduler ranks: node 0 serves HTTP
        run_follower_node(server_args)
        return
    set_process_name("tandem::server")  # the command line stays as it was, for scripts
    procs: ServerProcesses = launch_subprocesses(server_args)
    if server_args.enable_metrics:  # before any TokenizerManager, in this process or a worker
        enable_multiprocess_metrics(procs.port_args.ipc_dir)

    def on_child_death(name: str) -> None:
        logger.error("%s died; shutting the server down", name)
        procs.shutdown()
        exit_now(1)

    def on_sigquit(signum, frame) -> None:  # a child reported a crash
        # NOTE: a scheduler rank fails in a collective when another rank died: name the dead.
        dead = procs.exited()
        logger.error("a subprocess crashed%s; shutting the server down", f" ({', '.join(dead)} exited)" if dead else "")
        procs.shutdown()
        exit_now(1)

    signal.signal(signal.SIGQUIT, on_sigquit)
    procs.watch(on_child_death)
    try:
        if server_args.tokenizer_worker_num > 1:
            serve_with_workers(server_args, procs, run_tokenizer_worker_process)
        else:
            tm = TokenizerManager(server_args, procs.port_args, procs.scheduler_info)
            app = create_app(tm, server_args, procs.health())
            DrainingServer(_uvicorn_config(app, server_args), tm, server_args.graceful_shutdown_timeout).run()
    finally:
        procs.shutdown()
        # Any other descendant (multiprocessing's resource tracker, which ignores SIGTERM).
        kill_process_tree(os.getpid(), include_parent=False, sig=signal.SIGKILL)


def _uvicorn_config(app: FastAPI, server_args: ServerArgs) -> uvicorn.Config:
    return uvicorn.Config(app, host=server_args.host, port=server_args.port,
                          log_level=server_args.log_level_http or server_args.log_level,
                          timeout_keep_alive=5, access_log=False)


def run_tokenizer_worker_process(server_args: ServerArgs, port_args: PortArgs, scheduler_info: dict[str, Any],
                                 worker_id: int, sock: socket.socket, engine_health: EngineHealth) -> None:
    """Entry of tokenizer worker `worker_id` (--tokenizer-worker-num N > 1,
    entrypoints/tokenizer_workers.py): its own TokenizerManager and app, serving HTTP on
    the listening socket that every worker shares, until the main process drains it
    (WORKER_DRAIN_SIGNAL, twice to hurry); then it exits 0."""
    name = f"tokenizer_worker_{worker_id}"
    set_parent_death_signal()
    set_process_title(f"tandem::{name}")
    configure_logging(server_args.log_level, name)
    ignore_stop_signals()  # the main process drains us
    signal.signal(WORKER_DRAIN_SIGNAL, signal.SIG_IGN)  # until the server's own handler is in place
    try:
        tm = TokenizerManager(server_args, port_args, scheduler_info, worker_id=worker_id)
        app = create_app(tm, server_args, engine_health)
        DrainingServer(_uvicorn_config(app, server_args), tm, server_args.graceful_shutdown_timeout,
                       stop_signals=(WORKER_DRAIN_SIGNAL,)).run(sockets=[sock])
    except Exception:
        logger.exception("%s crashed", name)
        notify_parent_of_failure()
        exit_now(1)
    exit_now(0)
