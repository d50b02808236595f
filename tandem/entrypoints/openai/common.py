"""Helpers shared by the chat and completions handlers: sampling params,
token budgets, opening and merging the tokenizer manager's output streams, usage,
finish reasons, logprob entries and SSE framing."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi.responses import Response, StreamingResponse

from tandem.entrypoints.disconnect import ClientDisconnected, await_or_disconnect
from tandem.entrypoints.native_protocol import GenerateReqInput
from tandem.entrypoints.openai.errors import OpenAIError
from tandem.entrypoints.openai.protocol import UsageInfo, _SamplingFields
from tandem.entrypoints.streams import Refused, admitted_streams, last_outputs, refusal

SSE_DONE = b"data: [DONE]\n\n"
# OpenAI reports -9999.0 where a logprob is -inf (JSON has no infinity).
MIN_LOGPROB = -9999.0


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# JSON may hold U+0085, U+2028 and U+2029 raw inside strings, and orjson writes them so;
# clients that split lines as `str.splitlines` does (httpx's `aiter_lines`) would cut the
# event there. Their escapes are the same JSON.
_LINE_BREAKING = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse_json(obj: Any) -> bytes:
    """`obj` as JSON on one line for every line splitter (for a server-sent event's data)."""
    data = orjson.dumps(obj)
    for raw, escaped in _LINE_BREAKING:
        if raw in data:
            data = data.replace(raw, escaped)
    return data


def sse(obj: Any) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + sse_json(obj) + b"\n\n"


def served_model_names(server_args) -> set[str]:
    return {n for n in (server_args.served_model_name, server_args.model_path) if n}


def lora_adapter_of(req: _SamplingFields) -> str | None:
    """The LoRA adapter a request names, as SGLang reads it: its `lora_path`, else the
    adapter of `model: "<base>:<adapter>"`; None: the base model."""
    if req.lora_path:
        return req.lora_path
    _, sep, adapter = (req.model or "").partition(":")
    return adapter if sep and adapter else None


def reject_unsupported(req: _SamplingFields) -> None:
    """400 naming the first field whose feature is not implemented, if set to a non-neutral value."""
    bad = req.unsupported_fields()
    if bad:
        raise OpenAIError(
            f"{bad[0]}: not supported yet (only the neutral/default value is accepted)", 400, param=bad[0]
        )


def sampling_params(req: _SamplingFields, max_new_tokens: int) -> dict[str, Any]:
    """SGLang sampling params for `req`; extras left unset keep the engine's defaults."""
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "n": req.n or 1,
    }
    if req.stop is not None:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.stop_regex:
        params["stop_regex"] = [req.stop_regex] if isinstance(req.stop_regex, str) else list(req.stop_regex)
    if req.seed is not None:
        params["sampling_seed"] = req.seed
    for name in (
        "top_k",
        "min_p",
        "ignore_eos",
        "stop_token_ids",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
    ):
        value = getattr(req, name)
        if value is not None:
            params[name] = value
    if req.min_tokens is not None:
        params["min_new_tokens"] = req.min_tokens
    if req.custom_params:
        params["custom_params"] = req.custom_params
    grammars = req.grammar_fields()
    if len(grammars) > 1:
        names = list(grammars)
        raise OpenAIError(f"Only one of {', '.join(names)} can be set: each constrains the output", 400, param=names[0])
    for name, value in grammars.values():
        params[name] = value
    return params


