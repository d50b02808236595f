"""SGLang's native control and information routes, for the clients that call them.

Routes: GET /model_info (alias /get_model_info), GET /server_info (alias
/get_server_info), GET|POST /flush_cache, GET /ping, GET /v1/loads, GET|POST
/start_profile and /stop_profile. Shapes follow SGLang 0.5.23 where Tandem has the
feature; docs/api.md lists what differs.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

import tandem
from tandem.entrypoints.json_body import json_router, read_json_object
from tandem.entrypoints.responses import error_response, json_response
from tandem.messages import ProfileReq
from tandem.model_executor.model_loader import load_config

# How often /flush_cache?timeout=T retries while requests still run.
FLUSH_RETRY_S = 0.1
# Fields of SGLang's ProfileReq that /start_profile honours; the others are ignored.
_PROFILE_FIELDS = (
    "output_dir",
    "num_steps",
    "activities",
    "with_stack",
    "record_shapes",
    "profile_id",
    "profile_prefix",
)


def model_info(server_args, hf_config) -> dict[str, Any]:
    """SGLang's /model_info keys (the features Tandem lacks report their 'off' value), and
    for a GGUF model its file(s) and tensor types; `quantization` when `--quantization`
    was given (gguf, or q8_0/q4_0/q4_1: quantized at load)."""
    gguf = getattr(hf_config, "gguf", None)
    return {
        "model_path": server_args.model_path,
        "served_model_name": server_args.served_model_name,
        "tokenizer_path": server_args.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",  # the route reports the scheduler's current one
        "load_format": server_args.load_format,
        "reasoning_parser": server_args.reasoning_parser,
        "tool_call_parser": server_args.tool_call_parser,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(hf_config, "model_type", None),
        "architectures": getattr(hf_config, "architectures", None),
        **({"gguf": gguf} if gguf else {}),
        **({"quantization": server_args.quantization} if server_args.quantization else {}),
    }


def _loads(state, max_running_requests: int, dp_rank: int) -> dict[str, Any]:
    """One /v1/loads entry (SGLang's core keys and queue section) from a scheduler's counts."""
    used = state.max_total_num_tokens - state.free_kv_slots - state.evictable_cached_slots
    return {
        "dp_rank": dp_rank,
        "num_running_reqs": state.num_running_reqs,
        "num_waiting_reqs": state.num_waiting_reqs,
        "num_used_tokens": used,
        "max_total_num_tokens": state.max_total_num_tokens,
        "max_running_requests": max_running_requests,
        "token_usage": round(used / state.max_total_num_tokens, 4) if state.max_total_num_tokens else 0.0,
        "gen_throughput": state.gen_throughput,
        "queues": {"waiting": state.num_waiting_reqs},
    }


def _profile_req(body: dict[str, Any]) -> ProfileReq:
    fields = {k: body.get(k) for k in _PROFILE_FIELDS}
    num_steps = fields["num_steps"]
    if isinstance(num_steps, str) and num_steps.isdigit():  # SGLang's bench_serving sends a string
        fields["num_steps"] = int(num_steps)
    if fields["num_steps"] is not None and (
        isinstance(fields["num_steps"], bool) or not isinstance(fields["num_steps"], int)
    ):
        raise ValueError("num_steps: must be an integer")
    if fields["activities"] is not None and (
        not isinstance(fields["activities"], list) or not all(isinstance(a, str) for a in fields["activities"])
    ):
        raise ValueError("activities: must be a list of strings")
    for name in ("output_dir", "profile_id", "profile_prefix"):
        if fields[name] is not None and not isinstance(fields[name], str):
            raise ValueError(f"{name}: must be a string")
    return ProfileReq(request_id="", action="start", **fields)


def sglang_router(tm, server_args) -> APIRouter:
    """SGLang's information and control routes, served by TokenizerManager `tm`."""
    router = json_router()
    info = model_info(server_args, load_config(server_args.model_path))

    @router.get("/model_info")
    @router.get("/get_model_info")
    async def model_info_route() -> Response:
        """The model's description; `weight_version` is the scheduler's (it moves with
        /update_weights_from_disk)."""
        state = await tm.get_server_state()
        return json_response({**info, "weight_version": state.weight_version})

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def server_info() -> Response:
        """Resolved arguments, capacities, the scheduler's live counts (also under
        `internal_states`, one entry per data-parallel rank) and `version`."""
        return json_response(await tm.server_info())

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = Query(0.0, ge=0.0)) -> Response:
        """Empty the prefix cache; 400 with the reason while requests run or wait
        (with `timeout`, retry until they are done or `timeout` seconds pass)."""
        deadline = time.monotonic() + timeout
        while True:
            result = await tm.flush_cache()
            if result.success or time.monotonic() >= deadline:
                break
            await asyncio.sleep(FLUSH_RETRY_S)
        if not result.success:
            return error_response(f"cache not flushed: {result.message}", 400)
        return json_response({"success": True})

    @router.get("/ping")
    async def ping() -> Response:
        """SageMaker's health check: 200 while the server runs."""
        return Response(status_code=200)

    @router.get("/v1/loads")
    async def loads() -> Response:
        state = await tm.get_server_state()
        return json_response(
            {
                "timestamp": datetime.now(timezone.utc).isoformat(),
                "version": tandem.__version__,
                "accelerator": None,
                "num_accelerators": 1,
                "loads": [
                    _loads(s, tm.scheduler_info["max_running_requests"], k)
                    for k, s in enumerate(state.dp_rank_states or [state])
                ],
            }
        )

    @router.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(request: Request) -> Response:
        """Start the torch profiler in the scheduler; the trace is written by /stop_profile
        (or after `num_steps` forward steps) into `output_dir`."""
        try:
            req = _profile_req(await read_json_object(request, empty_is_object=True))  # GET sends none
        except ValueError as e:
            return error_response(str(e))
        return await _profile_call(req, "Start profiling.\n")

    @router.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile() -> Response:
        return await _profile_call(
            ProfileReq(request_id="", action="stop"), "Stop profiling. This will take some time.\n"
        )

    async def _profile_call(req: ProfileReq, ok_text: str) -> Response:
        result = await tm.profile(req)
        if not result.success:
            return error_response(result.message, 400)
        return Response(content=ok_text, status_code=200, media_type="text/plain")

    return router
