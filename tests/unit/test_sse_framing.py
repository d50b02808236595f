"""Server-sent event framing: every `data:` line must survive clients that split lines
the way `str.splitlines` does (httpx's `aiter_lines`, SGLang's and Tandem's
bench_serving), which also breaks on U+0085, U+2028 and U+2029. JSON allows those raw
inside strings and orjson writes them raw, so a generated token decoding to one of them
cut its chunk in two ("Unterminated string")."""

from __future__ import annotations

import json

import pytest

from tandem.entrypoints.native_routes import sse as native_sse
from tandem.entrypoints.openai.common import sse

TEXTS = [
    "plain",
    "line\u2028separator",
    "para\u2029graph",
    "next\u0085line",
    "tab\tand\nnewline\r",
    "\x1c\x1d\x1e\x0b\x0c controls",
    "é 漢字 🙂",
]


@pytest.mark.parametrize("frame", [sse, native_sse])
@pytest.mark.parametrize("text", TEXTS)
def test_each_event_is_one_line_for_splitlines_clients(frame, text):
    event = frame({"text": text, "output_ids": [1, 2]}).decode()
    assert event.endswith("\n\n")
    lines = [line for line in event.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: ") :]) == {"text": text, "output_ids": [1, 2]}
