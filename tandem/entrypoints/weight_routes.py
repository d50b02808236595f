"""SGLang's weight routes: POST /update_weights_from_disk and /get_weights_by_name.

Both are control calls to the scheduler (tandem/messages.py `ControlReq`); their
bodies and responses are SGLang's."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tandem.entrypoints.json_body import json_router, read_json_object
from tandem.entrypoints.responses import error_response, json_response
from tandem.messages import GetWeightsByNameReqInput, UpdateWeightFromDiskReqInput


def _typed(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    """`body[name]` (or `default` when absent or null); ValueError unless of `kind`."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ValueError(f"{name}: has the wrong type ({type(value).__name__})")
    return value


def weight_router(tm) -> APIRouter:
    """The weight routes, served by TokenizerManager `tm`."""
    router = json_router()

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        """Load new weights of the same architecture from `model_path` without a restart;
        200 or 400 with SGLang's {"success", "message", "num_paused_requests"}."""
        try:
            body = await read_json_object(request, empty_is_object=True)
            req = UpdateWeightFromDiskReqInput(
                request_id="",
                model_path=_typed(body, "model_path", str, ""),
                load_format=_typed(body, "load_format", str, None),
                abort_all_requests=_typed(body, "abort_all_requests", bool, False),
                weight_version=_typed(body, "weight_version", str, None),
            )
            if not req.model_path:
                raise ValueError("model_path: required")
        except ValueError as e:
            return error_response(str(e), 400)
        out = await tm.update_weights(req)
        content = {"success": out.success, "message": out.message, "num_paused_requests": out.num_paused_requests}
        return json_response(content, 200 if out.success else 400)

    @router.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> Response:
        """The first `truncate_size` rows of the served checkpoint tensor `name`, as a list."""
        try:
            body = await read_json_object(request, empty_is_object=True)
            req = GetWeightsByNameReqInput(
                request_id="", name=_typed(body, "name", str, ""), truncate_size=_typed(body, "truncate_size", int, 100)
            )
            if not req.name or req.truncate_size < 0:
                raise ValueError("name: required" if not req.name else "truncate_size: must be >= 0")
        except ValueError as e:
            return error_response(str(e), 400)
        out = await tm.get_weights_by_name(req)
        if out.parameter is None:
            return error_response(f"Get parameter by name failed: {out.message}", 400)
        return json_response(out.parameter)

    return router
