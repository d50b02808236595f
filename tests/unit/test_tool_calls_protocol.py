"""Chat tools without a server: what `tools` / `tool_choice` do to a request (400s naming
the field, the constraint, the template's tools), and how outputs become OpenAI's
`tool_calls`, whole and streamed, checked against the official client's types."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tandem.entrypoints.openai.errors import OpenAIError
from tandem.entrypoints.openai.protocol import ChatCompletionRequest
from tandem.entrypoints.openai.serving_chat import (
    ChatStreamConverter,
    build_chat_generate_input,
    build_chat_response,
    render_chat_prompt,
)
from tandem.entrypoints.openai.tool_calls import resolve_tools
from tandem.function_call.json_array_parser import JsonArrayParser, NamedFunctionParser
from tandem.function_call.qwen25_detector import Qwen25Detector

MODEL = "tiny"
FIXTURES = Path(__file__).parent.parent / "fixtures" / "tool_calls"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    },
}


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], **kw)


def _refused(req: ChatCompletionRequest, parser: str | None = None) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        resolve_tools(req, parser)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_or_named_choice_without_tools_is_400_naming_tool_choice(choice):
    for tools in (None, []):
        err = _refused(_chat(tool_choice=choice, tools=tools))
        assert err.param == "tool_choice" and err.message.startswith("tool_choice: ")


def test_named_function_not_in_tools_is_400():
    err = _refused(_chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert err.param == "tool_choice" and "get_time" in err.message


def test_invalid_parameters_schema_is_400_naming_the_tool():
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    err = _refused(_chat(tools=[WEATHER, bad]))
    assert err.param == "tools.1.function.parameters" and err.message.startswith("tools.1.function.parameters: ")


def test_none_and_auto_without_tools_are_plain_chat():
    for choice in (None, "none", "auto"):
        setup = resolve_tools(_chat(tool_choice=choice), "qwen25")
        assert setup.template_tools is None and setup.json_schema is None and setup.make_detector is None


def test_none_hides_the_tools():
    setup = resolve_tools(_chat(tools=[WEATHER], tool_choice="none"), "qwen25")
    assert setup.template_tools is None and setup.make_detector is None and setup.json_schema is None


def test_auto_is_the_default_with_tools_and_uses_the_parser():
    for choice in (None, "auto"):
        setup = resolve_tools(_chat(tools=[WEATHER, TIME], tool_choice=choice), "qwen25")
        assert setup.template_tools == [WEATHER, TIME] and setup.json_schema is None
        assert isinstance(setup.make_detector(), Qwen25Detector) and setup.keep_special_tokens
        obj = build_chat_generate_input(_chat(), [1], 8)
        setup.apply(obj)
        assert obj.sampling_params["skip_special_tokens"] is False and "json_schema" not in obj.sampling_params


def test_auto_without_a_parser_shows_the_tools_and_returns_text():
    setup = resolve_tools(_chat(tools=[WEATHER]), None)
    assert setup.template_tools == [WEATHER] and setup.make_detector is None and setup.json_schema is None


def test_required_sets_the_array_schema():
    setup = resolve_tools(_chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), None)
    schema = json.loads(setup.json_schema)
    assert schema["type"] == "array" and schema["maxItems"] == 1
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [
        ["get_current_weather"],
        ["get_time"],
    ]
    assert isinstance(setup.make_detector(), JsonArrayParser)
    obj = build_chat_generate_input(_chat(), [1], 8)
    setup.apply(obj)
    assert json.loads(obj.sampling_params["json_schema"]) == schema


def test_named_sets_the_parameters_schema_and_shows_only_that_tool():
    setup = resolve_tools(
        _chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}), None
    )
    assert json.loads(setup.json_schema) == TIME["function"]["parameters"]
    assert setup.template_tools == [TIME]
    detector = setup.make_detector()
    assert isinstance(detector, NamedFunctionParser) and detector.name == "get_time"


def test_a_tool_constraint_does_not_join_another():
    setup = resolve_tools(_chat(tools=[TIME], tool_choice="required"), None)
    obj = build_chat_generate_input(_chat(), [1], 8)
    obj.sampling_params["regex"] = "a+"
    with pytest.raises(OpenAIError) as e:
        setup.apply(obj)
    assert e.value.param == "tool_choice" and "regex" in e.value.message


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ],
)
def test_malformed_tools_fields_fail_validation(body, param):
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from tandem.entrypoints.openai.errors import from_validation_error

    with pytest.raises(ValidationError) as e:
        _chat(**body)
    err = from_validation_error(RequestValidationError([{**x, "loc": ("body", *x["loc"])} for x in e.value.errors()]))
    assert err.param == param and err.message.startswith(f"{param}: ")


# ---- the chat template gets the tools ------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen2_dir)


def test_tools_reach_the_chat_template(tokenizer):
    template = (FIXTURES / "qwen25_tools_template.jinja").read_text()
    req = _chat(tools=[WEATHER])
    setup = resolve_tools(req, "qwen25")
    text = render_chat_prompt(tokenizer, req.messages, template, setup.template_tools)
    assert '"name": "get_current_weather"' in text and '"enum": ["celsius", "fahrenheit"]' in text
    assert "<tools>" in text and text.endswith("<|im_start|>assistant\n")
    assert "<tools>" not in render_chat_prompt(tokenizer, req.messages, template, None)


def test_earlier_calls_and_results_render_with_object_arguments(tokenizer):
    template = (FIXTURES / "qwen25_tools_template.jinja").read_text()
    req = ChatCompletionRequest(
        model=MODEL,
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_current_weather", "arguments": '{"location": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        ],
    )
    text = render_chat_prompt(tokenizer, req.messages, template, [WEATHER])
    # The arguments went in as an object (tojson of a dict), not as a quoted string.
    assert '{"name": "get_current_weather", "arguments": {"location": "Paris"}}' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text


# ---- outputs -> tool_calls -----------------------------------------------------------


def _meta(completion_tokens, finish=None):
    return {
        "id": "r",
        "finish_reason": finish,
        "prompt_tokens": 9,
        "completion_tokens": completion_tokens,
        "cached_tokens": 0,
    }


QWEN_OUTPUT = (
    'I will check both.\n<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Paris"}}'
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>'
)
EOS = {"type": "stop", "matched": 2}


def _qwen():
    return Qwen25Detector(["get_current_weather", "get_time"])


def test_response_with_tool_calls_has_openai_shape():
    outputs = [
        {"text": QWEN_OUTPUT, "meta_info": _meta(40, EOS)},
        {"text": "No tools needed.", "meta_info": _meta(4, EOS)},
    ]
    resp = build_chat_response("chatcmpl-1", MODEL, outputs, n=2, with_logprobs=False, make_detector=_qwen)
    body = resp.model_dump()
    ChatCompletion.model_validate(body)
    first, second = body["choices"]
    assert first["finish_reason"] == "tool_calls" and first["matched_stop"] is None
    assert first["message"]["content"] == "I will check both."
    calls = first["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_current_weather", "get_time"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"location": "Paris"}, {"timezone": "CET"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert second["message"] == {"role": "assistant", "content": "No tools needed.", "reasoning_content": None}
    assert second["finish_reason"] == "stop" and second["matched_stop"] == 2


def test_only_calls_gives_null_content_and_a_length_finish_stays_length():
    out = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
    resp = build_chat_response(
        "x", MODEL, [{"text": out, "meta_info": _meta(20, EOS)}], 1, False, make_detector=_qwen
    ).model_dump()
    assert resp["choices"][0]["message"]["content"] is None and resp["choices"][0]["finish_reason"] == "tool_calls"
    cut = build_chat_response(
        "x",
        MODEL,
        [{"text": out + "\n<tool_call>\n{", "meta_info": _meta(30, {"type": "length", "length": 30})}],
        1,
        False,
        make_detector=_qwen,
    ).model_dump()
    assert cut["choices"][0]["finish_reason"] == "length"
    assert len(cut["choices"][0]["message"]["tool_calls"]) == 1


def test_stream_sends_content_then_one_delta_per_call_then_tool_calls_finish():
    conv = ChatStreamConverter(
        "chatcmpl-1", MODEL, num_choices=1, n=1, with_logprobs=False, include_usage=False, make_detector=_qwen
    )
    chunks = conv.start()
    pieces = [QWEN_OUTPUT[i : i + 5] for i in range(0, len(QWEN_OUTPUT), 5)]
    for k, piece in enumerate(pieces):
        done = k == len(pieces) - 1
        chunks += conv.on_output(0, {"text": piece, "meta_info": _meta(k + 1, EOS if done else None)})
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content", "") for d in deltas) == "I will check both."
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert [len(c) for c in calls] == [1, 1]
    assert [(c[0]["index"], c[0]["type"], c[0]["function"]["name"]) for c in calls] == [
        (0, "function", "get_current_weather"),
        (1, "function", "get_time"),
    ]
    assert json.loads(calls[1][0]["function"]["arguments"]) == {"timezone": "CET"}
    assert all(c[0]["id"].startswith("call_") for c in calls)
    # Content came before the first call, and no marker leaked into it.
    first_call = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert all("tool_calls" not in d for d in deltas[:first_call]) and "<" not in "".join(
        d.get("content") or "" for d in deltas
    )
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["tool_calls"]
    assert chunks[-1]["choices"][0]["matched_stop"] is None


def test_stream_flushes_a_call_that_ends_with_the_output():
    """The last piece completes the call: it goes out before the finish chunk."""
    conv = ChatStreamConverter("c", MODEL, 1, 1, False, False, make_detector=lambda: NamedFunctionParser("get_time"))
    chunks = conv.on_output(0, {"text": '{"timezone": ', "meta_info": _meta(3)})
    assert chunks == []
    chunks = conv.on_output(0, {"text": '"UTC"}', "meta_info": _meta(5, {"type": "stop", "matched": None})})
    assert [list(c["choices"][0]["delta"]) for c in chunks] == [
        ["reasoning_content", "tool_calls"],
        ["reasoning_content"],
    ]
    assert chunks[0]["choices"][0]["delta"]["tool_calls"][0]["function"] == {
        "name": "get_time",
        "arguments": '{"timezone": "UTC"}',
    }
    assert chunks[1]["choices"][0]["finish_reason"] == "tool_calls"
