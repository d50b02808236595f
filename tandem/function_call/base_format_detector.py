"""The base of every tool-call detector: one scanner per call format, used both on a
whole output and on a stream of pieces, with the same result either way.

A detector turns model output into `content` text and calls. A subclass writes one
method, `_scan(text, final)`: split `text` into pieces (text, or a decoded call) and say
how much of it is settled; the rest waits for more output unless `final`. On a stream,
each new piece is appended to what waited, so a call split over several pieces is
parsed once whole. Text that touches a call (the newline before `<tool_call>`, the one
after `</tool_call>`) is dropped; a call whose JSON is malformed, or that names a
function not in the request's tools, stays in the text.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from tandem.function_call.core_types import StreamingParseResult, ToolCallItem

logger = logging.getLogger(__name__)

_DECODER = json.JSONDecoder()
# `_decode_object`'s answer when the object may still be incomplete.
WAIT = object()


@dataclass(frozen=True)
class DecodedCall:
    """A call found in the output: the function's name and its arguments object."""

    name: str
    arguments: dict[str, Any]


Piece = str | DecodedCall


def partial_suffix_len(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `token` (text
    that may become `token` with the next piece)."""
    for k in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-k:]):
            return k
    return 0


def skip_chars(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


class BaseFormatDetector(ABC):
    """Finds the calls of one format in one output (make one per choice)."""

    def __init__(self, tool_names: Collection[str]):
        self.tool_names = frozenset(tool_names)
        self._buffer = ""
        self._num_calls = 0
        self._after_call = False

    @abstractmethod
    def _scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        """Pieces of `text` and how many of its characters they cover. Without `final`,
        the uncovered rest (a call still open, a partial marker) is scanned again with the
        next output. A last text piece that ends in whitespace must end where the covered
        part ends (that whitespace is held back: it may precede a call). May update the
        detector's state for the covered part only."""

    def detect_and_parse(self, text: str) -> StreamingParseResult:
        """A whole output at once."""
        return self.parse_streaming_increment(text).merged(self.finish())

    def parse_streaming_increment(self, new_text: str) -> StreamingParseResult:
        """The next piece of a streamed output: what became settled."""
        self._buffer += new_text
        pieces, covered = self._scan(self._buffer, final=False)
        if pieces and isinstance(pieces[-1], str):
            # Whitespace at the end may precede a call, whose neighbours are dropped.
            kept = pieces[-1].rstrip()
            covered -= len(pieces[-1]) - len(kept)
            pieces[-1] = kept
        self._buffer = self._buffer[covered:]
        return self._result(pieces)

    def finish(self) -> StreamingParseResult:
        """The end of the output: whatever waited, as calls or text."""
        pieces, _ = self._scan(self._buffer, final=True)
        self._buffer = ""
        return self._result(pieces)

    def _result(self, pieces: list[Piece]) -> StreamingParseResult:
        result = StreamingParseResult()
        for i, piece in enumerate(pieces):
            if isinstance(piece, DecodedCall):
                result.calls.append(
                    ToolCallItem(self._num_calls, piece.name, json.dumps(piece.arguments, ensure_ascii=False))
                )
                self._num_calls += 1
                self._after_call = True
                continue
            if self._after_call:
                piece = piece.lstrip()
            if i + 1 < len(pieces) and isinstance(pieces[i + 1], DecodedCall):
                piece = piece.rstrip()
            if piece:
                result.normal_text += piece
                self._after_call = False
        return result

    def as_call(self, obj: Any, name: str | None = None) -> DecodedCall | None:
        """`obj` as a call: `{"name": <a tool>, "parameters" or "arguments": {...}}`, or,
        with `name`, the arguments object itself. None when it is not one."""
        if not isinstance(obj, dict):
            return None
        if name is None:
            name = obj.get("name")
            obj = obj.get("parameters", obj.get("arguments", {}))
        if name not in self.tool_names or not isinstance(obj, dict):
            logger.debug("not a call of the request's tools: %.200r", obj)
            return None
        return DecodedCall(name, obj)

    @staticmethod
    def decode_object(text: str, pos: int, final: bool) -> tuple[Any, int]:
        """The JSON value at `text[pos]` (a `{`) and where it ends; (WAIT, pos) while it
        may still be incomplete, (None, len(text)) when it cannot be decoded."""
        try:
            return _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return (None, len(text)) if final else (WAIT, pos)


class TaggedBlockDetector(BaseFormatDetector):
    """Calls in blocks between `START` and `END` tags, several in a row; text outside is
    content. A block the output ends inside is parsed if what it holds is whole; a block
    that holds no calls stays in the text. A subclass gives the tags and `_calls_in`."""

    START = ""
    END = ""

    def _calls_in(self, body: str) -> list[DecodedCall] | None:
        raise NotImplementedError

    def _scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        pieces: list[Piece] = []
        pos = 0
        while pos < len(text):
            start = text.find(self.START, pos)
            if start == -1:
                end = len(text) if final else len(text) - partial_suffix_len(text[pos:], self.START)
                pieces.append(text[pos:end])
                return pieces, end
            pieces.append(text[pos:start])
            body_start = start + len(self.START)
            close = text.find(self.END, body_start)
            if close == -1 and not final:
                return pieces, start
            body_end = len(text) if close == -1 else close
            stop = len(text) if close == -1 else close + len(self.END)
            pieces.extend(self._calls_in(text[body_start:body_end]) or [text[start:stop]])
            pos = stop
        return pieces, pos
