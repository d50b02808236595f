"""OpenAI-shaped errors: `{"object": "error", "message", "type", "param", "code"}` (SGLang's
shape), on /v1/responses nested as `{"error": {"message", "type", "param", "code"}}` (OpenAI's,
which SGLang's tests of that route read), on /v1/messages in Anthropic's shape
`{"type": "error", "error": {"type": "invalid_request_error", "message"}}`.

Client mistakes become 400 (401 for a missing/wrong API key, 404 for unknown routes or
models); the server never answers 500 for something the client can fix. Handlers here
convert FastAPI's request-validation errors, HTTP exceptions (404/405) and the
`ValueError`s raised by the tokenizer manager (whose messages start with the SGLang field
name, e.g. "sampling_params.temperature: ...") into that shape.
"""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.entrypoints.json_body import InvalidBody
from tandem.entrypoints.responses import json_response

# SGLang/native field names (as they appear in tokenizer-manager errors) -> OpenAI names.
_NATIVE_TO_OPENAI = {
    "max_new_tokens": "max_tokens",
    "sampling_seed": "seed",
    "top_logprobs_num": "top_logprobs",
    "return_logprob": "logprobs",
    "min_new_tokens": "min_tokens",
}
# Routes whose errors nest under "error".
NESTED_ERROR_PATHS = frozenset({"/v1/responses"})
# Routes whose errors take Anthropic's shape.
ANTHROPIC_ERROR_PATHS = frozenset({"/v1/messages"})
# HTTP status -> Anthropic's error type (others: invalid_request_error, or api_error from 500).
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# Pydantic location parts that name a union member or validator, not a field.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|function-\w+|lax-or-strict|json-or-python)\b|[\[\]<>]")


class OpenAIError(Exception):
    """An error to return to the client in OpenAI's shape; `code` is the HTTP status, as in SGLang."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, type_: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type_ or _default_type(status)

    def to_dict(self, nested: bool = False) -> dict[str, Any]:
        fields = {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        return {"error": fields} if nested else {"object": "error", **fields}

    def response(self, nested: bool = False) -> Response:
        return json_response(self.to_dict(nested), self.status)

    def anthropic_dict(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response_for(self, path: str) -> Response:
        """The response in the shape of the route at `path`."""
        if path in ANTHROPIC_ERROR_PATHS:
            return json_response(self.anthropic_dict(), self.status)
        return self.response(path in NESTED_ERROR_PATHS)


def _default_type(status: int) -> str:
    return {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        405: "MethodNotAllowedError",
        503: "ServiceUnavailableError",
    }.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


def from_value_error(exc: Exception, rename: dict[str, str] | None = None) -> OpenAIError:
    """Turn a tokenizer-manager ValueError ("field: reason") into a 400 naming the OpenAI field.

    `rename` maps native field names to this route's names (e.g. "text/input_ids" -> "prompt").
    """
    message = str(exc)
    field, sep, reason = message.partition(": ")
    if not sep or " " in field:
        return OpenAIError(message, 400)
    name = field.removeprefix("sampling_params.")
    name = (rename or {}).get(name, _NATIVE_TO_OPENAI.get(name, name))
    return OpenAIError(f"{name}: {reason}", 400, param=name)


# What a field accepts, for errors in fields typed as a union (pydantic reports every member).
_UNION_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of content parts",
    "tool_choice": 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    "system": "must be a string or a list of text blocks",
}


def _is_tag(part: Any) -> bool:
    return isinstance(part, str) and bool(_TYPE_TAG.search(part))


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body" and not _is_tag(p)]
    return ".".join(parts) or None


def _union_param(loc: tuple[Any, ...]) -> str | None:
    """The path up to the first union-member tag, when `loc` goes through a union."""
    for i, part in enumerate(loc):
        if _is_tag(part):
            return _loc_to_param(loc[:i])
    return None


def from_validation_error(exc: RequestValidationError) -> OpenAIError:
    """A 400 for the first pydantic error, naming the field in `message` and `param`."""
    if isinstance(exc.__cause__, InvalidBody):  # the body is not acceptable JSON (json_body.py)
        return OpenAIError(exc.__cause__.message, 400, param=exc.__cause__.field)
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request", 400)
    first = errors[0]
    if first.get("type") == "json_invalid":
        return OpenAIError(f"request body: invalid JSON ({first.get('ctx', {}).get('error', first['msg'])})", 400)
    loc = tuple(first.get("loc", ()))
    union = _union_param(loc)
    if union is not None:
        hint = _UNION_HINTS.get(union.rsplit(".", 1)[-1], "has an invalid type or value")
        return OpenAIError(f"{union}: {hint}", 400, param=union)
    param = _loc_to_param(loc)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return OpenAIError(f"{param or 'request body'}: {msg}{more}", 400, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Answer validation errors, HTTP errors (404/405) and OpenAIError in the route's shape."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return from_validation_error(exc).response_for(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            message = f"{request.method} {request.url.path}: no such route"
        else:
            message = str(exc.detail) if exc.detail else HTTPStatus(exc.status_code).phrase
        return OpenAIError(message, exc.status_code).response_for(request.url.path)

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> Response:
        return exc.response_for(request.url.path)
