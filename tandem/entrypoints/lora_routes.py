"""SGLang's LoRA routes: POST /load_lora_adapter {"lora_name", "lora_path"} and POST
/unload_lora_adapter {"lora_name"}, while serving (control calls to the scheduler:
tandem/lora/control.py). The response is SGLang's {"success", "error_message",
"loaded_adapters"}: 200 on success, 400 when the load or unload failed, 409 when an
unload is refused because requests use the adapter (their ids in "in_use")."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tandem.entrypoints.json_body import json_router, read_json_object
from tandem.entrypoints.responses import error_response, json_response
from tandem.messages import LoadLoRAAdapterReqInput, LoRAUpdateOutput, UnloadLoRAAdapterReqInput


def _name(body: dict, field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field}: required (a non-empty string)")
    return value


def _response(out: LoRAUpdateOutput) -> Response:
    content = {"success": out.success, "error_message": out.error_message, "loaded_adapters": out.loaded_adapters}
    if out.in_use:
        return json_response({**content, "in_use": out.in_use}, 409)
    return json_response(content, 200 if out.success else 400)


def lora_router(tm) -> APIRouter:
    """The LoRA routes, served by TokenizerManager `tm`."""
    router = json_router()

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        try:
            body = await read_json_object(request)
            req = LoadLoRAAdapterReqInput("", _name(body, "lora_name"), _name(body, "lora_path"))
        except ValueError as e:
            return error_response(str(e), 400)
        return _response(await tm.update_lora(req))

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        try:
            req = UnloadLoRAAdapterReqInput("", _name(await read_json_object(request), "lora_name"))
        except ValueError as e:
            return error_response(str(e), 400)
        return _response(await tm.update_lora(req))

    return router
