"""POST /v1/chat/completions: render the messages with the chat template, tokenize, run
`n` samples through the tokenizer manager, and answer in OpenAI's shape (one JSON
response, or server-sent chunks ending with `data: [DONE]`).

The pure pieces (`render_chat_prompt`, `build_chat_generate_input`,
`build_chat_response`, `ChatStreamConverter`) are unit-tested without a server. Tools:
tool_calls.py decides what a request's `tools` and `tool_choice` do; a choice's output
then goes through its detector (tandem/function_call), whole or piece by piece.
Reasoning (`--reasoning-parser`, tandem/reasoning_parser.py) is split off first: the
think block goes to `reasoning_content`, and only the rest reaches the tool detector.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import Response

from tandem.entrypoints.native_protocol import GenerateReqInput
from tandem.entrypoints.openai.common import (
    SSE_DONE,
    clamp_logprob,
    error_event,
    finish_reason,
    lora_adapter_of,
    matched_stop,
    open_streams,
    random_id,
    reject_unsupported,
    resolve_max_tokens,
    respond,
    sampling_params,
    sse,
    token_text,
    usage_of,
)
from tandem.entrypoints.openai.errors import OpenAIError, from_value_error
from tandem.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatMessageOut,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
)
from tandem.entrypoints.openai.tool_calls import ToolCallSetup, delta_tool_call_of, resolve_tools, tool_call_of
from tandem.entrypoints.responses import json_response
from tandem.entrypoints.streams import merge_streams
from tandem.function_call.base_format_detector import BaseFormatDetector
from tandem.reasoning_parser import ReasoningResult, ReasoningStream, parse_reasoning, starts_in_reasoning
from tandem.sampling.sampling_params import GRAMMAR_FIELDS
from tandem.tokenizer.text_encoder import TextEncoder

logger = logging.getLogger(__name__)
_PROMPT_FIELD = {"text/input_ids": "messages", "input_ids": "messages", "text": "messages"}


# ---- request -> prompt -> GenerateReqInput -----------------------------------------


def message_to_dict(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template expects it: content flattened to one string."""
    content = message.content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise OpenAIError(
                    f"messages.{index}.content.{j}: only text content parts are supported, got type {part.type!r}",
                    400,
                    param=f"messages.{index}.content",
                )
            parts.append(part.text)
        content = "".join(parts)
    out = message.model_dump(exclude_none=True)
    out["content"] = content or ""
    _arguments_as_objects(out)
    return out


def _arguments_as_objects(message: dict[str, Any]) -> None:
    """An assistant message's earlier calls carry their arguments as JSON strings (OpenAI's
    form); chat templates expect objects (transformers' convention), as SGLang converts."""
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass  # not JSON: the template gets the string


