"""What the detectors produce: parsed calls and the text around them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ToolCallItem:
    """One call: the function's name and its arguments as a JSON string (OpenAI's
    `function.arguments`). `tool_index` is the call's position in the message."""

    tool_index: int
    name: str
    parameters: str


@dataclass
class StreamingParseResult:
    """What one piece of output turned into: text for `content`, and finished calls."""

    normal_text: str = ""
    calls: list[ToolCallItem] = field(default_factory=list)

    def merged(self, later: StreamingParseResult) -> StreamingParseResult:
        """This result followed by `later`."""
        return StreamingParseResult(self.normal_text + later.normal_text, self.calls + later.calls)
