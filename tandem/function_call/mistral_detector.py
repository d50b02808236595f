"""Mistral tool calls (`--tool-call-parser mistral`): `[TOOL_CALLS] [{"name": "f",
"arguments": {...}}, ...]` (a JSON array after the marker), or the newer form
`[TOOL_CALLS]f[ARGS]{...}`, one marker per call. Text before the first marker is content;
a call whose JSON is malformed, or that names a function not in the tools, stays in the
text."""

from __future__ import annotations

from tandem.function_call.base_format_detector import (
    WAIT,
    BaseFormatDetector,
    Piece,
    partial_suffix_len,
    skip_chars,
)

BOT_TOKEN = "[TOOL_CALLS]"
ARGS_TOKEN = "[ARGS]"
_SPACE = " \t\r\n"


class MistralDetector(BaseFormatDetector):
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
            found, end = self._calls_at(text, skip_chars(text, start + len(BOT_TOKEN), _SPACE), final)
            if found is WAIT:
                return pieces, start
            pieces.extend(found or [text[start:end]])
            pos = end
        return pieces, pos

    def _calls_at(self, text: str, pos: int, final: bool):
        """The calls after a marker (its end at `pos`) and where they end; (WAIT, pos) while
        they may be incomplete, (None, end) when they are not calls."""
        if pos == len(text):
            return (None, pos) if final else (WAIT, pos)
        if text[pos] == "[":  # [TOOL_CALLS] [{...}, ...]
            items, end = self.decode_object(text, pos, final)
            if items is WAIT:
                return WAIT, pos
            calls = [self.as_call(item) for item in items] if isinstance(items, list) else []
            return (calls if calls and all(calls) else None), end
        args = text.find(ARGS_TOKEN, pos)  # [TOOL_CALLS]name[ARGS]{...}
        if args == -1:
            name_so_far = text[pos : len(text) - partial_suffix_len(text[pos:], ARGS_TOKEN)]
            if final or any(c in name_so_far for c in _SPACE + "{[") or len(name_so_far) > 256:
                return None, (len(text) if final else pos)
            return WAIT, pos
        name, body = text[pos:args].strip(), skip_chars(text, args + len(ARGS_TOKEN), _SPACE)
        if body == len(text):
            return (None, body) if final else (WAIT, pos)
        if text[body] != "{":
            return None, body
        obj, end = self.decode_object(text, body, final)
        if obj is WAIT:
            return WAIT, pos
        call = self.as_call(obj, name)
        return ([call] if call else None), end
