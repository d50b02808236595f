"""Qwen 2.5 tool calls (`--tool-call-parser qwen25`, or `qwen`): each call is
`<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, several in a row; text
before the first is content. A block the output ends inside is parsed if its JSON is
whole (the model stopped before `</tool_call>`)."""

from __future__ import annotations

from tandem.function_call.base_format_detector import WAIT, BaseFormatDetector, Piece, partial_suffix_len

BOT_TOKEN = "<tool_call>"
EOT_TOKEN = "</tool_call>"


class Qwen25Detector(BaseFormatDetector):
    def _scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        pieces: list[Piece] = []
        pos = 0
        while pos < len(text):
            start = text.find(BOT_TOKEN, pos)
            if start == -1:
                end = len(text) if final else len(text) - partial_suffix_len(text[pos:], BOT_TOKEN)
                pieces.append(text[pos:end])
                return pieces, end
            pieces.append(text[pos:start])
            body_start = start + len(BOT_TOKEN)
            close = text.find(EOT_TOKEN, body_start)
            if close == -1 and not final:
                return pieces, start
            body_end = len(text) if close == -1 else close
            stop = len(text) if close == -1 else close + len(EOT_TOKEN)
            pieces.append(self._call_in(text[body_start:body_end]) or text[start:stop])
            pos = stop
        return pieces, pos

    def _call_in(self, body: str):
        stripped = body.strip()
        if not stripped.startswith("{"):
            return None
        obj, end = self.decode_object(stripped, 0, final=True)
        return self.as_call(obj) if obj is not WAIT and end == len(stripped) else None
