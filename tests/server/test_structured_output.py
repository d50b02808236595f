"""Structured output over HTTP on the random-weight tiny model (one server per grammar
backend, xgrammar, llguidance and outlines, JSON without free whitespace): `/generate`'s
`json_schema`/`regex`/`ebnf`, the `/v1/completions` and chat extras, chat
`response_format` (structural tags too), and the 400s for an invalid grammar or more than one; outlines, which
has no EBNF and no numeric bounds, refuses them naming itself."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from server_launcher import ServerHandle

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
REGEX = r"(yes|no|maybe), [0-9]{2}"
BACKENDS = ["xgrammar", "llguidance", "outlines"]
# Outlines does not honour numeric bounds (it refuses them): its schema has none.
OUTLINES_SCHEMA = {**SCHEMA, "properties": {**SCHEMA["properties"], "age": {"type": "integer"}}}
OUTLINES_REFUSES = "the outlines grammar backend (--grammar-backend outlines)"


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def client(tiny_llama_dir, backend):
    args = ["--constrained-json-disable-any-whitespace", "--grammar-backend", backend]
    with ServerHandle(tiny_llama_dir, args) as server:
        with httpx.Client(base_url=server.base_url, timeout=120) as c:
            yield c


@pytest.fixture(scope="module")
def schema(backend):
    return OUTLINES_SCHEMA if backend == "outlines" else SCHEMA


def generate(client, **sampling) -> httpx.Response:
    return client.post(
        "/generate", json={"text": "Once upon a time", "sampling_params": {"max_new_tokens": 100, **sampling}}
    )


def test_generate_json_schema_regex_ebnf(client, backend, schema):
    r = generate(client, json_schema=json.dumps(schema), temperature=0)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["text"]), schema)
    assert r.json()["meta_info"]["finish_reason"]["type"] == "stop"
    r = generate(client, regex=REGEX, temperature=1.0, sampling_seed=5, n=3)
    assert r.status_code == 200, r.text
    assert len(r.json()) == 3 and all(re.fullmatch(REGEX, out["text"]) for out in r.json())
    r = generate(client, ebnf='root ::= "[" [0-9] "]"', temperature=1.0)
    if backend == "outlines":
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(
            f"sampling_params.ebnf: {OUTLINES_REFUSES} has no ebnf"
        ), r.text
    else:
        assert re.fullmatch(r"\[[0-9]\]", r.json()["text"]), r.text


def test_outlines_refuses_numeric_bounds_naming_itself(client, backend):
    r = generate(client, json_schema=json.dumps(SCHEMA))
    if backend != "outlines":
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(
        f"sampling_params.json_schema: {OUTLINES_REFUSES} does not honour 'minimum'"
    ), r.text


@pytest.mark.parametrize(
    "sampling,message",
    [
        (
            {"json_schema": '{"type": "objekt"}'},
            'sampling_params.json_schema: invalid json_schema: Unsupported type "objekt"',
        ),
        ({"json_schema": "{"}, "sampling_params.json_schema: invalid json_schema: Failed to parse JSON"),
        ({"regex": "(a"}, "sampling_params.regex: invalid regex: "),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "sampling_params: only one of regex, json_schema, or ebnf can be set"),
    ],
)
def test_generate_bad_grammar_is_400(client, backend, sampling, message):
    """Each backend's parser words the problem its own way; the field comes first."""
    r = generate(client, **sampling)
    assert r.status_code == 400, r.text
    if backend != "xgrammar":
        message = message.split(": invalid ")[0]
    assert r.json()["error"]["message"].startswith(message), r.text


def test_completions_extras_are_honoured(client, schema):
    r = client.post(
        "/v1/completions",
        json={"model": "m", "prompt": "Hi", "max_tokens": 80, "temperature": 0, "json_schema": json.dumps(schema)},
    )
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)
    r = client.post(
        "/v1/completions",
        json={
            "model": "m",
            "prompt": "Hi",
            "max_tokens": 80,
            "regex": REGEX,
            "temperature": 1.0,
            "seed": 3,
            "n": 2,
            "stream": True,
        },
    )
    assert r.status_code == 200, r.text
    texts = ["", ""]
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                texts[choice["index"]] += choice["text"]
    assert all(re.fullmatch(REGEX, t) for t in texts), texts
    r = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "regex": "a", "json_schema": "{}"})
    assert r.status_code == 400 and "Only one of regex, json_schema can be set" in r.text, r.text
    r = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "regex": "[z-a]"})
    assert r.status_code == 400 and r.json()["message"].startswith("regex: invalid regex: "), r.text


def chat(client, **fields) -> httpx.Response:
    return client.post(
        "/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "Tell me about a person."}],
            "max_tokens": 100,
            **fields,
        },
    )


