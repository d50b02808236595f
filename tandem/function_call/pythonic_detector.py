"""Python-call tool calls: `[f(a=1, b="x"), g()]`, a list of calls with keyword
arguments whose values are Python literals (`--tool-call-parser pythonic`, Llama 4's
format), and LFM2's, the same list (or a JSON array of `{"name", "arguments"}` objects)
between `<|tool_call_start|>` and `<|tool_call_end|>` (`--tool-call-parser lfm2`).

Text before a list is content. A list that is not all calls of the request's tools
(a name not in the tools, a positional argument, a value that is not a literal) stays in
the text, as does a list the output ends inside; so does a block the output ends inside
unless what it holds parses.
"""

from __future__ import annotations

import ast
import json

from tandem.function_call.base_format_detector import (
    BaseFormatDetector,
    DecodedCall,
    Piece,
    TaggedBlockDetector,
    partial_suffix_len,
)

# Llama 4 may wrap the list in these; they are dropped.
_LLAMA4_TAGS = ("<|python_start|>", "<|python_end|>")
LFM2_START = "<|tool_call_start|>"
LFM2_END = "<|tool_call_end|>"
_LITERAL_NAMES = {"true": True, "false": False, "null": None}


def list_end(text: str, start: int) -> int:
    """The index after the `]` that closes the `[` at `text[start]`; -1 when the text ends first."""
    depth, quote, i = 0, None, start
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "[({":
            depth += 1
        elif c in "])}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def _literal(node: ast.expr):
    if isinstance(node, ast.Name) and node.id in _LITERAL_NAMES:  # JSON's spelling
        return _LITERAL_NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    return ast.literal_eval(node)


def python_calls(text: str, tool_names: frozenset[str]) -> list[DecodedCall] | None:
    """`text` (one `[...]` list) as calls of `tool_names`; None when it is not all calls."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for call in tree.elts:
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args):
                return None
            if call.func.id not in tool_names or any(k.arg is None for k in call.keywords):
                return None
            arguments = {k.arg: _literal(k.value) for k in call.keywords}
            json.dumps(arguments, allow_nan=False)  # JSON-able, or not a call
            calls.append(DecodedCall(call.func.id, arguments))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None


class PythonicDetector(BaseFormatDetector):
    def _scan(self, text: str, final: bool) -> tuple[list[Piece], int]:
        pieces: list[Piece] = []
        pos = 0
        while pos < len(text):
            start = text.find("[", pos)
            if start == -1:
                held = 0 if final else max(partial_suffix_len(text[pos:], tag) for tag in _LLAMA4_TAGS)
                pieces.append(_untagged(text[pos : len(text) - held]))
                return pieces, len(text) - held
            pieces.append(_untagged(text[pos:start]))
            end = list_end(text, start)
            if end == -1:
                if not final:
                    return pieces, start
                end = len(text)
            pieces.extend(python_calls(text[start:end], self.tool_names) or [text[start:end]])
            pos = end
        return pieces, pos


def _untagged(text: str) -> str:
    for tag in _LLAMA4_TAGS:
        text = text.replace(tag, "")
    return text


class Lfm2Detector(TaggedBlockDetector):
    START, END = LFM2_START, LFM2_END

    def _calls_in(self, body: str) -> list[DecodedCall] | None:
        calls = python_calls(body, self.tool_names)
        if calls is not None:
            return calls
        try:
            items = json.loads(body)
        except ValueError:
            return None
        items = items if isinstance(items, list) else [items]
        decoded = [self.as_call(item) for item in items]
        return decoded if decoded and all(decoded) else None
