"""Chat tool calls on a real server (tiny random-weight llama, `--tool-call-parser qwen25`
and a chat template that renders tools): `tool_choice` required and named functions
always yield calls whose arguments validate against the tools' schemas, streamed and not,
through httpx and the official `openai` client; `auto` and `none` decide whether the
template sees the tools; bad tool fields are 400s naming the field.

The required/named tests rest on constrained decoding (`sampling_params.json_schema`,
tandem/constrained)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from server_launcher import ServerHandle

TEMPLATE = Path(__file__).parent.parent / "fixtures" / "tool_calls" / "qwen25_tools_template.jinja"
# Bounded schemas: a random model writes until the grammar ends, so every value is finite.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "description": "Set an alarm",
            "parameters": {
                "type": "object",
                "properties": {
                    "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                    "minute": {"type": "integer", "minimum": 0, "maximum": 59},
                    "repeat": {"type": "boolean"},
                },
                "required": ["hour", "minute", "repeat"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add_to_cart",
            "description": "Add fruit to the cart",
            "parameters": {
                "type": "object",
                "properties": {
                    "items": {
                        "type": "array",
                        "items": {"type": "string", "enum": ["apple", "pear", "plum"]},
                        "minItems": 1,
                        "maxItems": 3,
                    },
                    "options": {
                        "type": "object",
                        "properties": {"gift": {"type": "boolean"}},
                        "required": ["gift"],
                        "additionalProperties": False,
                    },
                },
                "required": ["items", "options"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def tool_server(tiny_llama_dir):
    with ServerHandle(tiny_llama_dir, ["--tool-call-parser", "qwen25", "--chat-template", str(TEMPLATE)]) as h:
        yield h


@pytest.fixture(scope="module")
def http(tool_server):
    with httpx.Client(base_url=tool_server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(tool_server):
    return openai.OpenAI(base_url=tool_server.base_url + "/v1", api_key="none", max_retries=0)


def _body(**kw) -> dict:
    return {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX_TOKENS, **kw}


def _post(http, body) -> dict:
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(http, body) -> list[dict]:
    """Each choice's message rebuilt from the stream's deltas, as OpenAI clients do."""
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    choices: dict[int, dict] = {}
    for chunk in map(json.loads, lines[:-1]):
        assert "error" not in chunk, chunk
        for ch in chunk["choices"]:
            acc = choices.setdefault(ch["index"], {"content": "", "calls": {}, "finish_reason": None})
            acc["content"] += ch["delta"].get("content") or ""
            for call in ch["delta"].get("tool_calls") or []:
                slot = acc["calls"].setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
                slot["id"] = call.get("id") or slot["id"]
                slot["name"] += call["function"].get("name") or ""
                slot["arguments"] += call["function"].get("arguments") or ""
            acc["finish_reason"] = ch["finish_reason"] or acc["finish_reason"]
    return [choices[i] for i in sorted(choices)]


def _check_calls(calls: list[tuple[str, str, str]], names: set[str]) -> None:
    """(id, name, arguments) of one choice: at least one call, each of a given tool, with
    arguments that validate against its schema."""
    assert calls, "no tool call"
    for call_id, name, arguments in calls:
        assert call_id.startswith("call_") and name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _calls_of_message(message: dict) -> list[tuple[str, str, str]]:
    return [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]


def _calls_of_stream(choice: dict) -> list[tuple[str, str, str]]:
    return [(c["id"], c["name"], c["arguments"]) for _, c in sorted(choice["calls"].items())]


SAMPLING = [
    pytest.param({"temperature": 0}, id="greedy"),
    pytest.param({"temperature": 1.0, "n": 3, "seed": 11}, id="sampled"),
]


# ---- required: any of the tools --------------------------------------------------------


@pytest.mark.parametrize("sampling", SAMPLING)
def test_required_yields_valid_calls(http, sampling):
    body = _body(tool_choice="required", parallel_tool_calls=False, **sampling)
    resp = _post(http, body)
    assert len(resp["choices"]) == sampling.get("n", 1)
    for choice in resp["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None
        calls = _calls_of_message(choice["message"])
        assert len(calls) == 1  # parallel_tool_calls false
        _check_calls(calls, set(SCHEMAS))


@pytest.mark.parametrize("sampling", SAMPLING)
def test_required_streamed_yields_valid_calls(http, sampling):
    choices = _stream(http, _body(tool_choice="required", parallel_tool_calls=False, **sampling))
    assert len(choices) == sampling.get("n", 1)
    for choice in choices:
        assert choice["finish_reason"] == "tool_calls" and choice["content"] == ""
        _check_calls(_calls_of_stream(choice), set(SCHEMAS))


def test_required_with_parallel_calls_yields_valid_calls(http):
    """Without parallel_tool_calls false the array may hold several calls: all valid."""
    (choice,) = _post(http, _body(tool_choice="required", temperature=0))["choices"]
    assert choice["finish_reason"] == "tool_calls"
    _check_calls(_calls_of_message(choice["message"]), set(SCHEMAS))


def test_required_streamed_equals_not_streamed_when_greedy(http):
    body = _body(tool_choice="required", parallel_tool_calls=False, temperature=0)
    whole = _calls_of_message(_post(http, body)["choices"][0]["message"])
    streamed = _calls_of_stream(_stream(http, body)[0])
    assert [c[1:] for c in whole] == [c[1:] for c in streamed]


# ---- a named function ------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_function_yields_a_valid_call_of_it(http, name, stream):
    body = _body(tool_choice={"type": "function", "function": {"name": name}}, temperature=1.0, n=2, seed=5)
    if stream:
        choices = [(c["finish_reason"], _calls_of_stream(c)) for c in _stream(http, body)]
    else:
        choices = [(c["finish_reason"], _calls_of_message(c["message"])) for c in _post(http, body)["choices"]]
    assert len(choices) == 2
    for reason, calls in choices:
        assert reason == "tool_calls" and len(calls) == 1
        _check_calls(calls, {name})


# ---- the official client ---------------------------------------------------------------


def test_openai_client_required_and_named(oai):
    resp = oai.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls([(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls], set(SCHEMAS))

    named = {"type": "function", "function": {"name": "set_alarm"}}
    stream = oai.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=named,
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        seed=3,
        stream=True,
    )
    calls: dict[int, list[str]] = {}
    reasons = []
    for chunk in stream:
        for ch in chunk.choices:
            for call in ch.delta.tool_calls or []:
                slot = calls.setdefault(call.index, [None, "", ""])
                slot[0] = call.id or slot[0]
                slot[1] += call.function.name or ""
                slot[2] += call.function.arguments or ""
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert reasons == ["tool_calls"]
    _check_calls([tuple(calls[i]) for i in sorted(calls)], {"set_alarm"})


# ---- auto and none: the template sees the tools or not -----------------------------------


def _prompt_tokens(http, **kw) -> int:
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **kw})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_auto_shows_the_tools_to_the_template_and_none_hides_them(http):
    plain = _prompt_tokens(http)
    assert _prompt_tokens(http, tools=TOOLS) > plain + 50  # auto is the default with tools
    assert _prompt_tokens(http, tools=TOOLS, tool_choice="auto") == _prompt_tokens(http, tools=TOOLS)
    assert _prompt_tokens(http, tools=TOOLS, tool_choice="none") == plain
    named = {"type": "function", "function": {"name": "get_weather"}}
    # The named function alone is shown.
    assert plain < _prompt_tokens(http, tools=TOOLS, tool_choice=named) < _prompt_tokens(http, tools=TOOLS)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_and_none_answer_in_openai_shape(http, stream):
    """The random model writes no `<tool_call>`: auto parses nothing and answers text."""
    for choice in ("auto", "none"):
        body = _body(tool_choice=choice, max_tokens=16, temperature=0)
        if stream:
            (only,) = _stream(http, body)
            assert only["calls"] == {} and only["finish_reason"] in ("stop", "length")
        else:
            (only,) = _post(http, body)["choices"]
            assert only["message"]["role"] == "assistant" and "tool_calls" not in only["message"]
            assert isinstance(only["message"]["content"], str) and only["finish_reason"] in ("stop", "length")


# ---- request errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "book_flight"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]},
            "tools.0.function.parameters",
        ),
        ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function.name"),
    ],
)
def test_bad_tool_fields_are_400_naming_the_field(http, body, param):
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["param"] == param and err["message"].startswith(param + ": "), err
    assert err["code"] == 400 and err["object"] == "error"


_POINT = {"type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "required": ["p"]}


@pytest.mark.parametrize(
    "tools,param,words",
    [
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "unknown_type"}}}],
            "tools.0.function.parameters",
            "invalid 'parameters' schema",
        ),
        (
            [
                {"type": "function", "function": {"name": n, "parameters": {**_POINT, "$defs": {"Point": {"type": t}}}}}
                for n, t in (("f", "string"), ("g", "number"))
            ],
            "tools",
            "has multiple schemas, which is not supported",
        ),
    ],
)
def test_bad_tool_schemas_say_it_in_sglangs_words(http, tools, param, words):
    """Clients match SGLang's wording of these two 400s; the field still comes first."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "tools": tools, "tool_choice": "required"}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["param"] == param and err["message"].startswith(param + ": ") and words in err["message"], err


