"""Mounts the OpenAI-compatible API on the FastAPI app, plus the `--api-key` middleware.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
GET /v1/models/{id}, POST /tokenize and /detokenize (also under /v1/), POST /v1/score
(SGLang's), POST /v1/responses, POST /v1/messages (Anthropic's). Errors use OpenAI's
shape (Anthropic's on /v1/messages; see `errors.py`), for these routes and for unknown
routes (404).
"""

from __future__ import annotations

import secrets
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from tandem.entrypoints.json_body import json_router
from tandem.entrypoints.openai import serving_models
from tandem.entrypoints.openai.errors import OpenAIError, install_error_handlers
from tandem.entrypoints.openai.protocol import (
    AnthropicMessagesRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    ScoringRequest,
    TokenizeRequest,
)
from tandem.entrypoints.openai.serving_chat import ChatServing
from tandem.entrypoints.openai.serving_completions import CompletionServing
from tandem.entrypoints.openai.serving_messages import MessagesServing
from tandem.entrypoints.openai.serving_responses import ResponsesServing
from tandem.entrypoints.openai.serving_score import handle_score
from tandem.entrypoints.responses import json_response

# Routes reachable without the API key (load balancers and monitoring).
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})
# GET routes reachable without it: the chat page (entrypoints/chat_page.py), which holds
# no secret; its API calls send the key.
OPEN_GET_PATHS = frozenset({"/"})


def load_chat_template(path: str | None) -> str | None:
    """The Jinja text of `--chat-template`, or None to use the tokenizer's own."""
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--chat-template: no such file {path!r}")
    return p.read_text()


def openai_router(tm, server_args) -> APIRouter:
    """The OpenAI-compatible routes, served by TokenizerManager `tm` (their error handlers:
    `errors.install_error_handlers`)."""
    router = json_router()
    chat = ChatServing(tm, server_args, load_chat_template(getattr(server_args, "chat_template", None)))
    completions = CompletionServing(tm, server_args)
    responses = ResponsesServing(chat)
    messages = MessagesServing(chat)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: ChatCompletionRequest) -> Response:
        return await chat.handle(request, req)

    @router.post("/v1/completions")
    async def completions_route(request: Request, req: CompletionRequest) -> Response:
        return await completions.handle(request, req)

    @router.post("/v1/score")
    async def score_route(request: Request, req: ScoringRequest) -> Response:
        return await handle_score(tm, request, req)

    @router.post("/v1/responses")
    async def responses_route(request: Request, req: ResponsesRequest) -> Response:
        return await responses.handle(request, req)

    @router.post("/v1/messages")
    async def messages_route(request: Request, req: AnthropicMessagesRequest) -> Response:
        return await messages.handle(request, req)

    @router.get("/v1/models")
    async def models() -> Response:
        cards = serving_models.list_models(server_args, tm.context_len, tm.scheduler_info.get("gguf"), tm.lora_adapters)
        return json_response(cards.model_dump())

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        card = serving_models.retrieve_model(
            model_id, server_args, tm.context_len, tm.scheduler_info.get("gguf"), tm.lora_adapters
        )
        return json_response(card.model_dump())

    @router.post("/v1/tokenize")
    @router.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Response:
        return json_response(await serving_models.tokenize(req, tm.text_encoder, tm.context_len, chat))

    @router.post("/v1/detokenize")
    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Response:
        return json_response(await serving_models.detokenize(req, tm.text_encoder, getattr(tm, "vocab_size", None)))

    return router


def add_openai_routes(app: FastAPI, tm, server_args) -> None:
    """Mount the OpenAI-compatible routes and their OpenAI-shaped error handlers on `app`."""
    install_error_handlers(app)
    app.include_router(openai_router(tm, server_args))


def add_api_key_middleware(app: FastAPI, api_key: str | None) -> None:
    """With `api_key`, require `Authorization: Bearer <api_key>` (the scheme is
    case-insensitive, as HTTP says) or `x-api-key: <api_key>` (Anthropic's header) on every
    route but OPEN_PATHS and GET of OPEN_GET_PATHS."""
    if not api_key:
        return
    expected = api_key.encode()

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        path = request.url.path
        if path in OPEN_PATHS or request.method == "OPTIONS" or (request.method == "GET" and path in OPEN_GET_PATHS):
            return await call_next(request)
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        bearer = scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), expected)
        x_api_key = request.headers.get("x-api-key")
        if not bearer and not (x_api_key is not None and secrets.compare_digest(x_api_key.strip().encode(), expected)):
            message = "invalid or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            return OpenAIError(message, 401).response_for(path)
        return await call_next(request)
