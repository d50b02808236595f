"""A hostile or careless client against a live server: values that overflow tensors,
NaN and infinities, huge and deeply nested bodies, lone surrogates, long rids; then a
property-based fuzz over the request space of the generation routes and a schemathesis
run over /openapi.json. The rule throughout: every answer is 200 or 4xx (never 5xx, never
a dropped connection), /health stays 200, and the memory invariant holds afterwards."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time

import httpx
import pytest
import schemathesis
from http_helpers import assert_memory_idle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

INT64_OVER = 2**63  # 9223372036854775808: one past the largest int64
DEEP = 100_000  # nesting levels of the deeply nested bodies
TINY = {"max_new_tokens": 2, "temperature": 0}


def post_raw(client: httpx.Client, path: str, body: str | bytes) -> httpx.Response:
    """POST a body as given (JSON literals such as NaN, numbers past 64 bits, escapes)."""
    return client.post(path, content=body, headers={"content-type": "application/json"})


def model_name(client: httpx.Client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


def error_message(r: httpx.Response) -> str:
    body = r.json()
    return body["error"]["message"] if "error" in body else body["message"]


def assert_healthy(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    r = client.post("/generate", json={"text": "Hello", "sampling_params": TINY})
    assert r.status_code == 200, r.text


# ---- item 1: numbers that reach tensors ----------------------------------------------


def test_top_k_past_int64_is_400_and_the_server_lives(client):
    """The reported crash: top_k 2**63 overflowed the sampler's int64 tensor and the
    scheduler (so the server) died."""
    r = post_raw(
        client, "/generate", f'{{"text": "Hi", "sampling_params": {{"top_k": {INT64_OVER}, "max_new_tokens": 2}}}}'
    )
    assert r.status_code == 400 and "top_k" in error_message(r), r.text
    model = model_name(client)
    r = post_raw(
        client, "/v1/completions", f'{{"model": "{model}", "prompt": "Hi", "max_tokens": 2, "top_k": {INT64_OVER}}}'
    )
    assert r.status_code == 400 and r.json()["param"] == "top_k", r.text
    r = post_raw(
        client,
        "/v1/chat/completions",
        f'{{"model": "{model}", "max_tokens": 2, "top_k": {INT64_OVER}, '
        '"messages": [{"role": "user", "content": "Hi"}]}',
    )
    assert r.status_code == 400 and r.json()["param"] == "top_k", r.text
    assert_healthy(client)


@pytest.mark.parametrize(
    "params, field",
    [
        (f'{{"top_k": {2**64}}}', "top_k"),  # past uint64: a float once parsed
        (f'{{"sampling_seed": {INT64_OVER}}}', "sampling_seed"),
        (f'{{"sampling_seed": {-INT64_OVER - 1}}}', "sampling_seed"),
        ('{"n": 129}', "n"),
        ('{"n": 1000}', "n"),
        ('{"temperature": NaN}', "request body"),
        ('{"temperature": Infinity}', "request body"),
        ('{"temperature": 1e400}', "request body"),
        (f'{{"temperature": {10**400}}}', "request body"),  # a double overflows: invalid JSON
        ('{"top_p": -Infinity}', "request body"),
        ('{"frequency_penalty": 1e308}', "frequency_penalty"),
        ('{"repetition_penalty": 0}', "repetition_penalty"),
        (f'{{"max_new_tokens": {INT64_OVER}}}', "max_new_tokens"),
        (f'{{"min_new_tokens": {INT64_OVER - 1}}}', "min_new_tokens"),
        (f'{{"stop_token_ids": [{INT64_OVER}]}}', "stop_token_ids"),
        ('{"stop_token_ids": [-5]}', "stop_token_ids"),  # past the vocabulary: ignored, as SGLang
    ],
)
def test_native_sampling_numbers_out_of_range_are_400(client, params, field):
    r = post_raw(client, "/generate", f'{{"text": "Hi", "sampling_params": {params}}}')
    assert r.status_code == 400, r.text
    assert field in error_message(r), r.text


@pytest.mark.parametrize(
    "body, field",
    [
        (f'{{"input_ids": [1, {INT64_OVER}]}}', "input_ids"),
        ('{"input_ids": [1, -1]}', "input_ids"),
        (f'{{"text": "Hi", "return_logprob": true, "top_logprobs_num": {INT64_OVER}}}', "top_logprobs_num"),
        (f'{{"text": "Hi", "return_logprob": true, "logprob_start_len": {INT64_OVER}}}', "logprob_start_len"),
        ('{"text": "Hi", "rid": "' + "r" * 513 + '"}', "rid"),
    ],
)
def test_native_request_numbers_out_of_range_are_400(client, body, field):
    r = post_raw(client, "/generate", body)
    assert r.status_code == 400 and field in error_message(r), r.text


@pytest.mark.parametrize(
    "key, raw, param",
    [
        ("seed", str(INT64_OVER), "seed"),
        ("top_k", str(2**64), "top_k"),
        ("n", "129", "n"),
        ("temperature", "NaN", None),
        ("top_p", "Infinity", None),
        ("frequency_penalty", "3", "frequency_penalty"),
        ("presence_penalty", "-1e300", "presence_penalty"),
        ("max_tokens", str(INT64_OVER), "max_tokens"),
        ("min_tokens", str(INT64_OVER), "min_tokens"),
        ("logprobs", "6", "logprobs"),
        ("stop_token_ids", f"[{INT64_OVER}]", "stop_token_ids"),
    ],
)
def test_openai_numbers_out_of_range_are_400(client, key, raw, param):
    fields = {"model": f'"{model_name(client)}"', "prompt": '"Hi"', "max_tokens": "2", key: raw}
    r = post_raw(client, "/v1/completions", "{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}")
    assert r.status_code == 400, r.text
    assert r.json()["param"] == param, r.text


def test_openai_token_ids_and_logprob_counts_out_of_range_are_400(client):
    model = model_name(client)
    r = post_raw(client, "/v1/completions", f'{{"model": "{model}", "prompt": [1, {INT64_OVER}], "max_tokens": 2}}')
    assert r.status_code == 400 and r.json()["param"] == "prompt", r.text
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "Hi"}],
            "logprobs": True,
            "top_logprobs": 21,
            "max_tokens": 2,
        },
    )
    assert r.status_code == 400 and r.json()["param"] == "top_logprobs", r.text


def test_large_values_that_can_be_honoured_are_clamped(client):
    """A top_k past the vocabulary means all of it; a max_new_tokens past the context is
    capped by the scheduler: both run (the long one is cut short by closing its stream)."""
    r = client.post(
        "/generate",
        json={"text": "Hi", "sampling_params": {**TINY, "top_k": 10**12, "temperature": 1, "sampling_seed": 2**63 - 1}},
    )
    assert r.status_code == 200, r.text
    with client.stream(
        "POST", "/generate", json={"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": 2**63 - 1}}
    ) as r:
        assert r.status_code == 200
        assert next(line for line in r.iter_lines() if line).startswith("data: {")
    assert_memory_idle(client)


# ---- item 3: body size, prompt length, the event loop --------------------------------


def test_content_length_past_the_limit_is_413_without_the_body(server):
    """Only the headers are sent: the answer must come without waiting for the body."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 40000000\r\n\r\n"
        )
        reply = b""
        while chunk := s.recv(65536):  # the server closes the connection after its answer
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413"), reply
    assert "--max-request-body-bytes" in reply


