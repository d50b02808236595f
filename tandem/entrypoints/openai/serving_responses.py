"""POST /v1/responses: OpenAI's Responses API, plain text.

The input (a string, or messages with text content, after `instructions` as a system
message) goes through the chat template like a chat request; the answer is one
`response` object whose output is one assistant message (after a reasoning item with the
think block, under `--reasoning-parser`, as SGLang answers), or, streamed, SGLang's
sequence of typed events (`event: <type>` + `data: <json>`, no `[DONE]`):

    response.created, response.in_progress,
    (with a think block) response.output_item.added, response.reasoning_text.delta ...,
    response.reasoning_text.done, response.output_item.done,
    response.output_item.added, response.content_part.added,   (at the first text)
    response.output_text.delta ...,
    response.output_text.done, response.content_part.done, response.output_item.done,
    response.completed | response.incomplete (max_output_tokens reached) | response.failed

Shapes and defaults follow SGLang's serving_responses (temperature 0.7 when unset).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tandem.entrypoints.native_protocol import GenerateReqInput
from tandem.entrypoints.openai.common import open_streams, resolve_max_tokens, respond, sse_json
from tandem.entrypoints.openai.errors import OpenAIError, from_value_error
from tandem.entrypoints.openai.protocol import ChatMessage, ResponsesRequest
from tandem.entrypoints.openai.serving_chat import ChatServing, encode_chat_prompt, render_chat_prompt
from tandem.entrypoints.responses import json_response
from tandem.entrypoints.streams import merge_streams
from tandem.reasoning_parser import ReasoningResult, ReasoningStream, parse_reasoning, starts_in_reasoning

logger = logging.getLogger(__name__)
# SGLang's default temperature for /v1/responses.
DEFAULT_TEMPERATURE = 0.7
_TEXT_PARTS = ("input_text", "output_text", "text")


# ---- request -> messages -> GenerateReqInput -----------------------------------------


def input_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """`instructions` as a system message, then the input as chat messages (text only)."""
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    if isinstance(req.input, str):
        return messages + [ChatMessage(role="user", content=req.input)]
    for i, item in enumerate(req.input):
        if item.get("type", "message") != "message" or "role" not in item:
            raise OpenAIError(
                f"input.{i}: only message items with a role are supported, got type {item.get('type')!r}",
                400,
                param=f"input.{i}",
            )
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") not in _TEXT_PARTS
                    or not isinstance(part.get("text"), str)
                ):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise OpenAIError(
                        f"input.{i}.content.{j}: only text content parts are supported, got type {kind!r}",
                        400,
                        param=f"input.{i}.content",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise OpenAIError(
                f"input.{i}.content: must be a string or a list of content parts", 400, param=f"input.{i}.content"
            )
        try:
            messages.append(ChatMessage(role=item["role"], content=content))
        except ValueError as e:
            raise OpenAIError(
                f"input.{i}.role: {e.errors()[0]['msg'].removeprefix('Value error, ')}", 400, param=f"input.{i}.role"
            ) from e
    return messages


def responses_sampling_params(req: ResponsesRequest, max_new_tokens: int) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
    }
    if req.stop is not None:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    for name in ("top_k", "min_p", "repetition_penalty"):
        if getattr(req, name) is not None:
            params[name] = getattr(req, name)
    return params


# ---- outputs -> response objects -------------------------------------------------------


def status_of(meta: dict[str, Any]) -> str:
    """SGLang's mapping: length -> incomplete, abort -> failed, else completed."""
    kind = (meta.get("finish_reason") or {}).get("type")
    return {"length": "incomplete", "abort": "failed"}.get(kind, "completed")


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message output item (its content empty while in progress)."""
    content = [] if text is None else [output_text_part(text)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "status": status,
        "phase": "final_answer",
    }


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A reasoning output item (SGLang's, with `--reasoning-parser`): the think block's text
    as one `reasoning_text` part (none while in progress)."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def output_items(text: str, in_reasoning: bool | None) -> list[dict[str, Any]]:
    """A finished output's items: its think block as a reasoning item (`in_reasoning` not
    None: tandem/reasoning_parser.py), then the rest as the assistant message."""
    split = parse_reasoning(text, in_reasoning) if in_reasoning is not None else ReasoningResult(content=text)
    items = [reasoning_item(f"rs_{uuid.uuid4().hex}", split.reasoning, "completed")] if split.reasoning else []
    if split.content:
        items.append(message_item(f"msg_{uuid.uuid4().hex}", split.content, "completed"))
    return items


def usage_of(meta: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's usage keys, and SGLang's (`prompt_tokens`, `completion_tokens`: its
    /v1/responses answers with its chat usage, and its tests read those)."""
    prompt, completion = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0), "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
    }


