"""POST /v1/messages: Anthropic's Messages API (SGLang serves it too), as a translation onto
the chat-completions pipeline: the request becomes a ChatCompletionRequest (`system`
first as a system message, text blocks joined, `stop_sequences` as `stop`), which
ChatServing validates, renders and tokenizes; its outputs go through the chat route's
response builders, and the result is rewritten in Anthropic's shape.

`thinking` maps as SGLang maps it: `{"type": "enabled"}` / `{"type": "disabled"}` set the
chat template's `enable_thinking` (`chat_template_kwargs`); with `--reasoning-parser` the
think block becomes a `thinking` block (its `signature` empty: nothing signs it), before
the `text` block. With thinking disabled no thinking block is answered (a think block the
model writes anyway is left out, never leaked into the text). `budget_tokens` is
accepted and not enforced.

Streamed, the answer is Anthropic's events, each `event: <type>` + `data: <json>`:

    message_start, (with a think block) content_block_start {thinking},
    content_block_delta {thinking_delta} ..., content_block_delta {signature_delta},
    content_block_stop, content_block_start {text}, content_block_delta {text_delta} ...,
    content_block_stop, message_delta {stop_reason, stop_sequence, usage}, message_stop

Errors take Anthropic's shape (errors.py); one raised after the stream started is an
`event: error`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tandem.entrypoints.openai.common import open_streams, respond, sse_json
from tandem.entrypoints.openai.errors import OpenAIError, from_value_error
from tandem.entrypoints.openai.protocol import (
    AnthropicContentBlock,
    AnthropicMessagesRequest,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    StreamOptions,
)
from tandem.entrypoints.openai.serving_chat import _PROMPT_FIELD, ChatServing, ChatStreamConverter, build_chat_response
from tandem.entrypoints.responses import json_response
from tandem.entrypoints.streams import merge_streams

logger = logging.getLogger(__name__)
# Chat field names (in errors of the chat pipeline) -> this route's.
_RENAMES = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}


# ---- request -> chat request ---------------------------------------------------------


def _text_of(content: str | list[AnthropicContentBlock], field: str, sep: str, history: bool = False) -> str:
    """A string, or text blocks joined by `sep`; `history`: an assistant turn, whose thinking
    blocks are left out (chat templates drop earlier reasoning)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        if history and block.type in ("thinking", "redacted_thinking"):
            continue
        if block.type != "text" or block.text is None:
            raise OpenAIError(
                f"{field}.{j}: only text content blocks are supported, got type {block.type!r}", 400, param=field
            )
        texts.append(block.text)
    return sep.join(texts)


def to_chat_request(req: AnthropicMessagesRequest) -> ChatCompletionRequest:
    """The chat request that `req` asks for."""
    bad = req.unsupported_fields()
    if bad:
        raise OpenAIError(f"{bad[0]}: not supported yet on /v1/messages", 400, param=bad[0])
    messages = []
    if req.system is not None:
        system = _text_of(req.system, "system", "\n")
        if system:
            messages.append(ChatMessage(role="system", content=system))
    for i, m in enumerate(req.messages):
        text = _text_of(m.content, f"messages.{i}.content", "", history=m.role == "assistant")
        messages.append(ChatMessage(role=m.role, content=text))
    chat = ChatCompletionRequest(
        messages=messages,
        model=req.model,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=req.stop_sequences,
        stream=bool(req.stream),
        stream_options=StreamOptions(include_usage=True) if req.stream else None,
    )
    if req.thinking is not None:
        chat.chat_template_kwargs = {"enable_thinking": req.thinking.type == "enabled"}
    return chat


def _renamed(e: OpenAIError) -> OpenAIError:
    """`e` with the chat field it names as this route names it."""
    field, sep, reason = e.message.partition(": ")
    if sep and field in _RENAMES:
        return OpenAIError(f"{_RENAMES[field]}: {reason}", e.status, param=_RENAMES[field], type_=e.type)
    return e


# ---- chat outputs -> Anthropic ---------------------------------------------------------