def test_chunked_body_past_the_limit_is_413(client):
    def chunks():
        for _ in range(40):  # 40 MiB, past the 32 MiB default
            yield b" " * (1 << 20)

    try:
        r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    except httpx.HTTPError:  # the server may close while the client still writes
        r = None
    if r is not None:
        assert r.status_code == 413, r.text
        assert "--max-request-body-bytes" in r.json()["message"]
    assert_healthy(client)


def test_prompt_too_long_in_characters_is_refused_before_tokenizing(client):
    """A 5.4 MB prompt (far more characters than the context's tokens can cover) is
    refused by its length in characters on every route, each answer in less than half
    the time /tokenize takes to tokenize it (relative, not a fixed time: a loaded machine
    slows both)."""
    text = "hello world " * 450_000
    start = time.monotonic()
    assert client.post("/tokenize", json={"text": text}).status_code == 200
    tokenize_s = time.monotonic() - start
    model = model_name(client)
    refusals = [
        (client.post, "/generate", {"text": text, "sampling_params": TINY}, None),
        (client.post, "/v1/completions", {"model": model, "prompt": text, "max_tokens": 1}, "prompt"),
        (
            client.post,
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": text}]},
            "messages",
        ),
    ]
    for post, path, body, param in refusals:
        start = time.monotonic()
        r = post(path, json=body)
        seconds = time.monotonic() - start
        assert r.status_code == 400 and "characters" in error_message(r), (path, r.text[:300])
        if param is not None:
            assert r.json()["param"] == param, r.text[:300]
        assert seconds < tokenize_s / 2, (path, seconds, tokenize_s)