def response_object(
    req: ResponsesRequest,
    model: str,
    created: int,
    status: str,
    output: list[dict[str, Any]],
    meta: dict[str, Any] | None,
) -> dict[str, Any]:
    """The `response` object, with SGLang's keys; `meta` (the final meta_info) gives usage
    and the error of a failed response."""
    error = None
    if status == "failed":
        error = {
            "code": "server_error",
            "message": (meta or {}).get("finish_reason", {}).get("message") or "Generation aborted",
        }
    return {
        "id": req.request_id,
        "object": "response",
        "created_at": created,
        "model": model,
        "output": output,
        "status": status,
        "usage": usage_of(meta) if meta is not None else None,
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "tool_choice": req.tool_choice,
        "tools": [],
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store,
        "temperature": req.temperature,
        "text": {"format": {"type": "text"}} if output else None,
        "top_p": req.top_p,
        "truncation": req.truncation,
        "user": req.user,
        "metadata": req.metadata or {},
    }


class ResponsesStreamConverter:
    """Turns one request's incremental outputs into the Responses API's typed events: with
    `in_reasoning` (not None) the think block first, as a reasoning item (output 0) whose
    text streams as `response.reasoning_text.delta` events, then the message."""

    def __init__(self, req: ResponsesRequest, model: str, created: int, in_reasoning: bool | None = None):
        self.req, self.model, self.created = req, model, created
        self.sequence_number = 0
        self.reasoning = ReasoningStream(in_reasoning) if in_reasoning is not None else None
        self.reasoning_id: str | None = None
        self.reasoning_text = ""
        self.item_id: str | None = None
        self.text = ""
        self.output: list[dict[str, Any]] = []  # the items done
        self.meta: dict[str, Any] = {}

    def _event(self, event_type: str, **fields: Any) -> bytes:
        payload = {"type": event_type, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return f"event: {event_type}\n".encode() + b"data: " + sse_json(payload) + b"\n\n"

    def start(self) -> list[bytes]:
        initial = response_object(self.req, self.model, self.created, "in_progress", [], None)
        return [self._event(t, response=initial) for t in ("response.created", "response.in_progress")]

    def on_output(self, out: dict[str, Any]) -> list[bytes]:
        self.meta = out.get("meta_info") or self.meta
        delta = out.get("text") or ""
        if self.reasoning is None:
            return self._content(delta)
        split = self.reasoning.feed(delta)
        return self._reasoning(split.reasoning) + self._content(split.content)

    def _reasoning(self, delta: str) -> list[bytes]:
        if not delta:
            return []
        events = []
        if self.reasoning_id is None:
            self.reasoning_id = f"rs_{uuid.uuid4().hex}"
            item = reasoning_item(self.reasoning_id, None, "in_progress")
            events.append(self._event("response.output_item.added", output_index=0, item=item))
        self.reasoning_text += delta
        fields = {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}
        return events + [self._event("response.reasoning_text.delta", **fields, delta=delta)]

    def _close_reasoning(self) -> list[bytes]:
        if self.reasoning_id is None or self.output:
            return []
        item = reasoning_item(self.reasoning_id, self.reasoning_text, "completed")
        self.output.append(item)
        fields = {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}
        return [
            self._event("response.reasoning_text.done", **fields, text=self.reasoning_text),
            self._event("response.output_item.done", output_index=0, item=item),
        ]

    def _content(self, delta: str) -> list[bytes]:
        if not delta:
            return []
        events = self._close_reasoning()
        index = len(self.output)
        if self.item_id is None:
            self.item_id = f"msg_{uuid.uuid4().hex}"
            events += [
                self._event(
                    "response.output_item.added",
                    output_index=index,
                    item=message_item(self.item_id, None, "in_progress"),
                ),
                self._event(
                    "response.content_part.added",
                    output_index=index,
                    item_id=self.item_id,
                    content_index=0,
                    part=output_text_part(""),
                ),
            ]
        self.text += delta
        events.append(
            self._event(
                "response.output_text.delta",
                content_index=0,
                output_index=index,
                item_id=self.item_id,
                delta=delta,
                logprobs=[],
            )
        )
        return events

    def end(self) -> list[bytes]:
        events = []
        if self.reasoning is not None:
            split = self.reasoning.finish()
            events += self._reasoning(split.reasoning) + self._content(split.content)
        events += self._close_reasoning()
        if self.item_id is not None:
            item, index = message_item(self.item_id, self.text, "completed"), len(self.output)
            self.output.append(item)
            events += [
                self._event(
                    "response.output_text.done",
                    output_index=index,
                    content_index=0,
                    text=self.text,
                    logprobs=[],
                    item_id=self.item_id,
                ),
                self._event(
                    "response.content_part.done",
                    item_id=self.item_id,
                    output_index=index,
                    content_index=0,
                    part=output_text_part(self.text),
                ),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
        status = status_of(self.meta)
        final = response_object(self.req, self.model, self.created, status, self.output, self.meta)
        return events + [self._event(f"response.{status}", response=final)]

    def failed(self, message: str) -> list[bytes]:
        failed = response_object(self.req, self.model, self.created, "failed", [], None)
        failed["error"] = {"code": "server_error", "message": message}
        return [self._event("response.failed", response=failed)]


# ---- the handler -------------------------------------------------------------------


class ResponsesServing:
    """Serves /v1/responses with the chat route's template and tokenization."""

    def __init__(self, chat: ChatServing):
        self.chat = chat
        self.tm = chat.tm

    async def prepare(self, req: ResponsesRequest) -> tuple[GenerateReqInput, bool | None]:
        """Validate and tokenize `req`; raises OpenAIError for client mistakes. Also whether
        the output starts inside a think block (None: no `--reasoning-parser`)."""
        bad = req.unsupported_fields()
        if bad:
            raise OpenAIError(
                f"{bad[0]}: not supported yet (only the neutral/default value is accepted)", 400, param=bad[0]
            )
        text = render_chat_prompt(self.tm.tokenizer, input_messages(req), self.chat.chat_template)
        input_ids = await encode_chat_prompt(self.tm.text_encoder, text, self.tm.context_len - 1)
        max_new = resolve_max_tokens(
            req.max_output_tokens, len(input_ids), self.tm.context_len, None, "max_output_tokens", "input"
        )
        obj = GenerateReqInput(
            input_ids=input_ids, sampling_params=responses_sampling_params(req, max_new), stream=bool(req.stream)
        )
        parser = self.chat.server_args.reasoning_parser
        return obj, (starts_in_reasoning(parser, text) if parser is not None else None)

    async def handle(self, request: Request, req: ResponsesRequest) -> Response:
        obj, in_reasoning = await self.prepare(req)
        try:
            streams = await open_streams(self.tm, obj)
        except ValueError as e:
            raise from_value_error(
                e, {"text/input_ids": "input", "input_ids": "input", "max_tokens": "max_output_tokens"}
            ) from e
        model, created = req.model or self.chat.server_args.served_model_name or "default", int(time.time())
        conv = ResponsesStreamConverter(req, model, created, in_reasoning)
        return await respond(
            request,
            streams,
            bool(req.stream),
            lambda s: _stream_body(conv, s),
            lambda outputs: json_response(final_response(req, model, created, outputs[0], in_reasoning)),
        )


def final_response(
    req: ResponsesRequest, model: str, created: int, out: dict[str, Any], in_reasoning: bool | None = None
) -> dict[str, Any]:
    """The response object of a finished (non-streamed) generation."""
    output = output_items(out.get("text") or "", in_reasoning)
    return response_object(req, model, created, status_of(out["meta_info"]), output, out["meta_info"])


async def _stream_body(conv: ResponsesStreamConverter, streams) -> AsyncIterator[bytes]:
    for event in conv.start():
        yield event
    try:
        async for _, out in merge_streams(streams):
            for event in conv.on_output(out):
                yield event
    except Exception as e:  # noqa: BLE001 - the status line is already sent
        logger.exception("responses stream failed")
        for event in conv.failed(f"{type(e).__name__}: {e}"):
            yield event
        return
    for event in conv.end():
        yield event
