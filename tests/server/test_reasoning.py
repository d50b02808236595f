"""Reasoning output on a real server (tiny random-weight llama, `--reasoning-parser qwen3`,
a ChatML template with Qwen3's `enable_thinking` switch): `chat_template_kwargs` reach
the template; an output with a think block (forced with `regex`, since a random model
writes none by chance) answers `reasoning_content` and `content` apart, streamed and
not, alike; `separate_reasoning: false` leaves the block in the content; an output that
opens no block stays all content (SGLang's known bug moves it to `reasoning_content`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from server_launcher import ServerHandle

TEMPLATE = Path(__file__).parent.parent / "fixtures" / "reasoning" / "think_template.jinja"
MESSAGES = [{"role": "user", "content": "What is six times seven?"}]
THINK_REGEX = r"<think>\n?[a-z]{1,6}( [a-z]{1,6}){1,3}\n?</think>\n?[A-Z][a-z]{1,6}( [a-z]{1,6}){0,2}"


@pytest.fixture(scope="module")
def reasoning_server(tiny_llama_dir):
    with ServerHandle(tiny_llama_dir, ["--reasoning-parser", "qwen3", "--chat-template", str(TEMPLATE)]) as h:
        yield h


@pytest.fixture(scope="module")
def http(reasoning_server):
    with httpx.Client(base_url=reasoning_server.base_url, timeout=120) as c:
        yield c


def _body(**kw) -> dict:
    return {"messages": MESSAGES, "max_tokens": 60, "temperature": 0, **kw}


def _post(http, body) -> dict:
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(http, body) -> tuple[str, str | None]:
    """(content, reasoning_content) rebuilt from the deltas; None: no reasoning delta."""
    content, reasoning = "", None
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for chunk in map(json.loads, lines[:-1]):
        for ch in chunk["choices"]:
            assert "reasoning_content" in ch["delta"]
            content += ch["delta"].get("content") or ""
            if ch["delta"]["reasoning_content"] is not None:
                reasoning = (reasoning or "") + ch["delta"]["reasoning_content"]
    return content, reasoning


def test_chat_template_kwargs_reach_the_template(http):
    plain = _post(http, _body(max_tokens=1))["usage"]["prompt_tokens"]
    off = _post(http, _body(max_tokens=1, chat_template_kwargs={"enable_thinking": False}))["usage"]["prompt_tokens"]
    on = _post(http, _body(max_tokens=1, chat_template_kwargs={"enable_thinking": True}))["usage"]["prompt_tokens"]
    assert off > plain and on == plain


def test_chat_template_kwargs_cannot_override_the_servers_arguments(http):
    r = http.post("/v1/chat/completions", json=_body(chat_template_kwargs={"tools": []}))
    assert r.status_code == 400 and r.json()["param"] == "chat_template_kwargs", r.text


def test_think_block_goes_to_reasoning_content_streamed_and_not(http):
    body = _body(regex=THINK_REGEX)
    message = _post(http, body)["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"], message
    assert re.fullmatch(r"[a-z]{1,6}( [a-z]{1,6}){1,3}", message["reasoning_content"]), message
    assert re.fullmatch(r"[A-Z][a-z]{1,6}( [a-z]{1,6}){0,2}", message["content"]), message
    assert _stream(http, body) == (message["content"], message["reasoning_content"])
    # Held to the block's end, the same text.
    assert _stream(http, {**body, "stream_reasoning": False}) == (message["content"], message["reasoning_content"])


def test_separate_reasoning_false_keeps_the_block_in_the_content(http):
    body = _body(regex=THINK_REGEX, separate_reasoning=False)
    message = _post(http, body)["choices"][0]["message"]
    assert message["reasoning_content"] is None and re.fullmatch(THINK_REGEX, message["content"]), message
    assert _stream(http, body) == (message["content"], None)


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}, {"open_think": True}])
def test_an_answer_without_a_think_block_stays_content(http, kwargs):
    """Also when the template opened the block: a grammar decides the output from its
    first token, so it never starts inside one."""
    body = _body(regex=r"[A-Z][a-z]{2,6}( [a-z]{1,6}){1,3}", chat_template_kwargs=kwargs)
    message = _post(http, body)["choices"][0]["message"]
    assert message["reasoning_content"] is None and re.fullmatch(body["regex"], message["content"]), message
    assert _stream(http, body) == (message["content"], None)


def test_an_unconstrained_answer_after_an_open_think_is_reasoning(http):
    """The template opened the block and the random model never closes it: all of its
    output is (truncated) reasoning, as the model was left inside the block."""
    body = _body(max_tokens=12, chat_template_kwargs={"open_think": True})
    message = _post(http, body)["choices"][0]["message"]
    plain = _post(http, {**body, "separate_reasoning": False})["choices"][0]["message"]
    assert "</think>" not in plain["content"]
    assert message["content"] == "" and message["reasoning_content"] == plain["content"].strip()


def test_openai_client_reads_reasoning_content(reasoning_server):
    oai = openai.OpenAI(base_url=reasoning_server.base_url + "/v1", api_key="none", max_retries=0)
    resp = oai.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=60, temperature=0, extra_body={"regex": THINK_REGEX}
    )
    assert resp.choices[0].message.reasoning_content
    assert _server_info_parser(reasoning_server) == "qwen3"


def _server_info_parser(handle) -> str | None:
    return httpx.get(handle.base_url + "/get_server_info", timeout=30).json()["reasoning_parser"]


def test_responses_route_splits_reasoning_as_chat_does(http):
    """/v1/responses under the same parser: an output that opens no think block is one
    message with chat's content, no reasoning item (the split itself: test_responses_events)."""
    chat = _post(http, _body(max_tokens=8))["choices"][0]["message"]
    r = http.post("/v1/responses", json={"input": MESSAGES[0]["content"], "max_output_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    output = r.json()["output"]
    assert [item["type"] for item in output] == ["message"], output
    assert chat["reasoning_content"] is None and output[0]["content"][0]["text"] == chat["content"]