def test_health_answers_while_a_large_body_is_tokenized(server, client):
    """Tokenizing 5 MB takes seconds; it runs off the event loop, so /health stays fast."""
    text = "hello world " * 450_000  # 5.4 MB
    done: dict = {}

    def tokenize() -> None:
        with httpx.Client(base_url=server.base_url, timeout=120) as c:
            start = time.monotonic()
            done["status"] = c.post("/tokenize", json={"text": text}).status_code
            done["seconds"] = time.monotonic() - start

    worker = threading.Thread(target=tokenize)
    worker.start()
    latencies = []
    while worker.is_alive():
        start = time.monotonic()
        assert client.get("/health").status_code == 200
        latencies.append(time.monotonic() - start)
        time.sleep(0.05)
    worker.join()
    assert done["status"] == 200, done
    # A blocked event loop would hold one /health for most of the tokenization. The bounds
    # are relative to the tokenization's own time (a loaded machine slows both), not fixed:
    # it must have lasted many /health answers (so they overlapped it), and no answer may
    # have waited for half of it.
    assert len(latencies) >= 5 and done["seconds"] > 5 * statistics.median(latencies), (latencies, done)
    assert max(latencies) < done["seconds"] / 2, (latencies, done)


# ---- item 5: deeply nested JSON -------------------------------------------------------


BODY_ROUTES = ["/generate", "/abort_request", "/tokenize", "/detokenize", "/v1/completions", "/v1/chat/completions"]


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_deeply_nested_body_is_400(client, path):
    for body in ("[" * DEEP + "]" * DEEP, '{"a": ' * DEEP + "1" + "}" * DEEP):
        r = post_raw(client, path, body)
        assert r.status_code == 400, (path, r.status_code, r.text[:200])
        assert "invalid JSON" in error_message(r)
    assert client.get("/health").status_code == 200


def test_every_post_route_survives_a_deeply_nested_body(client):
    paths = [p for p, ops in client.get("/openapi.json").json()["paths"].items() if "post" in ops]
    assert set(BODY_ROUTES) <= set(paths)
    for path in paths:
        if "profile" in path:  # starts the profiler, whatever the body
            continue
        r = post_raw(client, path, "[" * DEEP + "]" * DEEP)
        assert r.status_code < 500, (path, r.status_code, r.text[:200])
    assert_healthy(client)


@pytest.mark.parametrize(
    "body",
    [
        lambda m, v: {"text": "Hi", "sampling_params": {**TINY, "stop": v}},
        lambda m, v: {"text": "Hi", "rid": v},
        lambda m, v: {"text": v},
        lambda m, v: {"model": m, "prompt": v},
        lambda m, v: {"model": m, "prompt": "Hi", "max_tokens": 1, "stop": v},
        lambda m, v: {"model": m, "max_tokens": 1, "tool_choice": v, "messages": [{"role": "user", "content": "Hi"}]},
        lambda m, v: {"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi", "extra": v}]},
        lambda m, v: {"model": m, "max_tokens": 1, "messages": [{"role": "user", "content": v}]},
    ],
)
def test_values_nested_as_deep_as_json_allows_are_never_500(client, body):
    """orjson refuses more than 1024 levels; just under that must not reach Python's
    recursion limit anywhere (error messages, copies, validation)."""
    payload = body(model_name(client), "@@deep@@")
    path = "/generate" if "text" in payload else "/v1/completions" if "prompt" in payload else "/v1/chat/completions"
    r = post_raw(client, path, json.dumps(payload).replace('"@@deep@@"', "[" * 1000 + "1" + "]" * 1000))
    assert r.status_code < 500, (path, r.status_code, r.text[:300])


