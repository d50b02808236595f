"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (`--tool-call-parser llama3`).

The model answers a call with `{"name": "f", "parameters": {...}}` (or `"arguments"`),
either as the whole output or after `<|python_tag|>`; several calls are separated by
`;`. Text before `<|python_tag|>` is content; output that starts with other text is all
content (a `{` after text is not a call), as in SGLang.
"""

from __future__ import annotations

from tandem.function_call.base_format_detector import WAIT, BaseFormatDetector, Piece, partial_suffix_len, skip_chars

PYTHON_TAG = "<|python_tag|>"
# Between two calls: the separator and any whitespace.
_BETWEEN_CALLS = " \t\r\n;"


class Llama32Detector(BaseFormatDetector):
    def __init__(self, tool_names):
        super().__init__(tool_names)
        self._in_calls = False  # past `<|python_tag|>` or a leading `{`
        self._started = False  # some text came first: a `{` now is text

    def _scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        pieces: list[Piece] = []
        pos = 0
        while pos < len(text):
            if self._in_calls:
                pos = skip_chars(text, pos, _BETWEEN_CALLS)
                if pos == len(text):
                    break
                if text[pos] == "{":
                    obj, end = self.decode_object(text, pos, final)
                    if obj is WAIT:
                        return pieces, pos
                    pieces.append(self.as_call(obj) or text[pos:end])
                    pos = end
                    continue
                self._in_calls, self._started = False, True
                continue
            tag = text.find(PYTHON_TAG, pos)
            if tag != -1:
                pieces.append(text[pos:tag].rstrip())  # the tag's neighbour, like a call's
                self._in_calls, self._started = True, True
                pos = tag + len(PYTHON_TAG)
                continue
            rest = text[pos:]
            if not self._started and rest.lstrip().startswith("{"):
                self._in_calls = True
                pos += len(rest) - len(rest.lstrip())
                continue
            if not self._started and not rest.strip() and not final:
                break  # only whitespace so far: a call may still start the output
            end = len(text) if final else len(text) - partial_suffix_len(rest, PYTHON_TAG)
            if text[pos:end].strip():
                self._started = True
            pieces.append(text[pos:end])
            pos = end
            break
        return pieces, pos
