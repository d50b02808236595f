"""/v1/responses output items and streamed events (tandem/entrypoints/openai/serving_responses.py)
in-process: under `--reasoning-parser` the think block is a reasoning item before the
message, non-streamed and streamed alike, however the text is split into pieces."""

from __future__ import annotations

import json

import pytest

from tandem.entrypoints.openai.protocol import ResponsesRequest
from tandem.entrypoints.openai.serving_responses import ResponsesStreamConverter, output_items

TEXT = "<think>\n six times seven </think>\n\nIt is 42."
META = {"prompt_tokens": 5, "completion_tokens": 9, "finish_reason": {"type": "stop"}}


def events_of(chunks: list[bytes]) -> list[dict]:
    out = []
    for chunk in chunks:
        head, data = chunk.decode().split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        out.append(event)
    return out


def stream(text: str, cuts: list[int], in_reasoning: bool | None) -> list[dict]:
    conv = ResponsesStreamConverter(ResponsesRequest(input="x"), "m", 0, in_reasoning)
    chunks = conv.start()
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        chunks += conv.on_output({"text": text[a:b], "meta_info": META})
    return events_of(chunks + conv.end())


def strip_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


def test_the_think_block_is_a_reasoning_item_before_the_message():
    items = output_items(TEXT, in_reasoning=False)
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "six times seven"}]
    assert items[0]["id"].startswith("rs_") and items[0]["summary"] == []
    assert items[1]["content"][0]["text"] == "It is 42."
    assert strip_ids(output_items(TEXT, None)) == strip_ids(
        [{**items[1], "content": [{**items[1]["content"][0], "text": TEXT}]}]
    )
    assert [i["type"] for i in output_items("It is 42.", False)] == ["message"]  # no block: all content
    assert [i["type"] for i in output_items("still thinking", True)] == ["reasoning"]  # never closed


@pytest.mark.parametrize("cut", range(1, len(TEXT)))
def test_streamed_events_match_the_whole_output(cut):
    events = stream(TEXT, [cut, min(cut + 3, len(TEXT))], in_reasoning=False)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2]["item"]["type"] == "reasoning" and events[2]["output_index"] == 0
    done = types.index("response.reasoning_text.done")
    assert types[done + 1 : done + 4] == [
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert all(t != "response.output_text.delta" for t in types[:done])  # the message comes after
    assert all(t != "response.reasoning_text.delta" for t in types[done:])
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (reasoning, text) == ("six times seven", "It is 42.")
    assert {e["output_index"] for e in events if e["type"] == "response.output_text.delta"} == {1}
    final = events[-1]
    assert final["type"] == "response.completed"
    assert strip_ids(final["response"]["output"]) == strip_ids(output_items(TEXT, False))
    assert final["response"]["usage"]["prompt_tokens"] == 5 and final["response"]["usage"]["input_tokens"] == 5


def test_without_a_parser_the_block_stays_in_the_message():
    events = stream(TEXT, [4, 9], in_reasoning=None)
    assert "response.reasoning_text.delta" not in [e["type"] for e in events]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == TEXT