# ---- item 6: lone surrogates, rid length, n ------------------------------------------


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/generate", '{"text": "Hi \\ud800 there"}', "text"),
        ("/generate", '{"text": "Hi", "sampling_params": {"stop": ["\\udfff"]}}', "sampling_params.stop.0"),
        ("/tokenize", '{"text": "\\ud800"}', "text"),
        ("/v1/completions", '{"model": "m", "prompt": ["ok", "\\ud83d"]}', "prompt.1"),
        (
            "/v1/chat/completions",
            '{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages.0.content",
        ),
    ],
)
def test_lone_surrogate_is_400_naming_the_field(client, path, body, field):
    r = post_raw(client, path, body)
    assert r.status_code == 400, r.text
    message = error_message(r)
    assert message.startswith(f"{field}: ") and "surrogate" in message, message
    # A proper pair is fine.
    r = client.post("/tokenize", json={"text": "\U0001f600"})
    assert r.status_code == 200


def test_rid_length_is_bounded(client):
    r = client.post("/generate", json={"text": "Hi", "rid": "r" * 512, "sampling_params": TINY})
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == "r" * 512
    r = client.post("/generate", json={"text": ["a", "b"], "rid": ["x", "r" * 513], "sampling_params": TINY})
    assert r.status_code == 400 and error_message(r).startswith("rid: "), r.text


# ---- property-based fuzzing -------------------------------------------------------------

# Hostile values: integers of every size (the int32/int64/uint64 edges included), floats,
# text with lone surrogates, nulls, and nested JSON values.
EDGE_INTS = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -1, 0])
NUMBERS = st.one_of(st.integers(-3, 5), st.integers(), EDGE_INTS, st.floats(allow_nan=False, allow_infinity=False))
TEXT = st.one_of(st.text(max_size=20), st.sampled_from(["\ud800", "a\udfffb", "\U0001f600", "", " "]))
JSON = st.recursive(
    st.none() | st.booleans() | NUMBERS | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
HOSTILE = st.one_of(NUMBERS, TEXT, JSON)

# Valid requests (token budgets stay tiny so that accepted requests finish fast), which
# `with_hostile_fields` then spoils in up to three places, so that most requests get past
# the first check and each layer of validation is reached.
PROMPT = st.text(min_size=1, max_size=40)
IDS = st.lists(st.integers(0, 1535), min_size=1, max_size=8)
SAMPLING = {
    "max_new_tokens": st.integers(0, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.sampled_from([-1, 1, 5, 10**9]),
    "min_p": st.floats(0, 1),
    "n": st.integers(1, 3),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "sampling_seed": st.integers(0, 2**63 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 1535), max_size=2),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
}
GENERATE_BODIES = st.fixed_dictionaries(
    {
        "sampling_params": st.fixed_dictionaries(
            {"max_new_tokens": SAMPLING["max_new_tokens"]},
            optional={k: v for k, v in SAMPLING.items() if k != "max_new_tokens"},
        ),
    },
    optional={
        "stream": st.booleans(),
        "return_logprob": st.booleans(),
        "top_logprobs_num": st.integers(0, 5),
        "rid": st.text(min_size=1, max_size=10),
    },
).flatmap(
    lambda body: st.one_of(
        st.fixed_dictionaries(
            {
                **{k: st.just(v) for k, v in body.items()},
                "text": st.one_of(PROMPT, st.lists(PROMPT, min_size=1, max_size=3)),
            }
        ),
        st.fixed_dictionaries(
            {
                **{k: st.just(v) for k, v in body.items()},
                "input_ids": st.one_of(IDS, st.lists(IDS, min_size=1, max_size=3)),
            }
        ),
    )
)
OPENAI_SAMPLING = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": SAMPLING["top_k"],
    "min_p": st.floats(0, 1),
    "n": st.integers(1, 3),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=2)),
    "stop_token_ids": SAMPLING["stop_token_ids"],
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "min_tokens": st.integers(0, 1),
    "user": st.text(max_size=5),
}
COMPLETION_BODIES = st.fixed_dictionaries(
    {
        "model": st.just("m"),
        "max_tokens": st.integers(1, 3),
        "prompt": st.one_of(
            PROMPT, st.lists(PROMPT, min_size=1, max_size=3), IDS, st.lists(IDS, min_size=1, max_size=3)
        ),
    },
    optional={**OPENAI_SAMPLING, "echo": st.booleans(), "logprobs": st.integers(0, 5)},
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant"]),
            "content": st.one_of(
                PROMPT,
                st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": PROMPT}), min_size=1, max_size=2),
            ),
        }
    ),
    min_size=1,
    max_size=3,
)
CHAT_BODIES = st.fixed_dictionaries(
    {"model": st.just("m"), "max_tokens": st.integers(1, 3), "messages": MESSAGES},
    optional={**OPENAI_SAMPLING, "logprobs": st.booleans()},
)
# Where the spoilt values go: every field of the routes (a few unknown ones too).
GENERATE_KEYS = [
    "text",
    "input_ids",
    "rid",
    "stream",
    "return_logprob",
    "top_logprobs_num",
    "logprob_start_len",
    "sampling_params",
    "bogus",
    *[f"sampling_params.{k}" for k in [*SAMPLING, "bogus"]],
]
OPENAI_KEYS = [
    "model",
    "max_tokens",
    "prompt",
    "echo",
    "logprobs",
    "top_logprobs",
    "messages",
    "messages.0",
    "messages.0.content",
    "messages.0.role",
    "tool_choice",
    "response_format",
    "logit_bias",
    "stream_options",
    "max_completion_tokens",
    "bogus",
    *OPENAI_SAMPLING,
]


