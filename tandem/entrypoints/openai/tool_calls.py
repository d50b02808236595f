"""Chat `tools` and `tool_choice`: what they do to a request, and how the calls found in
an output become OpenAI's `tool_calls`.

- `none` (the default without tools): the tools are not shown to the model; plain text.
- `auto` (the default with tools): the tools go to the chat template (`tools=`, as
  `apply_chat_template` takes them) and the output is parsed by the `--tool-call-parser`
  detector; without that flag the output stays plain text.
- `required` / a named function: generation is constrained by a JSON schema
  (`sampling_params.json_schema`): an array of `{"name", "parameters"}` calls, or the named
  function's arguments object; the output is parsed as such.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from jsonschema import Draft202012Validator, SchemaError

from tandem.entrypoints.native_protocol import GenerateReqInput
from tandem.entrypoints.openai.errors import OpenAIError
from tandem.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DeltaToolCall,
    FunctionResponse,
    ToolCall,
    ToolChoice,
)
from tandem.function_call.base_format_detector import BaseFormatDetector
from tandem.function_call.constraint import get_json_schema_constraint
from tandem.function_call.core_types import ToolCallItem
from tandem.function_call.function_call_parser import ToolCallParserEnum
from tandem.function_call.json_array_parser import JsonArrayParser, NamedFunctionParser
from tandem.sampling.sampling_params import GRAMMAR_FIELDS


@dataclass(frozen=True)
class ToolCallSetup:
    """What one chat request's tools ask of the route."""

    # The `tools` argument of the chat template (None: no tools shown).
    template_tools: list[dict] | None = None
    # `sampling_params.json_schema` (a JSON string), for required / a named function.
    json_schema: str | None = None
    # Makes the detector of one choice's output; None: the output is plain text.
    make_detector: Callable[[], BaseFormatDetector] | None = None
    # Special tokens stay in the text, where a format's markers may be (`<|python_tag|>`).
    keep_special_tokens: bool = False

    def apply(self, obj: GenerateReqInput) -> None:
        """Add the constraint and the detokenization this setup needs to `obj`."""
        params = obj.sampling_params
        if self.json_schema is not None:
            other = next((name for name in GRAMMAR_FIELDS if params.get(name)), None)
            if other is not None:
                raise OpenAIError(
                    f"tool_choice: required or a named function cannot be combined with another constraint ({other})",
                    400,
                    param="tool_choice",
                )
            params["json_schema"] = self.json_schema
        if self.keep_special_tokens:
            params.setdefault("skip_special_tokens", False)


def resolve_tools(req: ChatCompletionRequest, tool_call_parser: str | None) -> ToolCallSetup:
    """The setup for `req`'s tools; OpenAIError (400 naming the field) for a bad choice."""
    tools = req.tools or []
    choice = req.tool_choice or ("auto" if tools else "none")
    if not tools:
        if choice != "none" and choice != "auto":
            raise OpenAIError(
                "tool_choice: requires tools (a required or named tool choice needs at least one tool)",
                400,
                param="tool_choice",
            )
        return ToolCallSetup()
    _check_parameters(req)
    if choice == "none":
        return ToolCallSetup()
    functions = [tool.function.model_dump(exclude_none=True) for tool in tools]
    names = [f["name"] for f in functions]
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    if isinstance(choice, ToolChoice):
        name = choice.function.name
        if name not in names:
            raise OpenAIError(f"tool_choice: Tool '{name}' not found in tools list.", 400, param="tool_choice")
        return ToolCallSetup(
            template_tools=[t for t in template_tools if t["function"]["name"] == name],
            json_schema=json.dumps(get_json_schema_constraint(functions, name)),
            make_detector=partial(NamedFunctionParser, name),
        )
    if choice == "required":
        try:
            schema = get_json_schema_constraint(functions, None, req.parallel_tool_calls is not False)
        except ValueError as e:
            raise OpenAIError(str(e), 400, param="tools") from e
        return ToolCallSetup(
            template_tools=template_tools, json_schema=json.dumps(schema), make_detector=partial(JsonArrayParser, names)
        )
    detector = ToolCallParserEnum.get(tool_call_parser) if tool_call_parser else None
    if detector is None:
        return ToolCallSetup(template_tools=template_tools)
    return ToolCallSetup(
        template_tools=template_tools, make_detector=partial(detector, names), keep_special_tokens=True
    )


def _check_parameters(req: ChatCompletionRequest) -> None:
    for i, tool in enumerate(req.tools or []):
        if tool.function.parameters is None:
            continue
        try:
            Draft202012Validator.check_schema(tool.function.parameters)
        except SchemaError as e:
            field = f"tools.{i}.function.parameters"
            raise OpenAIError(f"{field}: invalid 'parameters' schema: {e.message}", 400, param=field) from e


def new_tool_call_id() -> str:
    """OpenAI's form of a call id, as SGLang makes it."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_of(item: ToolCallItem) -> ToolCall:
    return ToolCall(id=new_tool_call_id(), function=FunctionResponse(name=item.name, arguments=item.parameters))


def delta_tool_call_of(item: ToolCallItem) -> DeltaToolCall:
    return DeltaToolCall(
        index=item.tool_index,
        id=new_tool_call_id(),
        function=FunctionResponse(name=item.name, arguments=item.parameters),
    )
