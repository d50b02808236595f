"""Tool-call detectors on recorded model outputs (tests/fixtures/tool_calls): each output
parsed whole and streamed in pieces of every size gives the same content and calls; the
constraint schema of `tool_choice` required / named, and the JSON its output takes."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from tandem.function_call.constraint import get_json_schema_constraint
from tandem.function_call.core_types import StreamingParseResult
from tandem.function_call.function_call_parser import ToolCallParserEnum
from tandem.function_call.json_array_parser import JsonArrayParser, NamedFunctionParser
from tandem.function_call.llama32_detector import Llama32Detector
from tandem.function_call.mistral_detector import MistralDetector
from tandem.function_call.pythonic_detector import Lfm2Detector, PythonicDetector
from tandem.function_call.qwen25_detector import Qwen25Detector

FIXTURES = Path(__file__).parent.parent / "fixtures" / "tool_calls"
TOOL_NAMES = ("get_current_weather", "get_time", "translate")
CASES = [
    (family, case)
    for family in ("llama3", "qwen25", "pythonic", "lfm2", "mistral")
    for case in json.loads((FIXTURES / f"{family}.json").read_text())
]


def _ids(param):
    return param[1]["id"] if isinstance(param, tuple) else None


def _calls(result: StreamingParseResult) -> list[dict]:
    assert [c.tool_index for c in result.calls] == list(range(len(result.calls)))
    return [{"name": c.name, "arguments": json.loads(c.parameters)} for c in result.calls]


def _streamed(detector, text: str, size: int) -> tuple[list[StreamingParseResult], StreamingParseResult]:
    parts = [detector.parse_streaming_increment(text[i : i + size]) for i in range(0, len(text), size)]
    parts.append(detector.finish())
    whole = StreamingParseResult()
    for part in parts:
        whole = whole.merged(part)
    return parts, whole


def test_sglang_parser_names():
    assert ToolCallParserEnum["llama3"] is Llama32Detector
    assert ToolCallParserEnum["qwen25"] is ToolCallParserEnum["qwen"] is Qwen25Detector
    assert ToolCallParserEnum["pythonic"] is PythonicDetector and ToolCallParserEnum["lfm2"] is Lfm2Detector
    assert ToolCallParserEnum["mistral"] is MistralDetector


@pytest.mark.parametrize("family,case", CASES, ids=[f"{f}-{c['id']}" for f, c in CASES])
def test_recorded_output_whole(family, case):
    result = ToolCallParserEnum[family](TOOL_NAMES).detect_and_parse(case["output"])
    assert result.normal_text == case["content"]
    assert _calls(result) == case["calls"]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("family,case", CASES, ids=[f"{f}-{c['id']}" for f, c in CASES])
def test_recorded_output_streamed_in_pieces(family, case, size):
    _, whole = _streamed(ToolCallParserEnum[family](TOOL_NAMES), case["output"], size)
    assert whole.normal_text == case["content"]
    assert _calls(whole) == case["calls"]


@pytest.mark.parametrize("family,marker", [("qwen25", "<tool_call>"), ("llama3", "<|python_tag|>")])
def test_text_before_a_call_streams_before_the_call_is_whole(family, marker):
    """Content goes out as it settles (never a partial marker); the call goes out once whole."""
    text = f"Let me check that.\n{marker}" + (
        '\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
        if family == "qwen25"
        else '{"name": "get_time", "parameters": {"timezone": "UTC"}}'
    )
    parts, whole = _streamed(ToolCallParserEnum[family](TOOL_NAMES), text, 1)
    first_call = next(i for i, p in enumerate(parts) if p.calls)
    streamed_text = "".join(p.normal_text for p in parts[:first_call])
    assert streamed_text == "Let me check that."
    assert all("<" not in p.normal_text for p in parts)
    # The content was all out before the call's JSON was.
    assert "".join(p.normal_text for p in parts[: text.index("{") + 1]) == "Let me check that."
    assert _calls(whole) == [{"name": "get_time", "arguments": {"timezone": "UTC"}}]


# ---- constrained output: required (JSON array) and a named function --------------------

FUNCTIONS = [
    {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    },
    {"name": "ping"},  # no parameters: an object of anything
]


def test_required_constraint_is_an_array_of_calls_of_the_tools():
    schema = get_json_schema_constraint(FUNCTIONS, None)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_time", "parameters": {"timezone": "UTC"}}, {"name": "ping", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_time", "parameters": {}}],
        [{"name": "ping"}],
        {"name": "ping", "parameters": {}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert "maxItems" not in schema
    assert get_json_schema_constraint(FUNCTIONS, None, parallel_tool_calls=False)["maxItems"] == 1


def test_named_constraint_is_the_function_parameters():
    assert get_json_schema_constraint(FUNCTIONS, "get_time") == FUNCTIONS[0]["parameters"]
    assert get_json_schema_constraint(FUNCTIONS, "ping") == {"type": "object", "properties": {}}


def test_required_constraint_hoists_defs():
    ref = {
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/Point"}},
        "required": ["p"],
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
    }
    schema = get_json_schema_constraint([{"name": "f", "parameters": ref}], None)
    assert "Point" in schema["$defs"]
    jsonschema.validate([{"name": "f", "parameters": {"p": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": {"x": "1"}}}], schema)
    other = {**ref, "$defs": {"Point": {"type": "string"}}}
    with pytest.raises(ValueError, match="Point"):
        get_json_schema_constraint([{"name": "f", "parameters": ref}, {"name": "g", "parameters": other}], None)


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_json_array_output(size):
    text = ' [{"name": "get_time", "parameters": {"timezone": "UTC"}}, {"name": "ping", "parameters": {}}]'
    _, whole = _streamed(JsonArrayParser(["get_time", "ping"]), text, size)
    assert whole.normal_text == ""
    assert _calls(whole) == [{"name": "get_time", "arguments": {"timezone": "UTC"}}, {"name": "ping", "arguments": {}}]


def test_json_array_calls_stream_one_by_one():
    text = '[{"name": "ping", "parameters": {}}, {"name": "ping", "parameters": {"n": 1}}]'
    parts, _ = _streamed(JsonArrayParser(["ping"]), text, 1)
    ends = [i for i, p in enumerate(parts) if p.calls]
    assert ends == [text.index("}},") + 1, len(text) - 2]  # each call as soon as its object closes


def test_json_array_cut_by_max_tokens_keeps_whole_calls_and_the_rest_is_text():
    text = '[{"name": "ping", "parameters": {}}, {"name": "ping", "para'
    result = JsonArrayParser(["ping"]).detect_and_parse(text)
    assert _calls(result) == [{"name": "ping", "arguments": {}}]
    assert result.normal_text == '{"name": "ping", "para'


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_named_function_output(size):
    _, whole = _streamed(NamedFunctionParser("get_time"), '{"timezone": "Europe/Paris"}', size)
    assert whole.normal_text == "" and _calls(whole) == [
        {"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}
    ]
    cut = NamedFunctionParser("get_time").detect_and_parse('{"timezone": "Eur')
    assert cut.calls == [] and cut.normal_text == '{"timezone": "Eur'