def test_chat_response_format(client, backend, schema):
    r = chat(
        client,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
        temperature=0,
    )
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    for response_format in (
        {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
        {"type": "json_object"},
    ):
        r = chat(client, response_format=response_format, stream=True, temperature=1.0, seed=1)
        chunks = [json.loads(line[6:])["choices"] for line in r.text.splitlines() if line.startswith("data: {")]
        content = "".join(c[0]["delta"].get("content") or "" for c in chunks if c)
        finish = [c[0]["finish_reason"] for c in chunks if c and c[0]["finish_reason"]]
        if response_format["type"] == "json_schema":
            assert finish == ["stop"], r.text
            jsonschema.validate(json.loads(content), schema)
        else:  # any object: a random model may not close its strings within max_tokens
            assert content.startswith("{") and (finish == ["length"] or isinstance(json.loads(content), dict))
    r = chat(client, ebnf='root ::= "ok" | "no"', temperature=1.0)
    if backend == "outlines":
        assert r.status_code == 400 and r.json()["param"] == "ebnf" and OUTLINES_REFUSES in r.text, r.text
    else:
        assert r.json()["choices"][0]["message"]["content"] in ("ok", "no"), r.text
    r = chat(client, response_format={"type": "text"})
    assert r.status_code == 200, r.text


CONST_TAG = {"type": "structural_tag", "format": {"type": "const_string", "value": "The capital of France is Berlin."}}
LEGACY_TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<f=a>", "schema": SCHEMA, "end": "</f>"}],
    "triggers": ["<f"],
}


def test_chat_structural_tag(client, backend):
    """SGLang's `response_format` structural tags: xgrammar's `format` shape (SGLang's
    test_structural_tag: a const string, a JSON schema) on xgrammar, the legacy shape
    (`structures`, `triggers`) on xgrammar and llguidance; the others name themselves."""
    json_tag = {
        "type": "structural_tag",
        "format": {"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 1},
    }
    if backend == "outlines":
        r = chat(client, response_format=CONST_TAG)
        assert r.status_code == 400 and r.json()["param"] == "structural_tag" and OUTLINES_REFUSES in r.text, r.text
        return
    if backend == "llguidance":
        r = chat(client, response_format=CONST_TAG)
        assert r.status_code == 400 and "llguidance grammar backend" in r.text and "'format'" in r.text, r.text
    else:
        r = chat(client, response_format=CONST_TAG, temperature=0)
        assert r.json()["choices"][0]["message"]["content"] == CONST_TAG["format"]["value"], r.text
        r = chat(client, response_format=CONST_TAG, stream=True)
        chunks = [json.loads(line[6:])["choices"] for line in r.text.splitlines() if line.startswith("data: {")]
        assert "".join(c[0]["delta"].get("content") or "" for c in chunks if c) == CONST_TAG["format"]["value"]
        r = chat(client, response_format=json_tag, temperature=0)
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMA)
        r = generate(client, structural_tag=json.dumps({"type": "structural_tag", "format": {"type": "bogus"}}))
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "sampling_params.structural_tag: invalid structural_tag: Format type not recognized: bogus"
        ), r.text
    r = chat(client, response_format=LEGACY_TAG, temperature=1.0, seed=3, max_tokens=60)
    content = r.json()["choices"][0]["message"]["content"]
    for m in re.finditer(r"<f=a>(.*?)</f>", content, re.S):  # free text; any structure is whole
        jsonschema.validate(json.loads(m.group(1)), SCHEMA)
    r = chat(client, response_format={**LEGACY_TAG, "triggers": ["<x"]})
    assert r.status_code == 400 and r.json()["param"] == "structural_tag", r.text


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"response_format": {"type": "structural_tag"}}, "a structural_tag needs 'format', or the legacy"),
        ({"response_format": {"type": "json_object"}, "regex": "a"}, "Only one of regex, response_format can be set"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema is required"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
            "json_schema: invalid json_schema: ",
        ),
    ],
)
def test_chat_bad_response_format_is_400(client, fields, message):
    r = chat(client, **fields)
    assert r.status_code == 400 and message in r.text, r.text


def test_grammar_backend_none_refuses_constrained_requests(tiny_llama_dir):
    with ServerHandle(tiny_llama_dir, ["--grammar-backend", "none"]) as server:
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            r = generate(c, regex="a")
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"] == (
                "sampling_params.regex: structured output is disabled on this server (--grammar-backend none)"
            )
            r = chat(c, response_format={"type": "json_object"})
            assert r.status_code == 400 and "structured output is disabled" in r.text, r.text
            assert generate(c, max_new_tokens=3).status_code == 200
