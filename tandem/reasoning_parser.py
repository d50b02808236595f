"""Reasoning output (`--reasoning-parser`): a chat answer's think block goes to
`reasoning_content`, the rest to `content` (SGLang's parser names and tokens).

The rules, the same for the whole text and for the text streamed in any pieces (the
unit tests check every split):

- A think block runs from `<think>` to `</think>`. It is recognised only at the start of
  the output (after leading whitespace); a `<think>` later on is content.
- The output starts inside the block (the template opened it in the prompt) for
  `deepseek-r1` always (its template ends the prompt with `<think>`; R1-0528 writes
  `<think>` again, which is dropped), and for `qwen3` when the rendered prompt ends
  inside an open `<think>` block (`prompt_opens_think`: templates such as
  Qwen3-Thinking-2507's). Otherwise an output that opens no block is all content:
  SGLang's qwen3 detector, forced to reasoning, moves such an answer (say one asked
  with `enable_thinking: false`, or from a model that skipped thinking) wholly into
  `reasoning_content`; Tandem does not.
- `reasoning_content` is the block's text without surrounding whitespace; `content` the
  text after `</think>` without leading whitespace. A block that never closes (the
  output was cut by max_tokens) is all reasoning and no content.
- Streaming holds back only what the next piece may change: the start of the output
  while it may still become `<think>`, the tail of the reasoning while it may be the
  start of `</think>` or trailing whitespace, and whitespace right after `</think>`.
  `finish()` releases the rest. With `stream_reasoning` false the reasoning goes out in
  one piece when its block closes (or at the finish).
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"

# Parser name -> whether the output always starts inside the think block.
REASONING_PARSERS: dict[str, bool] = {"deepseek-r1": True, "qwen3": False, "qwen3-thinking": True}


def prompt_opens_think(prompt: str) -> bool:
    """The rendered prompt ends inside an open think block (the template opened it)."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


def starts_in_reasoning(parser: str, prompt: str) -> bool:
    return REASONING_PARSERS[parser] or prompt_opens_think(prompt)


@dataclass
class ReasoningResult:
    reasoning: str = ""
    content: str = ""

    def merged(self, other: ReasoningResult) -> ReasoningResult:
        return ReasoningResult(self.reasoning + other.reasoning, self.content + other.content)


def parse_reasoning(text: str, in_reasoning: bool) -> ReasoningResult:
    """The whole output's reasoning and content; `in_reasoning`: it starts inside the block."""
    s = text.lstrip()
    if s.startswith(THINK_START):
        s = s[len(THINK_START) :]
    elif not in_reasoning:
        return ReasoningResult(content=text)
    end = s.find(THINK_END)
    if end < 0:
        return ReasoningResult(reasoning=s.strip())
    return ReasoningResult(reasoning=s[:end].strip(), content=s[end + len(THINK_END) :].lstrip())


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `token`."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


_START, _REASONING_LEAD, _REASONING, _CONTENT_LEAD, _CONTENT = range(5)


class ReasoningStream:
    """`parse_reasoning` piece by piece: `feed` each new piece of the output, `finish`
    once at its end; the results concatenated equal the whole text's."""

    def __init__(self, in_reasoning: bool, stream_reasoning: bool = True):
        self.in_reasoning = in_reasoning
        self.stream_reasoning = stream_reasoning
        self._state = _START
        self._buf = ""
        self._held_reasoning = ""  # with stream_reasoning false

    def _reasoning_out(self, text: str, block_done: bool) -> str:
        if self.stream_reasoning:
            return text
        self._held_reasoning += text
        if not block_done:
            return ""
        out, self._held_reasoning = self._held_reasoning, ""
        return out

    def feed(self, text: str) -> ReasoningResult:
        self._buf += text
        out = ReasoningResult()
        while True:
            if self._state == _START:
                s = self._buf.lstrip()
                if s.startswith(THINK_START):
                    self._buf = s[len(THINK_START) :]
                    self._state = _REASONING_LEAD
                elif THINK_START.startswith(s):
                    return out  # may still become <think>
                elif self.in_reasoning:
                    self._state = _REASONING_LEAD
                else:
                    self._state = _CONTENT
            elif self._state == _REASONING_LEAD:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return out
                self._state = _REASONING
            elif self._state == _REASONING:
                end = self._buf.find(THINK_END)
                if end >= 0:
                    out.reasoning += self._reasoning_out(self._buf[:end].rstrip(), True)
                    self._buf = self._buf[end + len(THINK_END) :]
                    self._state = _CONTENT_LEAD
                    continue
                keep = _partial_suffix(self._buf, THINK_END)
                body = self._buf[: len(self._buf) - keep]
                emit = body.rstrip()
                out.reasoning += self._reasoning_out(emit, False)
                self._buf = self._buf[len(emit) :]
                return out
            elif self._state == _CONTENT_LEAD:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return out
                self._state = _CONTENT
            else:
                out.content += self._buf
                self._buf = ""
                return out

    def finish(self) -> ReasoningResult:
        """What was held back, at the end of the output."""
        buf, self._buf = self._buf, ""
        if self._state == _START:
            if self.in_reasoning:
                return ReasoningResult(reasoning=self._reasoning_out(buf.strip(), True))
            return ReasoningResult(content=buf)
        if self._state == _REASONING_LEAD:
            return ReasoningResult(reasoning=self._reasoning_out(buf.strip(), True))
        if self._state == _REASONING:  # its leading whitespace is inside the reasoning
            return ReasoningResult(reasoning=self._reasoning_out(buf.rstrip(), True))
        if self._state == _CONTENT_LEAD:
            return ReasoningResult()
        return ReasoningResult(content=buf)
