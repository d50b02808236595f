"""POST /v1/messages (Anthropic's Messages API) on a real server: a tiny random-weight
llama with `--reasoning-parser qwen3`, `--api-key`, and a ChatML template whose
`enable_thinking` opens the think block (so `thinking: enabled` makes the output start
inside it). The route is a translation onto the chat pipeline: its text and usage equal
/v1/chat/completions' for the same greedy request, streamed deltas join to the whole
text, thinking enabled answers a thinking block and disabled none, bad input is a 400 in
Anthropic's shape naming the field, and `x-api-key` is accepted beside `Authorization`."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from server_launcher import ServerHandle

TEMPLATE = Path(__file__).parent.parent / "fixtures" / "reasoning" / "thinking_switch_template.jinja"
KEY = "sk-anthropic-test"
PROMPT = "What is six times seven?"


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    args = ["--reasoning-parser", "qwen3", "--chat-template", str(TEMPLATE), "--api-key", KEY]
    with ServerHandle(tiny_llama_dir, args) as h:
        yield h


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120, headers={"x-api-key": KEY}) as c:
        yield c


def _body(**kw) -> dict:
    return {"max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": PROMPT}], **kw}


def _post(http, body) -> dict:
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _events(http, body) -> list[tuple[str, dict]]:
    """The stream's (event, data) pairs; every data line follows its event line."""
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    pairs = []
    for name, data in zip(lines[::2], lines[1::2], strict=True):
        assert name.startswith("event: ") and data.startswith("data: "), (name, data)
        payload = json.loads(data[6:])
        assert payload["type"] == name[7:]
        pairs.append((name[7:], payload))
    return pairs


def test_text_and_usage_equal_the_chat_routes(http):
    msg = _post(http, _body())
    chat = http.post(
        "/v1/chat/completions",
        json={"max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": PROMPT}]},
    ).json()
    assert msg["id"].startswith("msg_") and msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["content"] == [{"type": "text", "text": chat["choices"][0]["message"]["content"]}]
    assert msg["usage"] == {
        "input_tokens": chat["usage"]["prompt_tokens"],
        "output_tokens": chat["usage"]["completion_tokens"],
    }
    assert msg["stop_reason"] == "max_tokens" and msg["stop_sequence"] is None


def test_system_and_text_blocks_render_as_chat_messages(http):
    blocks = _post(
        http,
        _body(
            system=[{"type": "text", "text": "Be brief."}],
            messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        ),
    )
    chat = http.post(
        "/v1/chat/completions",
        json={
            "max_tokens": 12,
            "temperature": 0,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}],
        },
    ).json()
    assert blocks["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert blocks["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]


def test_streamed_deltas_join_to_the_whole_text(http):
    whole = _post(http, _body())
    events = _events(http, _body())
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and names[-3] == "content_block_stop"
    assert events[0][1]["message"]["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == whole["content"][0]["text"]
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


def test_thinking_enabled_answers_a_thinking_block_and_disabled_none(http):
    on = _post(http, _body(thinking={"type": "enabled", "budget_tokens": 1024}))
    assert on["content"][0]["type"] == "thinking" and on["content"][0]["thinking"], on
    assert on["content"][0]["signature"] == ""
    off = _post(http, _body(thinking={"type": "disabled"}))
    assert [b["type"] for b in off["content"]] == ["text"], off
    assert "<think>" not in off["content"][0]["text"] and "</think>" not in off["content"][0]["text"]
    # The switch reaches the template: disabled renders the closed empty block.
    assert off["usage"]["input_tokens"] > on["usage"]["input_tokens"]


def test_thinking_streams_as_thinking_deltas(http):
    body = _body(thinking={"type": "enabled"})
    whole = _post(http, body)
    events = _events(http, body)
    assert events[1] == (
        "content_block_start",
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "thinking", "thinking": "", "signature": ""},
        },
    )
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == whole["content"][0]["thinking"]
    assert {"type": "signature_delta", "signature": ""} in deltas
    off = _events(http, _body(thinking={"type": "disabled"}))
    assert all(d["delta"]["type"] == "text_delta" for n, d in off if n == "content_block_delta")


def test_stop_sequence_is_reported(http):
    text = _post(http, _body())["content"][0]["text"]
    word = text.split()[1] if len(text.split()) > 1 else text[1:3]
    msg = _post(http, _body(stop_sequences=[word]))
    assert msg["stop_reason"] == "stop_sequence" and msg["stop_sequence"] == word, (text, msg)
    final = _events(http, _body(stop_sequences=[word]))[-2][1]
    assert final["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": word}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"role": "user", "content": PROMPT}]}, "max_tokens"),
        ({"max_tokens": 8, "messages": []}, "messages"),
        ({"max_tokens": 8, "messages": [{"role": "tool", "content": PROMPT}]}, "messages.0.role"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages.0.content"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": PROMPT}], "stop_sequences": "x"}, "stop_sequences"),
    ],
)
def test_bad_input_is_an_anthropic_400_naming_the_field(http, body, field):
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert err["error"]["message"].startswith(field), err
    assert http.get("/health").status_code == 200


def test_api_key_as_bearer_or_x_api_key(server):
    url = server.base_url + "/v1/messages"
    assert httpx.post(url, json=_body(max_tokens=1), headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    for headers in ({}, {"x-api-key": "wrong"}):
        r = httpx.post(url, json=_body(max_tokens=1), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    # x-api-key is accepted on the OpenAI routes too.
    chat = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"max_tokens": 1, "messages": [{"role": "user", "content": PROMPT}]},
        headers={"x-api-key": KEY},
    )
    assert chat.status_code == 200, chat.text