def stop_reason_of(finish_reason: str | None, matched: Any, stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a matched stop sequence, max_tokens for a length
    finish, else end_turn (EOS or a stop token)."""
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched, str) and matched in (stop_sequences or []):
        return "stop_sequence", matched
    return "end_turn", None


def usage_block(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def message_object(
    msg_id: str,
    model: str,
    content: list[dict[str, Any]],
    stop_reason: str | None,
    stop_sequence: str | None,
    usage: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    }


def from_chat_response(
    msg_id: str, resp: ChatCompletionResponse, show_thinking: bool, stop_sequences: list[str] | None
) -> dict[str, Any]:
    """The Anthropic message of a finished chat response (one choice)."""
    choice = resp.choices[0]
    content = []
    if show_thinking and choice.message.reasoning_content:
        content.append({"type": "thinking", "thinking": choice.message.reasoning_content, "signature": ""})
    text = choice.message.content or ""
    if text or not content:
        content.append({"type": "text", "text": text})
    reason, sequence = stop_reason_of(choice.finish_reason, choice.matched_stop, stop_sequences)
    usage = usage_block(resp.usage.prompt_tokens, resp.usage.completion_tokens)
    return message_object(msg_id, resp.model, content, reason, sequence, usage)


def _event(event_type: str, payload: dict[str, Any]) -> bytes:
    return f"event: {event_type}\n".encode() + b"data: " + sse_json({"type": event_type, **payload}) + b"\n\n"


def error_event(message: str) -> bytes:
    return _event("error", {"error": {"type": "api_error", "message": message}})


class MessagesStreamConverter:
    """Turns the chat route's stream chunks (ChatStreamConverter's, one choice, with usage)
    into Anthropic's events."""

    def __init__(
        self,
        msg_id: str,
        model: str,
        input_tokens: int,
        show_thinking: bool,
        stop_sequences: list[str] | None,
    ):
        self.msg_id, self.model, self.input_tokens = msg_id, model, input_tokens
        self.show_thinking, self.stop_sequences = show_thinking, stop_sequences
        self.index = -1  # the open (or last) content block
        self.open: str | None = None  # its type while open
        self.finish: tuple[str, str | None] = ("end_turn", None)
        self.output_tokens = 0

    def start(self) -> list[bytes]:
        message = message_object(self.msg_id, self.model, [], None, None, usage_block(self.input_tokens, 0))
        return [_event("message_start", {"message": message})]

    def _block(self, kind: str) -> list[bytes]:
        """Open a block of `kind` (closing the open one) unless one is open."""
        if self.open == kind:
            return []
        events = self._close()
        self.index += 1
        self.open = kind
        block = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if kind == "thinking"
            else {"type": "text", "text": ""}
        )
        return events + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append(_delta(self.index, {"type": "signature_delta", "signature": ""}))
        self.open = None
        return events + [_event("content_block_stop", {"index": self.index})]

    def on_chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        events = []
        usage = chunk.get("usage")
        if usage and not chunk["choices"]:
            self.output_tokens = usage["completion_tokens"]
        for choice in chunk["choices"]:
            delta = choice["delta"]
            reasoning, text = delta.get("reasoning_content"), delta.get("content")
            if reasoning and self.show_thinking:
                events += self._block("thinking")
                events.append(_delta(self.index, {"type": "thinking_delta", "thinking": reasoning}))
            if text:
                events += self._block("text")
                events.append(_delta(self.index, {"type": "text_delta", "text": text}))
            if choice.get("finish_reason") is not None:
                self.finish = stop_reason_of(choice["finish_reason"], choice.get("matched_stop"), self.stop_sequences)
        return events

    def end(self) -> list[bytes]:
        reason, sequence = self.finish
        return self._close() + [
            _event(
                "message_delta",
                {
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage_block(self.input_tokens, self.output_tokens),
                },
            ),
            _event("message_stop", {}),
        ]


def _delta(index: int, delta: dict[str, Any]) -> bytes:
    return _event("content_block_delta", {"index": index, "delta": delta})


# ---- the handler -------------------------------------------------------------------


class MessagesServing:
    """Serves /v1/messages through ChatServing's request handling."""

    def __init__(self, chat: ChatServing):
        self.chat = chat
        self.tm = chat.tm

    async def handle(self, request: Request, req: AnthropicMessagesRequest) -> Response:
        try:
            chat_req = to_chat_request(req)
            obj, _, in_reasoning = await self.chat._prepare(chat_req)
            streams = await open_streams(self.tm, obj)
        except OpenAIError as e:
            raise _renamed(e) from e
        except ValueError as e:
            raise _renamed(from_value_error(e, _PROMPT_FIELD)) from e
        msg_id = f"msg_{uuid.uuid4().hex}"  # Anthropic's form
        model = req.model or self.chat.server_args.served_model_name
        show_thinking = req.thinking is None or req.thinking.type == "enabled"
        chat_conv = ChatStreamConverter(
            msg_id, model, len(streams), 1, False, True, self.tm.tokenizer, in_reasoning=in_reasoning
        )
        conv = MessagesStreamConverter(msg_id, model, len(obj.input_ids), show_thinking, req.stop_sequences)

        def build(outputs: list[dict[str, Any]]) -> Response:
            resp = build_chat_response(msg_id, model, outputs, 1, False, self.tm.tokenizer, in_reasoning=in_reasoning)
            return json_response(from_chat_response(msg_id, resp, show_thinking, req.stop_sequences))

        return await respond(request, streams, bool(req.stream), lambda s: _stream_body(chat_conv, conv, s), build)


async def _stream_body(chat_conv: ChatStreamConverter, conv: MessagesStreamConverter, streams) -> AsyncIterator[bytes]:
    for event in conv.start():
        yield event
    try:
        async for index, out in merge_streams(streams):
            for chunk in chat_conv.on_output(index, out):
                for event in conv.on_chunk(chunk):
                    yield event
    except Exception as e:  # noqa: BLE001 - the status line is already sent
        logger.exception("messages stream failed")
        yield error_event(f"{type(e).__name__}: {e}")
        return
    for chunk in chat_conv.end():
        for event in conv.on_chunk(chunk):
            yield event
    for event in conv.end():
        yield event
