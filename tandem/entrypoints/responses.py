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
