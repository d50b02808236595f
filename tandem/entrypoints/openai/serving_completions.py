"""POST /v1/completions: the legacy text-completion API over the tokenizer manager.

`prompt` may be a string, a list of strings, a list of token ids or a list of such lists;
each prompt gets `n` choices, indexed prompt-major (prompt p, sample s -> p*n + s).
`echo` prepends the prompt text; with `logprobs` it also prepends the prompt tokens'
logprobs (the first token has none), taken from the engine's input logprobs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response
from starlette.requests import Request

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
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from tandem.entrypoints.responses import json_response
from tandem.entrypoints.streams import merge_streams
from tandem.tokenizer.text_encoder import TextEncoder

logger = logging.getLogger(__name__)
DEFAULT_MAX_TOKENS = 16
_PROMPT_FIELD = {"text/input_ids": "prompt", "input_ids": "prompt", "text": "prompt"}


@dataclass
class Prompt:
    """One prompt: its token ids and the text `echo` prepends."""

    input_ids: list[int]
    text: str


def split_prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a request's `prompt` field, each a string or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError("prompt: must not be empty", 400, param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    for p in prompt:
        if not p:
            raise OpenAIError("prompt: a prompt must not be empty", 400, param="prompt")
    return list(prompt)


async def tokenize_prompts(
    encoder: TextEncoder | None,
    prompts: list[str | list[int]],
    vocab_size: int | None = None,
    max_tokens: int | None = None,
) -> list[Prompt]:
    """Tokenize string prompts on the encoder's thread (refusing, by its length, one that
    cannot fit `max_tokens`); ids pass through, checked against the vocabulary, and are
    decoded (without special tokens) for `echo`. No encoder: the server runs without a tokenizer."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            if encoder is None:
                raise OpenAIError(
                    "prompt: this server runs without a tokenizer (--skip-tokenizer-init); send token ids",
                    400,
                    param="prompt",
                )
            try:
                ids = await encoder.encode(p, "prompt", max_tokens=max_tokens)
            except ValueError as e:
                raise from_value_error(e) from e
            if not ids:
                raise OpenAIError("prompt: the prompt tokenizes to no tokens", 400, param="prompt")
            out.append(Prompt(ids, p))
        else:
            bad = [t for t in p if vocab_size is not None and t >= vocab_size]
            if bad:
                raise OpenAIError(
                    f"prompt: token id {bad[0]} is outside the vocabulary (size {vocab_size})", 400, param="prompt"
                )
            # Echoed as SGLang echoes token ids: without special tokens (no BOS).
            text = await encoder.decode(p, skip_special_tokens=True) if encoder is not None else ""
            out.append(Prompt(list(p), text))
    return out


def build_completion_generate_input(
    req: CompletionRequest, prompts: list[Prompt], context_len: int
) -> GenerateReqInput:
    """The native request: one entry per prompt, each with its own token budget."""
    params = []
    for p in prompts:
        max_new = resolve_max_tokens(
            req.max_tokens, len(p.input_ids), context_len, DEFAULT_MAX_TOKENS, "max_tokens", "prompt"
        )
        params.append(sampling_params(req, max_new))
    batch = len(prompts) > 1
    obj = GenerateReqInput(
        input_ids=[p.input_ids for p in prompts] if batch else prompts[0].input_ids,
        sampling_params=params if batch else params[0],
        stream=bool(req.stream),
        priority=req.priority,
        custom_logit_processor=req.custom_logit_processor,
        lora_path=lora_adapter_of(req),
    )
    if req.logprobs is not None:
        obj.return_logprob = True
        obj.top_logprobs_num = req.logprobs
        obj.return_text_in_logprobs = True
        if req.echo:
            obj.logprob_start_len = 0
    return obj


# ---- outputs -> response -----------------------------------------------------------


def completion_logprobs(meta: dict[str, Any], tokenizer, offset: int, with_input: bool) -> CompletionLogprobs:
    """OpenAI's legacy logprobs for one output: (input tokens first when echoed,) output tokens.

    `text_offset` counts characters from `offset`, the length of the text already returned.
    """
    entries, tops = [], []
    if with_input:
        entries += meta.get("input_token_logprobs") or []
        tops += _pad(meta.get("input_top_logprobs"), len(meta.get("input_token_logprobs") or []))
    out_entries = meta.get("output_token_logprobs") or []
    entries += out_entries
    tops += _pad(meta.get("output_top_logprobs"), len(out_entries))
    lp = CompletionLogprobs()
    for entry, top in zip(entries, tops):
        text = token_text(entry, tokenizer)
        lp.tokens.append(text)
        lp.token_logprobs.append(clamp_logprob(entry[0]))
        lp.top_logprobs.append({token_text(t, tokenizer): clamp_logprob(t[0]) for t in top} if top else None)
        lp.text_offset.append(offset)
        offset += len(text)
    return lp


def _pad(tops: list | None, n: int) -> list:
    tops = list(tops or [])
    return tops + [None] * (n - len(tops))


