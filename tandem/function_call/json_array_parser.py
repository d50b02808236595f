"""The output of constrained tool calls: `tool_choice` required makes a JSON array of
`{"name", "parameters"}` objects (`JsonArrayParser`); a named function makes its
arguments object alone (`NamedFunctionParser`). Whatever does not parse (an output cut
by max_tokens) is content."""

from __future__ import annotations

from tandem.function_call.base_format_detector import WAIT, BaseFormatDetector, Piece, skip_chars

_SPACE = " \t\r\n"


class JsonArrayParser(BaseFormatDetector):
    def __init__(self, tool_names):
        super().__init__(tool_names)
        self._state = "before"  # before `[`, "items", "after" `]` (or text)

    def _scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        pieces: list[Piece] = []
        pos = 0
        while pos < len(text) and self._state != "after":
            pos = skip_chars(text, pos, _SPACE + ("," if self._state == "items" else ""))
            if pos == len(text):
                return pieces, pos
            if self._state == "before" and text[pos] == "[":
                self._state, pos = "items", pos + 1
            elif self._state == "items" and text[pos] == "]":
                self._state, pos = "after", pos + 1
            elif self._state == "items" and text[pos] == "{":
                obj, end = self.decode_object(text, pos, final)
                if obj is WAIT:
                    return pieces, pos
                pieces.append(self.as_call(obj) or text[pos:end])
                pos = end
            else:
                self._state = "after"
        pieces.append(text[pos:])
        return pieces, len(text)


class NamedFunctionParser(BaseFormatDetector):
    """The whole output is the arguments of the function `name`."""

    def __init__(self, name: str):
        super().__init__([name])
        self.name = name
        self._done = False

    def _scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        pieces: list[Piece] = []
        pos = 0
        if not self._done:
            pos = skip_chars(text, 0, _SPACE)
            if pos == len(text) and not final:
                return pieces, 0
            if pos < len(text) and text[pos] == "{":
                obj, end = self.decode_object(text, pos, final)
                if obj is WAIT:
                    return pieces, 0
                pieces.append(self.as_call(obj, self.name) or text[pos:end])
                pos = end
            self._done = True
        pieces.append(text[pos:])
        return pieces, len(text)