def with_hostile_fields(valid: st.SearchStrategy, keys: list[str]) -> st.SearchStrategy:
    """`valid` bodies with up to three fields (dotted paths into `keys`) set to hostile values."""

    @st.composite
    def spoil(draw) -> dict:
        body = draw(valid)
        for _ in range(draw(st.integers(0, 3))):
            *parents, last = draw(st.sampled_from(keys)).split(".")
            target = body
            for part in parents:
                target = target[int(part)] if isinstance(target, list) else target.get(part)
                if not isinstance(target, (dict, list)) or (isinstance(target, list) and not target):
                    break
            else:
                if isinstance(target, dict):
                    target[last] = draw(HOSTILE)
                elif last.isdigit() and int(last) < len(target):
                    target[int(last)] = draw(HOSTILE)
        return body

    return spoil()


FUZZ = settings(
    max_examples=250, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


def send_and_check(client: httpx.Client, path: str, body: dict) -> None:
    """POST `body` (lone surrogates escaped as JSON allows); any 5xx or a dropped
    connection fails. A streamed answer is read to its end."""
    content = json.dumps(body)
    with client.stream("POST", path, content=content, headers={"content-type": "application/json"}) as r:
        data = r.read()
    assert r.status_code == 200 or 400 <= r.status_code < 500, (path, content[:500], r.status_code, data[:500])
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        assert data.rstrip().endswith(b"data: [DONE]"), (path, content[:500], data[-500:])
        assert b'"InternalServerError"' not in data, (path, content[:500], data[-500:])


@pytest.mark.parametrize(
    "path, bodies",
    [
        ("/generate", with_hostile_fields(GENERATE_BODIES, GENERATE_KEYS)),
        ("/v1/completions", with_hostile_fields(COMPLETION_BODIES, OPENAI_KEYS)),
        ("/v1/chat/completions", with_hostile_fields(CHAT_BODIES, OPENAI_KEYS)),
    ],
)
def test_fuzz_generation_routes_never_5xx(client, path, bodies):
    @FUZZ
    @given(body=bodies)
    def check(body: dict) -> None:
        send_and_check(client, path, body)
        assert client.get("/health").status_code == 200

    check()
    assert_memory_idle(client)


# Operations schemathesis leaves out: they change the server's state for everyone.
SCHEMATHESIS_SKIP = ("profile", "abort_request", "flush_cache")


def test_schemathesis_openapi_cases_never_5xx(server, client):
    """Schema-valid and schema-violating cases for every operation in /openapi.json."""
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    operations = [op for op in operations if not any(skip in op.path for skip in SCHEMATHESIS_SKIP)]
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= {op.path for op in operations}
    cases = st.one_of(
        *[op.as_strategy(mode) for op in operations for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
    )

    @settings(FUZZ, max_examples=150)
    @given(case=cases)
    def check(case) -> None:
        if isinstance(case.body, dict):  # keep accepted generations short
            for key in ("max_tokens", "max_completion_tokens"):
                if not isinstance(case.body.get(key), int) or case.body[key] > 3:
                    case.body[key] = 3
        response = case.call(base_url=server.base_url, timeout=60)
        assert response.status_code < 500, (
            case.method,
            case.path,
            case.body,
            response.status_code,
            response.text[:500],
        )
        assert client.get("/health").status_code == 200

    check()
    assert_memory_idle(client)