def test_bad_tool_choice_is_400_through_the_openai_client(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=4,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert e.value.status_code == 400 and "tool_choice" in str(e.value)


def test_model_info_reports_the_parser(http):
    assert http.get("/model_info").json()["tool_call_parser"] == "qwen25"


@pytest.mark.parametrize("parser", ["mistral", "pythonic", "lfm2"])
def test_other_parsers_serve_auto_and_required(tiny_llama_dir, parser):
    """A server with each of the other parsers (SGLang's names) starts and answers `auto`
    (plain text from a random model: it writes no calls) and `required` (constrained calls)."""
    with (
        ServerHandle(tiny_llama_dir, ["--tool-call-parser", parser]) as h,
        httpx.Client(base_url=h.base_url, timeout=120) as c,
    ):
        assert c.get("/model_info").json()["tool_call_parser"] == parser
        (auto,) = _post(c, _body(tool_choice="auto", max_tokens=16))["choices"]
        assert isinstance(auto["message"]["content"], str) and auto["finish_reason"] in ("stop", "length")
        # One call, seeded: without parallel_tool_calls false a random model may sample call after call to max_tokens.
        (required,) = _post(c, _body(tool_choice="required", parallel_tool_calls=False, seed=5))["choices"]
        assert required["finish_reason"] == "tool_calls" and len(required["message"]["tool_calls"]) == 1, required