def render_chat_prompt(
    tokenizer,
    messages: list[ChatMessage],
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text: the messages through the model's (or `--chat-template`'s) template,
    which gets `tools` as `apply_chat_template(tools=...)` passes them, and the request's
    `chat_template_kwargs` as further variables (`enable_thinking`)."""
    if tokenizer is None:
        raise OpenAIError(
            "messages: this server runs without a tokenizer (--skip-tokenizer-init); "
            "use /v1/completions with token ids",
            400,
            param="messages",
        )
    dicts = [message_to_dict(i, m) for i, m in enumerate(messages)]
    kwargs: dict[str, Any] = {}
    for name, value in (template_kwargs or {}).items():
        if name in ("conversation", "tokenize", "add_generation_prompt", "chat_template", "tools"):
            raise OpenAIError(
                f"chat_template_kwargs.{name}: set by the server, not by the request", 400, param="chat_template_kwargs"
            )
        kwargs[name] = value
    if chat_template:
        kwargs["chat_template"] = chat_template
    if tools:
        kwargs["tools"] = tools
    try:
        return tokenizer.apply_chat_template(dicts, tokenize=False, add_generation_prompt=True, **kwargs)
    except jinja2.TemplateError as e:
        raise OpenAIError(f"messages: the chat template rejected the messages: {e}", 400, param="messages") from e
    except ValueError as e:  # no chat template in the tokenizer and none given
        raise OpenAIError(
            f"messages: cannot render the chat template ({e}); start the server with --chat-template",
            400,
            param="messages",
        ) from e


async def encode_chat_prompt(encoder: TextEncoder, text: str, max_tokens: int | None = None) -> list[int]:
    """Token ids of a rendered prompt, as `apply_chat_template(tokenize=True)` (and SGLang)
    makes them: the template writes every special token it wants (BOS included), so the
    tokenizer adds none. Tokenized on the encoder's thread; refused, by its length, when
    it cannot fit `max_tokens`."""
    try:
        return await encoder.encode(text, "messages", add_special_tokens=False, max_tokens=max_tokens)
    except ValueError as e:
        raise from_value_error(e) from e


def check_logprob_args(req: ChatCompletionRequest) -> None:
    if req.top_logprobs and not req.logprobs:
        raise OpenAIError("top_logprobs: requires logprobs=true", 400, param="top_logprobs")


def build_chat_generate_input(
    req: ChatCompletionRequest, input_ids: list[int], max_new_tokens: int
) -> GenerateReqInput:
    """The native request for a chat request whose prompt is `input_ids`."""
    obj = GenerateReqInput(
        input_ids=list(input_ids),
        sampling_params=sampling_params(req, max_new_tokens),
        stream=bool(req.stream),
        priority=req.priority,
        custom_logit_processor=req.custom_logit_processor,
        lora_path=lora_adapter_of(req),
    )
    if req.logprobs:
        obj.return_logprob = True
        obj.top_logprobs_num = req.top_logprobs or 0
        obj.return_text_in_logprobs = True
    return obj


# ---- outputs -> response -----------------------------------------------------------


def _top_entry(entry, tokenizer) -> TopLogprob:
    text = token_text(entry, tokenizer)
    return TopLogprob(token=text, logprob=clamp_logprob(entry[0]), bytes=list(text.encode("utf-8")))


def chat_logprobs(meta: dict[str, Any], tokenizer) -> ChatLogprobs:
    """OpenAI's `logprobs.content` from meta_info's output_token/top_logprobs lists."""
    entries = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    content = []
    for i, entry in enumerate(entries):
        top = tops[i] if i < len(tops) and tops[i] else []
        first = _top_entry(entry, tokenizer)
        content.append(ChatTokenLogprob(**first.model_dump(), top_logprobs=[_top_entry(t, tokenizer) for t in top]))
    return ChatLogprobs(content=content)


def tool_calls_finish(meta: dict[str, Any], called: bool) -> tuple[str | None, int | str | None]:
    """finish_reason and matched_stop of a choice: "tool_calls" (and no matched stop) for a
    choice that stopped after calling tools, as SGLang reports it."""
    reason = finish_reason(meta)
    if called and reason == "stop":
        return "tool_calls", None
    return reason, matched_stop(meta)


def _message(text: str, detector: BaseFormatDetector | None, in_reasoning: bool | None = None) -> ChatMessageOut:
    """`in_reasoning`: None leaves the think block in the content; else the output starts
    inside the block (tandem/reasoning_parser.py)."""
    reasoning = None
    if in_reasoning is not None:
        split = parse_reasoning(text, in_reasoning)
        text, reasoning = split.content, split.reasoning or None
    if detector is None:
        return ChatMessageOut(content=text, reasoning_content=reasoning)
    parsed = detector.detect_and_parse(text)
    if not parsed.calls:
        return ChatMessageOut(content=parsed.normal_text, reasoning_content=reasoning)
    return ChatMessageOut(
        content=parsed.normal_text or None,
        reasoning_content=reasoning,
        tool_calls=[tool_call_of(c) for c in parsed.calls],
    )


def build_chat_response(
    req_id: str,
    model: str,
    outputs: list[dict[str, Any]],
    n: int,
    with_logprobs: bool,
    tokenizer=None,
    created: int | None = None,
    make_detector: Callable[[], BaseFormatDetector] | None = None,
    in_reasoning: bool | None = None,
) -> ChatCompletionResponse:
    """The non-streamed response for the `n` final outputs of one prompt; with
    `make_detector`, each output's tool calls become `message.tool_calls`; with
    `in_reasoning` (not None), its think block becomes `message.reasoning_content`."""
    choices = []
    for i, out in enumerate(outputs):
        meta = out.get("meta_info") or {}
        message = _message(out.get("text") or "", make_detector() if make_detector else None, in_reasoning)
        reason, matched = tool_calls_finish(meta, bool(message.tool_calls))
        choices.append(
            ChatChoice(
                index=i,
                message=message,
                logprobs=chat_logprobs(meta, tokenizer) if with_logprobs else None,
                finish_reason=reason,
                matched_stop=matched,
            )
        )
    usage = usage_of([o.get("meta_info") or {} for o in outputs], n)
    return ChatCompletionResponse(
        id=req_id, model=model, choices=choices, usage=usage, created=created or int(time.time())
    )


class ChatStreamConverter:
    """Turns the incremental chunks of `num_choices` streams into OpenAI chunk dicts.

    Per choice: a role chunk first, content chunks, exactly one chunk with a
    finish_reason; then, with `include_usage`, a usage chunk with no choices. With
    `make_detector`, each choice's text goes through its own detector: settled text goes
    out as content, each call as one `tool_calls` delta once it is whole. With
    `in_reasoning` (not None) the think block is split off first and goes out as
    `reasoning_content` deltas (in one piece at the block's end unless `stream_reasoning`).
    """

    def __init__(
        self,
        req_id: str,
        model: str,
        num_choices: int,
        n: int,
        with_logprobs: bool,
        include_usage: bool,
        tokenizer=None,
        created: int | None = None,
        make_detector: Callable[[], BaseFormatDetector] | None = None,
        in_reasoning: bool | None = None,
        stream_reasoning: bool = True,
    ):
        self.req_id, self.model, self.n = req_id, model, n
        self.num_choices = num_choices
        self.with_logprobs, self.include_usage, self.tokenizer = with_logprobs, include_usage, tokenizer
        self.created = created or int(time.time())
        self.metas: list[dict[str, Any]] = [{} for _ in range(num_choices)]
        self.finished = [False] * num_choices
        self.detectors = [make_detector() for _ in range(num_choices)] if make_detector else None
        self.called = [False] * num_choices
        self.reasoners = (
            [ReasoningStream(in_reasoning, stream_reasoning) for _ in range(num_choices)]
            if in_reasoning is not None
            else None
        )

    def _chunk(self, choice: ChatStreamChoice | None, usage=None) -> dict[str, Any]:
        chunk = ChatCompletionChunk(
            id=self.req_id, created=self.created, model=self.model, choices=[choice] if choice else [], usage=usage
        )
        return chunk.model_dump(exclude=None if self.include_usage else {"usage"})

    def start(self) -> list[dict[str, Any]]:
        """The first chunk of every choice: the assistant role with empty content."""
        return [
            self._chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
            for i in range(self.num_choices)
        ]

    def on_output(self, index: int, out: dict[str, Any]) -> list[dict[str, Any]]:
        """Chunks for one incremental output of choice `index`."""
        if self.finished[index]:
            return []
        meta = out.get("meta_info") or {}
        self.metas[index] = meta
        chunks = []
        text = out.get("text") or ""
        logprobs = chat_logprobs(meta, self.tokenizer) if self.with_logprobs else None
        done = finish_reason(meta) is not None
        calls = []
        if self.reasoners is not None:
            split: ReasoningResult = self.reasoners[index].feed(text)
            if done:
                split = split.merged(self.reasoners[index].finish())
            text = split.content
            if split.reasoning:
                chunks.append(
                    self._chunk(
                        ChatStreamChoice(
                            index=index, delta=DeltaMessage(reasoning_content=split.reasoning), logprobs=logprobs
                        )
                    )
                )
                logprobs = None  # sent with the reasoning
        if self.detectors is not None:
            parsed = self.detectors[index].parse_streaming_increment(text)
            if done:
                parsed = parsed.merged(self.detectors[index].finish())
            text, calls = parsed.normal_text, parsed.calls
        if text or (logprobs and logprobs.content):
            chunks.append(
                self._chunk(ChatStreamChoice(index=index, delta=DeltaMessage(content=text), logprobs=logprobs))
            )
        for call in calls:
            self.called[index] = True
            chunks.append(
                self._chunk(ChatStreamChoice(index=index, delta=DeltaMessage(tool_calls=[delta_tool_call_of(call)])))
            )
        if done:
            self.finished[index] = True
            reason, matched = tool_calls_finish(meta, self.called[index])
            chunks.append(
                self._chunk(
                    ChatStreamChoice(index=index, delta=DeltaMessage(), finish_reason=reason, matched_stop=matched)
                )
            )
        return chunks

    def end(self) -> list[dict[str, Any]]:
        """The usage chunk, when asked for."""
        if not self.include_usage:
            return []
        return [self._chunk(None, usage=usage_of(self.metas, self.n))]


# ---- the handler -------------------------------------------------------------------


class ChatServing:
    """Serves /v1/chat/completions over a TokenizerManager."""

    def __init__(self, tm, server_args, chat_template: str | None = None):
        self.tm, self.server_args, self.chat_template = tm, server_args, chat_template

    async def prompt_ids(
        self, req: ChatCompletionRequest, max_tokens: int | None = None
    ) -> tuple[list[int], ToolCallSetup]:
        """The prompt's ids (the messages and tools through the chat template, tokenized;
        /tokenize's `messages` too) and the request's tool setup; refused when longer
        than `max_tokens`."""
        ids, tools, _ = await self._prompt(req, max_tokens)
        return ids, tools

    async def _prompt(
        self, req: ChatCompletionRequest, max_tokens: int | None = None
    ) -> tuple[list[int], ToolCallSetup, str]:
        tools = resolve_tools(req, self.server_args.tool_call_parser)
        text = render_chat_prompt(
            self.tm.tokenizer, req.messages, self.chat_template, tools.template_tools, req.chat_template_kwargs
        )
        return await encode_chat_prompt(self.tm.text_encoder, text, max_tokens), tools, text

    def in_reasoning(self, req: ChatCompletionRequest, obj: GenerateReqInput, prompt: str) -> bool | None:
        """None: the output's think block stays in the content (no `--reasoning-parser`, or
        `separate_reasoning` false); else whether the output starts inside the block. An
        output constrained by a grammar from its first token (`regex`, `response_format`,
        a required tool call, ...) never starts inside one: the grammar decides what it is."""
        parser = self.server_args.reasoning_parser
        if parser is None or not req.separate_reasoning:
            return None
        params = obj.sampling_params
        if any(params.get(name) for name in GRAMMAR_FIELDS):
            return False
        return starts_in_reasoning(parser, prompt)

    async def prepare(self, req: ChatCompletionRequest) -> tuple[GenerateReqInput, ToolCallSetup]:
        obj, tools, _ = await self._prepare(req)
        return obj, tools

    async def _prepare(self, req: ChatCompletionRequest) -> tuple[GenerateReqInput, ToolCallSetup, bool | None]:
        """Validate and tokenize `req`; raises OpenAIError for client mistakes."""
        reject_unsupported(req)
        check_logprob_args(req)
        input_ids, tools, prompt = await self._prompt(req, self.tm.context_len - 1)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_new = resolve_max_tokens(requested, len(input_ids), self.tm.context_len, None, param, "messages")
        obj = build_chat_generate_input(req, input_ids, max_new)
        tools.apply(obj)
        return obj, tools, self.in_reasoning(req, obj, prompt)

    async def handle(self, request: Request, req: ChatCompletionRequest) -> Response:
        obj, tools, in_reasoning = await self._prepare(req)
        try:
            streams = await open_streams(self.tm, obj)
        except ValueError as e:
            # The tool constraint's schema is the request's `tools`.
            raise from_value_error(
                e, {**_PROMPT_FIELD, "json_schema": "tools"} if tools.json_schema else _PROMPT_FIELD
            ) from e
        req_id, n = random_id("chatcmpl"), req.n or 1
        model = req.model or self.server_args.served_model_name  # any name is served, as in SGLang
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        conv = ChatStreamConverter(
            req_id,
            model,
            len(streams),
            n,
            bool(req.logprobs),
            include_usage,
            self.tm.tokenizer,
            make_detector=tools.make_detector,
            in_reasoning=in_reasoning,
            stream_reasoning=req.stream_reasoning,
        )
        return await respond(
            request,
            streams,
            bool(req.stream),
            lambda s: _stream_body(conv, s),
            lambda outputs: json_response(
                build_chat_response(
                    req_id,
                    model,
                    outputs,
                    n,
                    bool(req.logprobs),
                    self.tm.tokenizer,
                    make_detector=tools.make_detector,
                    in_reasoning=in_reasoning,
                ).model_dump()
            ),
        )


async def _stream_body(conv: ChatStreamConverter, streams) -> AsyncIterator[bytes]:
    for chunk in conv.start():
        yield sse(chunk)
    try:
        async for index, out in merge_streams(streams):
            for chunk in conv.on_output(index, out):
                yield sse(chunk)
    except Exception as e:  # noqa: BLE001 - the status line is already sent
        logger.exception("chat stream failed")
        yield error_event(f"{type(e).__name__}: {e}")
    for chunk in conv.end():
        yield sse(chunk)
    yield SSE_DONE