def build_completion_response(
    req_id: str,
    model: str,
    outputs: list[dict[str, Any]],
    prompts: list[Prompt],
    n: int,
    echo: bool,
    with_logprobs: bool,
    tokenizer=None,
    created: int | None = None,
) -> CompletionResponse:
    """The non-streamed response for the B*n final outputs (prompt-major)."""
    choices = []
    for i, out in enumerate(outputs):
        meta = out.get("meta_info") or {}
        prefix = prompts[i // n].text if echo else ""
        logprobs = completion_logprobs(meta, tokenizer, 0, echo) if with_logprobs else None
        choices.append(
            CompletionChoice(
                index=i,
                text=prefix + (out.get("text") or ""),
                logprobs=logprobs,
                finish_reason=finish_reason(meta),
                matched_stop=matched_stop(meta),
            )
        )
    usage = usage_of([o.get("meta_info") or {} for o in outputs], n)
    return CompletionResponse(id=req_id, model=model, choices=choices, usage=usage, created=created or int(time.time()))


class CompletionStreamConverter:
    """Turns incremental outputs into `text_completion` chunks: one per output that has
    text, logprobs or the finish (exactly one chunk per choice carries its finish_reason),
    then (with `include_usage`) a usage chunk without choices."""

    def __init__(
        self,
        req_id: str,
        model: str,
        prompts: list[Prompt],
        n: int,
        echo: bool,
        with_logprobs: bool,
        include_usage: bool,
        tokenizer=None,
        created: int | None = None,
    ):
        self.req_id, self.model, self.prompts, self.n = req_id, model, prompts, n
        self.echo, self.with_logprobs, self.include_usage = echo, with_logprobs, include_usage
        self.tokenizer = tokenizer
        self.created = created or int(time.time())
        num = len(prompts) * n
        self.metas: list[dict[str, Any]] = [{} for _ in range(num)]
        self.started = [False] * num
        self.finished = [False] * num
        self.offsets = [0] * num

    def _chunk(self, choice: CompletionChoice | None, usage=None) -> dict[str, Any]:
        chunk = CompletionResponse(
            id=self.req_id, model=self.model, created=self.created, choices=[choice] if choice else [], usage=usage
        )
        return chunk.model_dump(exclude=None if self.include_usage else {"usage"})

    def on_output(self, index: int, out: dict[str, Any]) -> list[dict[str, Any]]:
        """Chunks for one incremental output of choice `index`."""
        if self.finished[index]:
            return []
        meta = out.get("meta_info") or {}
        self.metas[index] = meta
        first = not self.started[index]
        self.started[index] = True
        text = (self.prompts[index // self.n].text if self.echo and first else "") + (out.get("text") or "")
        logprobs = None
        if self.with_logprobs:
            logprobs = completion_logprobs(meta, self.tokenizer, self.offsets[index], self.echo and first)
        self.offsets[index] += len(text)
        reason = finish_reason(meta)
        self.finished[index] = reason is not None
        if not (text or (logprobs and logprobs.tokens) or reason):
            return []
        # As SGLang: the finish rides on the output's own chunk, with its text and logprobs.
        return [
            self._chunk(
                CompletionChoice(
                    index=index, text=text, logprobs=logprobs, finish_reason=reason, matched_stop=matched_stop(meta)
                )
            )
        ]

    def end(self) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [self._chunk(None, usage=usage_of(self.metas, self.n))]


# ---- the handler -------------------------------------------------------------------


class CompletionServing:
    """Serves /v1/completions over a TokenizerManager."""

    def __init__(self, tm, server_args):
        self.tm, self.server_args = tm, server_args

    async def prepare(self, req: CompletionRequest) -> tuple[GenerateReqInput, list[Prompt]]:
        """Validate and tokenize `req`; raises OpenAIError for client mistakes."""
        reject_unsupported(req)
        prompts = await tokenize_prompts(
            self.tm.text_encoder,
            split_prompts(req.prompt),
            getattr(self.tm, "vocab_size", None),
            self.tm.context_len - 1,
        )
        return build_completion_generate_input(req, prompts, self.tm.context_len), prompts

    async def handle(self, request: Request, req: CompletionRequest) -> Response:
        obj, prompts = await self.prepare(req)
        try:
            streams = await open_streams(self.tm, obj)
        except ValueError as e:
            raise from_value_error(e, _PROMPT_FIELD) from e
        req_id, n = random_id("cmpl"), req.n or 1
        model = req.model or self.server_args.served_model_name  # any name is served, as in SGLang
        with_logprobs = req.logprobs is not None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        conv = CompletionStreamConverter(
            req_id, model, prompts, n, bool(req.echo), with_logprobs, include_usage, self.tm.tokenizer
        )
        return await respond(
            request,
            streams,
            bool(req.stream),
            lambda s: _stream_body(conv, s),
            lambda outputs: json_response(
                build_completion_response(
                    req_id, model, outputs, prompts, n, bool(req.echo), with_logprobs, self.tm.tokenizer
                ).model_dump()
            ),
        )


async def _stream_body(conv: CompletionStreamConverter, streams) -> AsyncIterator[bytes]:
    try:
        async for index, out in merge_streams(streams):
            for chunk in conv.on_output(index, out):
                yield sse(chunk)
    except Exception as e:  # noqa: BLE001 - the status line is already sent
        logger.exception("completion stream failed")
        yield error_event(f"{type(e).__name__}: {e}")
    for chunk in conv.end():
        yield sse(chunk)
    yield SSE_DONE
