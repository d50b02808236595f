"""The FastAPI app: routers, error handlers and middleware over one TokenizerManager.

Routes: the native ones (native_routes.py: /generate, /abort_request, /health,
/health_generate, /metrics), SGLang's information and control routes (sglang_routes.py),
the weight routes (weight_routes.py), the OpenAI-compatible routes under /v1
(openai/router.py) and GET / (a chat page: chat_page.py). Launching the processes that
serve it is http_server.py's job.
"""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tandem.entrypoints.chat_page import chat_page_router
from tandem.entrypoints.health import EngineHealth
from tandem.entrypoints.json_body import JSONBodyRoute
from tandem.entrypoints.limits import BodySizeLimit
from tandem.entrypoints.lora_routes import lora_router
from tandem.entrypoints.native_protocol import GenerateReqInput
from tandem.entrypoints.native_routes import native_router
from tandem.entrypoints.openai.errors import OpenAIError
from tandem.entrypoints.openai.router import add_api_key_middleware, add_openai_routes
from tandem.entrypoints.responses import error_response
from tandem.entrypoints.sglang_routes import sglang_router
from tandem.entrypoints.shutdown import DRAINING_MESSAGE, DrainGate
from tandem.entrypoints.streams import last_outputs
from tandem.entrypoints.weight_routes import weight_router
from tandem.server_args import ServerArgs
from tandem.tokenizer.tokenizer_manager import SchedulerTimeout, TokenizerManager

logger = logging.getLogger(__name__)


def error_for_path(path: str, message: str, status: int) -> Response:
    """An error in the shape of the API that `path` belongs to (OpenAI's under /v1)."""
    if path.startswith("/v1/"):
        return OpenAIError(message, status).response()
    return error_response(message, status)


def create_app(
    tokenizer_manager: TokenizerManager, server_args: ServerArgs, engine_health: EngineHealth | None = None
) -> FastAPI:
    """The app; with `engine_health`, GET /health also checks the subprocesses."""
    tm = tokenizer_manager

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

    app.include_router(native_router(tm, server_args, engine_health))
    app.include_router(sglang_router(tm, server_args))
    app.include_router(weight_router(tm))
    app.include_router(lora_router(tm))
    add_openai_routes(app, tm, server_args)
    app.include_router(chat_page_router())
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