def resolve_max_tokens(
    requested: int | None, prompt_len: int, context_len: int, default: int | None, param: str, prompt_param: str
) -> int:
    """The number of tokens to generate.

    An explicit `requested` that does not fit the context beside the prompt is a 400; the
    default (None: "up to the context") is capped to what fits. The messages are SGLang's
    (clients and SGLang's tests match on them).
    """
    room = context_len - prompt_len
    if room <= 0:
        raise OpenAIError(
            f"The input ({prompt_len} tokens) is longer than the model's context length ({context_len} tokens).",
            400,
            param=prompt_param,
        )
    if requested is None:
        return room if default is None else min(default, room)
    if requested > context_len:  # SGLang's words (its clients and tests match them)
        raise OpenAIError(
            f"max_completion_tokens is too large: {requested}. "
            f"This model supports at most {context_len} completion tokens.",
            400,
            param=param,
        )
    if requested > room:
        raise OpenAIError(
            f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
            f"You requested a total of {prompt_len + requested} tokens: {prompt_len} tokens from the input "
            f"messages and {requested} tokens for the completion. Please reduce the number of tokens in the "
            f"input messages or the completion to fit within the limit.",
            400,
            param=param,
        )
    return requested


def finish_reason(meta: dict[str, Any]) -> str | None:
    """OpenAI's finish_reason ("stop", "length", "abort") from SGLang's dict, None while running."""
    fr = meta.get("finish_reason")
    if fr is None:
        return None
    return fr.get("type", "stop") if isinstance(fr, dict) else str(fr)


def matched_stop(meta: dict[str, Any]) -> int | str | None:
    """SGLang's `matched_stop`: the stop string or token id (EOS included) that finished the
    output; None while running and for length or abort finishes."""
    fr = meta.get("finish_reason")
    return fr.get("matched") if isinstance(fr, dict) else None


def usage_of(metas: list[dict[str, Any]], n: int) -> UsageInfo:
    """Usage of B*n outputs (prompt-major): each prompt counted once, every completion summed."""
    prompt = sum(m.get("prompt_tokens", 0) for m in metas[::n])
    completion = sum(m.get("completion_tokens", 0) for m in metas)
    return UsageInfo.of(prompt, completion)


def clamp_logprob(value: float | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    return MIN_LOGPROB if value != value or value < MIN_LOGPROB else value


def token_text(entry: list | tuple, tokenizer) -> str:
    """The text of a [logprob, token_id, text_or_None] entry (decoded here if missing)."""
    text = entry[2] if len(entry) > 2 else None
    if text is not None:
        return text
    if tokenizer is None:
        return f"token_id:{entry[1]}"
    return tokenizer.decode([entry[1]])


# ---- output streams ----------------------------------------------------------------


async def open_streams(tm, obj: GenerateReqInput) -> list[AsyncIterator[dict[str, Any]]]:
    """Send `obj`; one stream per (prompt, sample). Streamed chunks hold only what is new.

    Raises ValueError (a client error) before anything is sent.
    """
    return await tm.generate_request(obj, incremental=True)


def raise_if_refused(outputs: list[dict[str, Any]]) -> None:
    """OpenAIError (503) when the scheduler refused any of these requests outright."""
    refused = refusal(outputs)
    if refused is not None:
        raise OpenAIError(refused[0], refused[1])


async def respond(
    request,
    streams: list[AsyncIterator[dict[str, Any]]],
    stream: bool,
    body: Callable[[list], AsyncIterator[bytes]],
    build: Callable[[list[dict[str, Any]]], Response],
) -> Response:
    """The tail every generating OpenAI route shares: with `stream`, an SSE response of
    `body(streams)` once the scheduler admitted the request; otherwise `build(outputs)` of
    the final outputs. 499 when the client left first; OpenAIError (503) when refused."""
    if stream:
        try:
            streams = await admitted_streams(request, streams)
        except Refused as e:
            raise OpenAIError(e.message, e.status) from e
        if streams is None:
            return Response(status_code=499)
        return StreamingResponse(body(streams), media_type="text/event-stream")
    try:
        outputs = await await_or_disconnect(request, last_outputs(streams))
    except ClientDisconnected:
        return Response(status_code=499)
    raise_if_refused(outputs)
    return build(outputs)


def error_event(message: str, status: int = 500) -> bytes:
    """An SSE carrying an error raised after the stream started."""
    kind = "BadRequestError" if status == 400 else "InternalServerError"
    return sse({"error": {"object": "error", "message": message, "type": kind, "param": None, "code": status}})
