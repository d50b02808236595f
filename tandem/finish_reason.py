"""A request's finish reason, in SGLang's JSON shape (it travels in every output record and
reaches clients as meta_info["finish_reason"]); built only by these constructors:

    {"type": "stop", "matched": <token id or stop string>}
    {"type": "length", "length": N}
    {"type": "abort", "message": ..., ["status_code": N]}

An abort carries a status code when the request was refused (400, 503) or when handling it
raised (500, `internal_error`): that request ends and the server keeps serving.
"""

from __future__ import annotations

from typing import Any

FinishReason = dict[str, Any]

# The status code of a request ended by `internal_error`.
INTERNAL_ERROR_STATUS = 500


def stop(matched: int | str) -> FinishReason:
    return {"type": "stop", "matched": matched}


def length(n: int) -> FinishReason:
    return {"type": "length", "length": n}


def abort(message: str, status_code: int | None = None) -> FinishReason:
    return (
        {"type": "abort", "message": message}
        if status_code is None
        else {"type": "abort", "status_code": status_code, "message": message}
    )


def internal_error(where: str, exc: BaseException) -> FinishReason:
    """The finish reason of a request whose handling raised."""
    return abort(f"internal error while {where}: {type(exc).__name__}: {exc}", INTERNAL_ERROR_STATUS)
