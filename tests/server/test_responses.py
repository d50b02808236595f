"""POST /v1/responses (OpenAI's Responses API, plain text) through the official `openai`
client, non-streamed and streamed, against /v1/chat/completions on the same prompt."""

from __future__ import annotations

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60, max_retries=0)


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]


def _chat_text(oai, max_tokens: int) -> str:
    chat = oai.chat.completions.create(model="default", messages=MESSAGES, max_tokens=max_tokens, temperature=0)
    return chat.choices[0].message.content


def test_responses_create_matches_chat(oai):
    resp = oai.responses.create(
        model="default",
        instructions="Be brief.",
        input="Tell me a story.",
        max_output_tokens=6,
        temperature=0,
        metadata={"k": "v"},
    )
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == "default"
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == _chat_text(oai, 6)
    message = resp.output[0]
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert resp.usage.output_tokens == 6 and resp.usage.total_tokens == resp.usage.input_tokens + 6
    # SGLang's usage keys beside OpenAI's (its tests read them).
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (resp.usage.input_tokens, 6)
    assert resp.metadata == {"k": "v"} and resp.max_output_tokens == 6 and resp.error is None
    # The same conversation as a message list, content as parts.
    items = [
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a story."}]},
    ]
    again = oai.responses.create(model="default", input=items, max_output_tokens=6, temperature=0)
    assert again.output_text == resp.output_text and again.usage.input_tokens == resp.usage.input_tokens


def test_responses_stream_events(oai):
    with oai.responses.create(
        model="default",
        instructions="Be brief.",
        input="Tell me a story.",
        max_output_tokens=6,
        temperature=0,
        stream=True,
    ) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == _chat_text(oai, 6)
    final = events[-1].response
    assert final.output_text == deltas and final.usage.output_tokens == 6


def test_responses_refuses_unsupported_fields(oai):
    for extra, name in (
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"background": True}, "background"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input.0.content"),
    ):
        kwargs = {"model": "default", "input": "Hi", **extra}
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(**kwargs)
        assert e.value.status_code == 400 and e.value.body["message"].startswith(name), (extra, e.value.body)


def test_responses_errors_nest_under_error(server):
    """SGLang's test_error: /v1/responses errors are `{"error": {"message", "type", "code"}}`
    (OpenAI's shape), request-validation errors too; other routes keep SGLang's flat shape."""
    for body, param in (
        ({"input": "Hi", "previous_response_id": "bad"}, "previous_response_id"),
        ({"input": "Hi", "temperature": 5}, "temperature"),
    ):
        r = httpx.post(server.base_url + "/v1/responses", json={"model": "default", **body}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == 400 and error["type"] == "BadRequestError" and error["param"] == param, error
        assert error["message"].startswith(param)
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": [], "model": "m"}, timeout=60)
    assert r.status_code == 400 and r.json()["object"] == "error", r.text
