"""Pydantic v2 models of the OpenAI-compatible API: requests and responses.

Request models accept OpenAI's fields (penalties included) plus SGLang's sampling extras
(`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`, `no_stop_trim`,
`repetition_penalty`, `min_tokens`), and chat `tools` / `tool_choice`. Fields of features
Tandem does not implement yet (`logit_bias`, `functions`, ...) are accepted only with their
neutral value;
`unsupported_fields()` names the others.
Unknown fields are ignored, as most OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_serializer, model_validator

from tandem.sampling.sampling_params import INT64_MAX, INT64_MIN, MAX_N

TokenId = Annotated[StrictInt, Field(ge=0)]
NonNegInt = Annotated[StrictInt, Field(ge=0)]


class StreamOptions(BaseModel):
    include_usage: bool | None = False


class _SamplingFields(BaseModel):
    """Fields shared by chat and completions requests.

    Numbers are range-checked here where OpenAI documents a range, and again (with the
    engine's limits: 64-bit integers, the vocabulary) by the sampling parameters. NaN and
    infinities are refused.
    """

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None  # as in SGLang: optional, the served model
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: StrictInt | None = Field(default=None, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # SGLang extras.
    top_k: StrictInt | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)  # SGLang/vLLM extra
    min_tokens: StrictInt | None = None  # vLLM/SGLang extra: SGLang's min_new_tokens
    # SGLang extras: the output must match this regex / JSON schema (a JSON string) / EBNF.
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    stop_regex: str | list[str] | None = None  # SGLang's extension: stop on a regex match
    # SGLang extras (extra_body): a serialized custom logit processor
    # (CustomLogitProcessor.to_str(); --enable-custom-logit-processor) and its params.
    custom_logit_processor: str | None = None
    custom_params: dict[str, Any] | None = None
    # SGLang extra: the LoRA adapter's name (also `model: "<base>:<adapter>"`; this wins).
    lora_path: str | None = None
    # Not supported yet: only the neutral value is accepted.
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored, as OpenAI only logs it
    priority: StrictInt | None = None  # SGLang's extension: --enable-priority-scheduling

    def unsupported_fields(self) -> list[str]:
        """Names of fields set to a value Tandem cannot honour yet, in declaration order."""
        return [
            name
            for name, neutral in self._neutral_values().items()
            if getattr(self, name) is not None and not neutral(getattr(self, name))
        ]

    def _neutral_values(self) -> dict[str, Any]:
        return {"logit_bias": lambda v: not v}

    def grammar_fields(self) -> dict[str, tuple[str, str]]:
        """Each field that constrains the output, as {field: (sampling param, value)}."""
        return {name: (name, getattr(self, name)) for name in ("regex", "json_schema", "ebnf") if getattr(self, name)}


class ChatContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


# Message roles SGLang accepts (case-insensitive); any other role is a 400.
CHAT_ROLES = ("system", "user", "assistant", "tool", "function", "developer", "latest_reminder", "root")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ChatContentPart] | None = None
    name: str | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _known_role(cls, role: Any) -> str:
        if not isinstance(role, str):
            raise ValueError("'role' must be a string")
        if role.lower() not in CHAT_ROLES:
            raise ValueError(f"'role' must be one of {', '.join(repr(r) for r in CHAT_ROLES)} (case-insensitive).")
        return role.lower()


class FunctionDefinition(BaseModel):
    """A tool's function: `parameters` is a JSON schema of its arguments object."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    name: str


class ToolChoice(BaseModel):
    """`tool_choice` naming one function: `{"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class JsonSchemaResponseFormat(BaseModel):
    """`response_format.json_schema`: the schema the answer must match (OpenAI's shape)."""

    model_config = ConfigDict(populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = False


class ResponseFormat(BaseModel):
    """`response_format`: plain text, any JSON object, JSON matching a schema, or SGLang's
    structural tag (`{"type": "structural_tag", "format": {...}}`, xgrammar's, or the legacy
    `structures` and `triggers`; the grammar backend checks the rest:
    tandem/constrained/structural_tag.py)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaResponseFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    at_least_one: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is 'json_schema'")
        if self.type == "structural_tag" and self.format is None and (self.structures is None or self.triggers is None):
            raise ValueError(
                "response_format: a structural_tag needs 'format', or the legacy 'structures' and 'triggers'"
            )
        return self

    def grammar(self) -> tuple[str, str] | None:
        """(sampling param, value) of the constraint this format asks for (None for text)."""
        if self.type == "json_object":
            return "json_schema", '{"type": "object"}'
        if self.type == "json_schema":
            return "json_schema", json.dumps(self.json_schema.schema_)
        if self.type == "structural_tag":
            return "structural_tag", self.model_dump_json(exclude={"json_schema"}, exclude_none=True)
        return None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    # Default: "auto" with tools, "none" without (OpenAI's).
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    # Passed to the chat template as keyword arguments (`enable_thinking`, ...), as SGLang does.
    chat_template_kwargs: dict[str, Any] | None = None
    # SGLang's: with `--reasoning-parser`, the think block goes to `reasoning_content`
    # (false: it stays in `content`); streamed as it comes or in one piece at its end.
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    def grammar_fields(self) -> dict[str, tuple[str, str]]:
        fields = super().grammar_fields()
        grammar = self.response_format.grammar() if self.response_format is not None else None
        if grammar is not None:
            fields["response_format"] = grammar
        return fields

    def _neutral_values(self) -> dict[str, Any]:
        return {
            **super()._neutral_values(),
            "functions": lambda v: not v,
            "function_call": lambda v: v == "none",
        }


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: StrictInt | None = Field(default=None, ge=0)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)
    echo: bool | None = False
    best_of: StrictInt | None = None
    suffix: str | None = None

    def _neutral_values(self) -> dict[str, Any]:
        return {**super()._neutral_values(), "best_of": lambda v: v == 1, "suffix": lambda v: v == ""}


class TokenizeRequest(BaseModel):
    """SGLang's /tokenize body: `prompt`, a string or a list of strings (`text` is Tandem's
    older name for it), or chat `messages` (with `tools`), tokenized as the chat route
    tokenizes them."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | list[str] | None = None
    text: str | list[str] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = None
    add_special_tokens: bool = True

    def to_chat_request(self) -> ChatCompletionRequest:
        """The chat request whose prompt these `messages` are."""
        return ChatCompletionRequest(model=self.model or "default", messages=self.messages, tools=self.tools)


class DetokenizeRequest(BaseModel):
    """SGLang's /detokenize body: a list of ids, or a list of such lists."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[TokenId] | list[list[TokenId]]
    skip_special_tokens: bool = True


# ---- responses ---------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class FunctionResponse(BaseModel):
    """A call's function: its name and its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One call in `message.tool_calls`, as OpenAI sends it."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionResponse


class DeltaToolCall(ToolCall):
    """One call in a streamed `delta.tool_calls`: `index` is its place in the message.
    Tandem sends each call whole, in one delta."""

    index: int


class ChatMessageOut(BaseModel):
    """The answer's message; `reasoning_content` always (null without a think block, or
    without `--reasoning-parser`), as SGLang sends it; `tool_calls` only when the model
    called tools (then `content` is null unless there was text besides the calls)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = ""
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer
    def _drop_none(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content, "reasoning_content": self.reasoning_content}
        if self.tool_calls is not None:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return out


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    # SGLang's extra: the stop string or token id that ended the choice (None otherwise).
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    """A streamed message delta, as SGLang sends it: `role` and `content` only when set,
    `reasoning_content` always (null unless this delta carries reasoning), so that clients reading
    `delta.reasoning_content` find it; `tool_calls` only when set."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer
    def _drop_none(self) -> dict[str, Any]:
        out = {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}
        out["reasoning_content"] = self.reasoning_content
        if self.tool_calls is not None:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return out


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    # SGLang's extra: the stop string or token id that ended the choice (None otherwise).
    matched_stop: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # SGLang's extra: the stop string or token id that ended the choice (None otherwise).
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tandem"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (SGLang's field)
    max_model_len: int | None = None
    gguf: dict | None = None  # a GGUF model's file(s) and tensor types


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- /v1/score (SGLang's) -----------------------------------------------------------


class ScoringRequest(BaseModel):
    """SGLang's /v1/score body: the probability of each label token right after
    query + item (item + query with `item_first`), for every item. Text or token ids."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    query: str | list[StrictInt] | None = None
    items: str | list[str] | list[list[StrictInt]] | None = None
    label_token_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    apply_softmax: bool = False
    temperature: float = 1.0
    return_token_logprobs: bool = False
    item_first: bool = False
    model: str = "default"
    # Not supported here (SGLang's embedding overrides, setwise readout, hidden states).
    embed_override_token_id: int | None = None
    query_embed_overrides: list[Any] | None = None
    item_embed_overrides: list[Any] | None = None
    score_extraction_token: str | None = None
    return_pooled_hidden_states: bool = False

    def unsupported_fields(self) -> list[str]:
        names = ("embed_override_token_id", "query_embed_overrides", "item_embed_overrides", "score_extraction_token")
        return [name for name in names if getattr(self, name) is not None]


class ScoringResponse(BaseModel):
    scores: list[list[float]]
    pooled_hidden_states: None = None
    token_logprobs: list[list[float]] | None = None
    model: str
    usage: UsageInfo | None = None
    object: Literal["scoring"] = "scoring"


# ---- /v1/responses (OpenAI's Responses API, plain text) ------------------------------


class ResponsesRequest(BaseModel):
    """OpenAI's Responses API body, the plain-text part: `input` (a string, or a list of
    messages with text content), `instructions`, `max_output_tokens`, sampling, `stream`.
    Tools, background mode, stored responses and other features are accepted only with
    their neutral value; `unsupported_fields()` names the others."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = False
    store: bool | None = True  # accepted; responses are not kept (no GET /v1/responses/{id})
    metadata: dict[str, Any] | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = True
    service_tier: str | None = None  # accepted and ignored
    request_id: str = Field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")  # SGLang's extra
    # SGLang's sampling extras.
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    top_k: StrictInt | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    # Not supported: only the neutral value is accepted.
    background: bool | None = False
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = "auto"
    max_tool_calls: int | None = None
    include: list[Any] | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    top_logprobs: int | None = 0
    truncation: str | None = "disabled"
    conversation: Any = None
    prompt: Any = None

    def unsupported_fields(self) -> list[str]:
        """Names of fields set to a value Tandem cannot honour, in declaration order."""
        neutral = {
            "background": lambda v: not v,
            "previous_response_id": lambda v: v is None,
            "tools": lambda v: not v,
            "tool_choice": lambda v: v in (None, "auto", "none"),
            "max_tool_calls": lambda v: v is None,
            "include": lambda v: not v,
            "reasoning": lambda v: not v or v.get("effort") in (None, "none"),
            "text": lambda v: not v or (v.get("format") or {}).get("type", "text") == "text",
            "top_logprobs": lambda v: not v,
            "truncation": lambda v: v in (None, "disabled"),
            "conversation": lambda v: v is None,
            "prompt": lambda v: v is None,
        }
        return [name for name, ok in neutral.items() if not ok(getattr(self, name))]


# ---- Anthropic's Messages API (POST /v1/messages) ------------------------------------


class AnthropicContentBlock(BaseModel):
    """A content block of a message or of `system`; only text blocks (and, in an assistant
    turn of the history, thinking blocks, which are left out of the prompt) are served."""

    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[AnthropicContentBlock]


class AnthropicThinking(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["enabled", "disabled"]
    budget_tokens: StrictInt | None = Field(default=None, ge=1)  # accepted; no budget is enforced


class AnthropicMessagesRequest(BaseModel):
    """Anthropic's Messages body: `max_tokens` (required), `messages` (user/assistant, text),
    `system`, sampling, `stop_sequences`, `stream`, `thinking`. `model` is optional, as on
    the OpenAI routes. Tools are not served yet: `tools` is accepted only empty."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: StrictInt = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicContentBlock] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    thinking: AnthropicThinking | None = None
    metadata: dict[str, Any] | None = None  # accepted and ignored
    # Not supported yet: only the neutral value is accepted.
    tools: list[Any] | None = None
    tool_choice: Any = None

    def unsupported_fields(self) -> list[str]:
        neutral = {
            "tools": lambda v: not v,
            "tool_choice": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "none"),
        }
        return [name for name, ok in neutral.items() if not ok(getattr(self, name))]
