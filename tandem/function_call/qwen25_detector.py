"""Qwen 2.5 tool calls (`--tool-call-parser qwen25`, or `qwen`): each call is
`<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, several in a row; text
before the first is content. A block the output ends inside is parsed if its JSON is
whole (the model stopped before `</tool_call>`)."""

from __future__ import annotations

from tandem.function_call.base_format_detector import WAIT, TaggedBlockDetector

BOT_TOKEN = "<tool_call>"
EOT_TOKEN = "</tool_call>"


class Qwen25Detector(TaggedBlockDetector):
    START, END = BOT_TOKEN, EOT_TOKEN

    def _calls_in(self, body: str):
        stripped = body.strip()
        if not stripped.startswith("{"):
            return None
        obj, end = self.decode_object(stripped, 0, final=True)
        call = self.as_call(obj) if obj is not WAIT and end == len(stripped) else None
        return [call] if call else None
