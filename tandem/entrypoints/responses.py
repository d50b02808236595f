"""Responses and errors of the native (SGLang) routes; a leaf module every route imports.

Native errors are `{"error": {"message", "type", "code"}}` (the message names the field at
fault); the OpenAI routes answer in OpenAI's shape instead (openai/errors.py).
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import Response


def json_response(obj: Any, status: int = 200) -> Response:
    """A JSON response serialized with orjson (NaN/inf become null)."""
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def error_response(message: str, status: int = 400) -> Response:
    kind = {400: "BadRequestError", 503: "ServiceUnavailableError"}.get(status, "ServerError")
    return json_response({"error": {"message": message, "type": kind, "code": status}}, status)


def ended_by_server_response(message: str, status: int) -> Response:
    """A request the scheduler ended with a status code (busy, a timeout, 503; an internal
    error, 500): SGLang's HTTPException shape, `{"object": "error", "message", "type",
    "param", "code"}`, which its clients and tests read, with Tandem's `error` object too."""
    kind = {400: "BadRequestError", 503: "ServiceUnavailableError"}.get(status, "ServerError")
    return json_response(
        {
            "object": "error",
            "message": message,
            "type": str(status),
            "param": None,
            "code": status,
            "error": {"message": message, "type": kind, "code": status},
        },
        status,
    )
