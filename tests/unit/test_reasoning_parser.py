"""tandem/reasoning_parser.py: the whole text's reasoning and content, and the same from
every split of it into two and three streamed pieces (and one character at a time),
streamed reasoning or held to the block's end."""

from __future__ import annotations

import itertools
import json

import pytest

from tandem.reasoning_parser import (
    ReasoningResult,
    ReasoningStream,
    parse_reasoning,
    prompt_opens_think,
    starts_in_reasoning,
)

# (text, starts in reasoning, expected reasoning, expected content)
CASES = [
    ("<think>I think.</think>The answer.", False, "I think.", "The answer."),
    ("\n<think>\n  a b\n c \n</think>\n\n Done. \n", False, "a b\n c", "Done. \n"),
    ("Just an answer, no block.", False, "", "Just an answer, no block."),
    ("  leading space answer", False, "", "  leading space answer"),
    ("The <think>late</think> tag is content", False, "", "The <think>late</think> tag is content"),
    ("<thinker>not a tag", False, "", "<thinker>not a tag"),
    ("<thi", False, "", "<thi"),
    ("", False, "", ""),
    ("   ", False, "", "   "),
    ("<think>cut off by max_tokens </th", False, "cut off by max_tokens </th", ""),
    ("<think></think>", False, "", ""),
    ("<think>\n\n</think>\n\nOnly content.", False, "", "Only content."),
    ("<think>a < b </ c </thin k</think>x</think>y", False, "a < b </ c </thin k", "x</think>y"),
    ("<think>nested <think> stays</think>ok", False, "nested <think> stays", "ok"),
    # The template opened the block (deepseek-r1, or a qwen3 prompt ending in <think>).
    ("Reasoning first.</think>\n\nAnswer.", True, "Reasoning first.", "Answer."),
    ("<think>R1-0528 writes it again</think>A", True, "R1-0528 writes it again", "A"),
    ("no end tag at all", True, "no end tag at all", ""),
    ("  <thi", True, "<thi", ""),
    ("</think>straight to the answer", True, "", "straight to the answer"),
    ("a </thi", True, "a </thi", ""),
]


def _stream(pieces: list[str], in_reasoning: bool, stream_reasoning: bool = True) -> ReasoningResult:
    parser = ReasoningStream(in_reasoning, stream_reasoning)
    out = ReasoningResult()
    for piece in pieces:
        out = out.merged(parser.feed(piece))
    return out.merged(parser.finish())


def _splits(text: str):
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize(("text", "in_reasoning", "reasoning", "content"), CASES)
def test_whole_text(text, in_reasoning, reasoning, content):
    assert parse_reasoning(text, in_reasoning) == ReasoningResult(reasoning, content)


@pytest.mark.parametrize("stream_reasoning", [True, False])
@pytest.mark.parametrize(("text", "in_reasoning", "reasoning", "content"), CASES)
def test_every_streamed_split_gives_the_whole_texts_result(text, in_reasoning, reasoning, content, stream_reasoning):
    for pieces in _splits(text):
        assert _stream(pieces, in_reasoning, stream_reasoning) == ReasoningResult(reasoning, content), pieces


def test_an_answer_without_a_block_streams_as_content_at_once():
    """Not held back past the first characters that cannot begin <think>."""
    parser = ReasoningStream(in_reasoning=False)
    assert parser.feed("<") == ReasoningResult()
    assert parser.feed("b>old") == ReasoningResult(content="<b>old")
    assert parser.feed(" text") == ReasoningResult(content=" text")


def test_reasoning_streams_as_it_comes_and_holds_only_a_possible_end_tag():
    parser = ReasoningStream(in_reasoning=False)
    assert parser.feed("<think>Let me") == ReasoningResult(reasoning="Let me")
    assert parser.feed(" see </") == ReasoningResult(reasoning=" see")
    assert parser.feed("think> 42") == ReasoningResult(content="42")


def test_held_reasoning_goes_out_when_the_block_closes():
    parser = ReasoningStream(in_reasoning=False, stream_reasoning=False)
    assert parser.feed("<think>Let me") == ReasoningResult()
    assert parser.feed(" see</think>42") == ReasoningResult(reasoning="Let me see", content="42")


def test_prompt_decides_where_a_qwen3_output_starts():
    opened = "<|im_start|>assistant\n<think>\n"
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    plain = "<|im_start|>assistant\n"
    assert prompt_opens_think(opened) and not prompt_opens_think(closed) and not prompt_opens_think(plain)
    assert starts_in_reasoning("qwen3", opened) and not starts_in_reasoning("qwen3", closed)
    assert not starts_in_reasoning("qwen3", plain)
    assert starts_in_reasoning("deepseek-r1", plain) and starts_in_reasoning("qwen3-thinking", plain)


# ---- on the chat route: reasoning is split off before the tool-call detector --------------

TOOL_TEXT = (
    '<think>Maybe <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> later.</think>\n'
    'Calling.\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
)


def _meta(completion_tokens, finish=None):
    return {"id": "r", "finish_reason": finish, "prompt_tokens": 9, "completion_tokens": completion_tokens}


def test_tool_calls_in_the_think_block_are_reasoning_and_after_it_are_calls():
    from tandem.entrypoints.openai.serving_chat import ChatStreamConverter, build_chat_response
    from tandem.function_call.qwen25_detector import Qwen25Detector

    def detector():
        return Qwen25Detector(["get_time"])

    out = {"text": TOOL_TEXT, "meta_info": _meta(30, {"type": "stop", "matched": None})}
    message = build_chat_response("c", "m", [out], 1, False, make_detector=detector, in_reasoning=False).model_dump()
    message = message["choices"][0]["message"]
    assert message["reasoning_content"].startswith("Maybe <tool_call>") and message["content"] == "Calling."
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"timezone": "UTC"}]

    conv = ChatStreamConverter("c", "m", 1, 1, False, False, make_detector=detector, in_reasoning=False)
    chunks = []
    for i in range(0, len(TOOL_TEXT), 7):
        last = i + 7 >= len(TOOL_TEXT)
        piece = {
            "text": TOOL_TEXT[i : i + 7],
            "meta_info": _meta(i, {"type": "stop", "matched": None} if last else None),
        }
        chunks += conv.on_output(0, piece)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d["reasoning_content"] or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas).strip() == "Calling."
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"timezone": "UTC"}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
