"""Request bodies parsed as JSON, the same way on every route (native and OpenAI).

orjson parses: it is strict where Python's json module is lenient, so each of these is
invalid JSON (a 400) rather than a value that breaks something later: the `NaN` and
`Infinity` literals, numbers that overflow a double (`1e400`), invalid UTF-8, lone
surrogate escapes (`"\\ud800"`, reported with the field that holds it) and nesting deeper
than 1024 levels (json.loads raises RecursionError near 1000 levels instead).

Parsing stays on the event loop: orjson holds the GIL while it builds the objects, so a
worker thread would not let the loop run meanwhile. The body size limit (limits.py)
bounds its cost (measured on the 2-core dev machine: 32 MB of text in 55 ms; 15 MB of
token ids in 0.2 s).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi.routing import APIRoute, APIRouter
from starlette.requests import Request
from starlette.responses import Response

from tandem.utils.tokenizer import LONE_SURROGATE


class InvalidBody(json.JSONDecodeError):
    """A body that is not acceptable JSON. `message` names `field` when one value is at
    fault. A JSONDecodeError, so FastAPI reports it as a request-validation error."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message, "", 0)
        self.message, self.field = message, field

    def __str__(self) -> str:
        return self.message


def parse_json_body(body: bytes) -> Any:
    """The JSON value of `body`; InvalidBody with a client-facing message otherwise."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        field = _lone_surrogate_field(body) if "surrogate" in str(e) else None
        if field is not None:
            raise InvalidBody(
                f"{field}: contains a lone surrogate escape (\\ud800-\\udfff without its pair), "
                "which is not valid Unicode",
                field,
            ) from e
        raise InvalidBody(f"request body: invalid JSON ({e})") from e


async def read_json_object(request: Request, empty_is_object: bool = False) -> dict[str, Any]:
    """The request body as a JSON object (every route that takes one reads it here);
    ValueError (InvalidBody is one) with a client-facing message otherwise. With
    `empty_is_object`, an empty body (a GET, or a POST without one) reads as {}."""
    raw = await request.body()
    if empty_is_object and not raw.strip():
        return {}
    body = parse_json_body(raw)
    if not isinstance(body, dict):
        raise ValueError("request body: must be a JSON object")
    return body


def _lone_surrogate_field(body: bytes) -> str | None:
    """The dotted path ("messages.0.content") of the first string holding a lone surrogate
    (json.loads accepts them), or None when it cannot tell."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str) and LONE_SURROGATE.search(value):
            return path or "request body"
        if isinstance(value, dict):
            for key, item in reversed(value.items()):
                key_path = f"{path}.{key}" if path else str(key)
                if LONE_SURROGATE.search(key):
                    return f"{path or 'request body'} (a key)"
                stack.append((key_path, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in reversed(list(enumerate(value))))
    return None


class _JSONBodyRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


class JSONBodyRoute(APIRoute):
    """A FastAPI route whose JSON body is parsed by `parse_json_body` instead of json.loads
    (set as the app's `router.route_class` before adding routes)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route_handler(request: Request) -> Response:
            return await handler(_JSONBodyRequest(request.scope, request.receive))

        return route_handler


def json_router() -> APIRouter:
    """An APIRouter whose routes parse JSON bodies with `parse_json_body`."""
    return APIRouter(route_class=JSONBodyRoute)
