"""Incremental (streaming) detokenization of one request.

Pure logic, no ZMQ and no processes: the detokenizer subprocess keeps one
`IncrementalDetokenizer` per running request and calls `step()` with the ids each
scheduler step produced; `step()` returns the text that became final (a delta).

Offsets (the SGLang / vLLM technique)
-------------------------------------
`ids` holds the last few prompt ids (`params.prompt_tail`, as SGLang seeds its decoder
with INIT_INCREMENTAL_DETOKENIZATION_OFFSET = 5 prompt ids) followed by every output id
of the request. Two offsets index into them; both start at the end of the prompt tail,
which is confirmed context from the start (`surr = 0`, `read = len(prompt_tail)`):

    ids:   [ ... already final ... | surr ........ read | new, not yet confirmed ]
                                   ^surr_offset        ^read_offset

* `ids[surr:read]` (the *surrounding* window) are ids whose text is already confirmed
  (appended to `_confirmed_text`); they are kept as left context only.
* Each step decodes `ids[surr:]` and `ids[surr:read]` (the latter is cached) and the new
  text is the difference `decode(ids[surr:])[len(decode(ids[surr:read])):]`.

Decoding a fragment on its own is wrong for SentencePiece-style tokenizers: their
decoders drop the leading space of the first piece (`"▁world"` alone decodes to
`"world"`). Because both decodes start at the same `surr`, that dropped space is dropped
from both and cancels in the difference, while the space of the first *new* piece (which
is not first in `ids[surr:]`) is kept. The prompt tail makes this hold for the first
output piece too: "Tom had a" + " big" rather than "big", so that
decode(prompt) + output text == decode(prompt + output) (a prompt ending inside a UTF-8
character, possible only with `input_ids`, is the exception). Each decode covers only the ids since the
previous confirmed step plus the pending ones, so the cost per step is bounded by the
length of that window, not by the length of the output.

When the new text is non-empty and does not end with U+FFFD, it is confirmed: it is
appended to `_confirmed_text`, `surr = read` and `read = len(ids)`. (The offsets only
advance on non-empty text so that the window always starts with a piece that produces
text; if it started with a skipped special token, for example, the leading-space
handling of the next piece would differ from a full decode.)

UTF-8 holdback
--------------
A character split across byte-level / byte-fallback tokens (CJK, emoji) decodes to one
or more U+FFFD until its last byte arrives. Such text is not confirmed and the offsets
do not move. The part of the new text before the trailing U+FFFD run is still offered
for emission ("tentative" text: `_confirmed_text + new_text.rstrip("\\ufffd")`), so a
step that ends in a half character does not delay the whole step. On finish
everything is flushed, including a trailing U+FFFD if the final ids truly are invalid
UTF-8. (A genuine U+FFFD character produced by the model at the end of the text is
also held back until the next piece or the finish; it is never dropped.)

Stop-string holdback
--------------------
With stop strings (`params.stop`) and without `params.no_stop_trim`, the final text is
cut at the first occurrence of the matched stop string. Everything emitted must be a
prefix of the final text, so while the request runs the candidate text is cut at

* the start of the first full occurrence of any stop string in the not-yet-emitted text
  (the scheduler may report the stop a step later than the text shows it), and
* the start of the longest suffix of the candidate that is a proper prefix of some stop
  string (stop "\\n\\nUser", text ending in "\\n\\nUs": "\\n\\nUs" is held back).

With stop regexes (`params.stop_regex`), the candidate is also cut at the start of the
first full or partial match of any pattern that begins in the not-yet-emitted text: the
`regex` package's partial matching (`partial=True`) reports where the text could still
grow into a match (`and|or`, text ending in " a": the "a" is held back; `[.!?]\\s*$`,
text ending in ".": the "." is held back until more text shows the match gone). The
window is whatever the pattern itself bounds: a bounded pattern holds back at most its
longest match, an unbounded one (`a.*b`) holds back from the "a" until the "b" comes,
the text shows no match can follow, or the request finishes (the finish flushes what is
not cut). A pattern the `regex` package cannot compile holds back all pending text.

Held-back text is re-examined every step, so it is released as soon as the following
text shows it cannot start a stop string. An occurrence can never start inside text
already emitted (it would have been held back), which is why the search starts at the
emitted length.

Finish
------
`finished_reason` is SGLang's dict. On finish:

* `{"type": "stop", "matched": <str>}` and not `no_stop_trim`: the full text is cut at
  the first occurrence of the matched string (no cut if it does not occur). Emitted
  text cannot be taken back: when the matched string is in `params.stop` no occurrence
  can lie in it, otherwise (a stop string the detokenizer was not told about) an
  occurrence entirely inside emitted text is ignored and one that overlaps its end
  cuts at the end of the emitted text.
* `{"type": "stop", "matched": <pattern>}` with the pattern in `params.stop_regex` (the
  scheduler names the pattern, as SGLang) and not `no_stop_trim`: the full text is cut
  at the start of the pattern's first match (`re.search`), never inside emitted text.
* `{"type": "stop", "matched": <int>}` and not `no_stop_trim`: as in SGLang's
  `trim_matched_stop`, the stop token id is removed from the ids before decoding when
  it is the last id of the final step. With `skip_special_tokens` and a special stop
  token (EOS) this changes nothing; it matters for a stop token that would otherwise be
  visible (`skip_special_tokens=False`, or a non-special id in `stop_token_ids`).
* otherwise (length, abort, `no_stop_trim`) everything decoded is flushed.

After the finish, `step()` returns "" and ignores further ids.

Special tokens
--------------
`skip_special_tokens` and `spaces_between_special_tokens` are passed to
`tokenizer.decode`. In transformers 5.x neither the fast (`TokenizersBackend`) nor the
Python backend implements `spaces_between_special_tokens`: `_decode` swallows it in
`**kwargs`, and the `tokenizers` decoders join special tokens with whatever text is
around them without adding spaces. That is exactly the `False` behaviour (special
tokens joined without spaces), so nothing extra is needed for it; with `True` the
output is the same as well, which is also what SGLang produces with HF 5.x fast
tokenizers. A tokenizer whose decode does honour the flag gets it.

Invariant (tested with hypothesis): for any id sequence whose full decode is valid
UTF-8 (no U+FFFD), "".join(deltas) == tokenizer.decode(all_ids, skip_special_tokens=..)
up to stop trimming, no delta contains U+FFFD, and every prefix of the deltas is a
prefix of the final text; with a prompt tail, decode(tail) + "".join(deltas) ==
decode(tail + all_ids).
"""

from __future__ import annotations

import re
from typing import Any

import regex

from tandem.messages import DetokenizeParams

REPLACEMENT_CHAR = "\ufffd"
_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def byte_fallback_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of SentencePiece byte-fallback tokens (`<0x00>`..`<0xFF>`), if the vocab has them.

    Their decoder turns a *run* of byte tokens into text as a whole, and into one U+FFFD
    per byte when the run is not valid UTF-8 anywhere: text decoded from an unfinished run
    may still change, so it is never emitted until the run ends. Scan once per tokenizer.
    """
    return frozenset(i for tok, i in tokenizer.get_vocab().items() if _BYTE_TOKEN.match(tok))


def _drop_leading_continuation_bytes(tokenizer: Any, ids: list[int], byte_token_ids: frozenset[int]) -> list[int]:
    """`ids` without the byte-fallback tokens of UTF-8 continuation bytes it starts with.

    A byte-fallback decoder turns a whole run of byte tokens into U+FFFDs when any of it is
    invalid, so a prompt tail cut inside a character would also garble an output character
    that continues the run. Starting at the character's first byte (or after it) avoids that.
    """
    start = 0
    while start < len(ids) and ids[start] in byte_token_ids:
        if not 0x80 <= int(tokenizer.convert_ids_to_tokens(ids[start])[3:5], 16) <= 0xBF:
            break
        start += 1
    return list(ids[start:])


class IncrementalDetokenizer:
    """State of one request's detokenization."""

    def __init__(self, tokenizer: Any, params: DetokenizeParams, byte_token_ids: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.params = params
        self.byte_token_ids = byte_token_ids
        # The prompt's tail is left context only: confirmed, never emitted.
        self.ids: list[int] = _drop_leading_continuation_bytes(tokenizer, params.prompt_tail, byte_token_ids)
        self.surr_offset = 0
        self.read_offset = len(self.ids)
        self.finished = False
        # Stop strings that need holdback (empty strings never match anything useful).
        self._stops: list[str] = [s for s in (params.stop or []) if s] if not params.no_stop_trim else []
        self._stop_regex: list[str] = list(params.stop_regex or []) if not params.no_stop_trim else []
        self._partial: list[Any] = []  # the regex package's patterns (None: hold all back)
        for pattern in self._stop_regex:
            try:
                self._partial.append(regex.compile(pattern))
            except Exception:  # noqa: BLE001 - valid for `re`, not for `regex`
                self._partial.append(None)
        self._surr_text = self._decode(self.ids)  # decode(ids[surr:read]), cached
        self._confirmed_text = ""  # output text of ids[:read], built from confirmed deltas
        self._output_text = ""  # everything returned so far

    # ------------------------------------------------------------------ public

    @property
    def output_text(self) -> str:
        """Everything returned by `step()` so far, joined."""
        return self._output_text

    def step(self, new_ids: list[int], finished_reason: dict | None) -> str:
        """Add the ids produced since the last call; return the text that became final (delta)."""
        if self.finished:
            return ""
        new_ids = list(new_ids)
        finished = finished_reason is not None
        matched = finished_reason.get("matched") if finished else None
        trim = finished and not self.params.no_stop_trim and finished_reason.get("type") == "stop"

        if trim and isinstance(matched, int) and not isinstance(matched, bool):
            # SGLang's trim_matched_stop: drop the stop token id itself.
            if new_ids and new_ids[-1] == matched:
                new_ids.pop()

        if not new_ids and not finished:
            return ""
        self.ids.extend(new_ids)
        if not finished and self.ids[-1] in self.byte_token_ids:
            return ""  # inside a run of byte tokens: its text is not known yet

        if finished:
            candidate = self._confirmed_text + self._new_text()
            self.finished = True
            if trim and isinstance(matched, str) and matched:
                start = max(0, len(self._output_text) - len(matched) + 1)
                pos = candidate.find(matched, start)
                if pos == -1 and matched in self._stop_regex:
                    found = re.search(matched, candidate)
                    pos = -1 if found is None else found.start()
                if pos != -1:
                    candidate = candidate[: max(pos, len(self._output_text))]
            return self._emit(candidate)

        new_text = self._new_text()
        if new_text and not new_text.endswith(REPLACEMENT_CHAR):
            # Confirm: the text of ids[:len] is final; slide the window.
            self._confirmed_text += new_text
            self.surr_offset = self.read_offset
            self.read_offset = len(self.ids)
            self._surr_text = self._decode(self.ids[self.surr_offset : self.read_offset])
            candidate = self._confirmed_text
        else:
            # Offer what precedes an incomplete trailing character, keep the offsets.
            candidate = self._confirmed_text + new_text.rstrip(REPLACEMENT_CHAR)

        if self._stops:
            candidate = candidate[: self._stop_safe_len(candidate)]
        if self._stop_regex:
            candidate = candidate[: self._regex_safe_len(candidate)]
        return self._emit(candidate)

    # ----------------------------------------------------------------- helpers

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.params.skip_special_tokens,
            spaces_between_special_tokens=self.params.spaces_between_special_tokens,
        )

    def _new_text(self) -> str:
        """Text of ids[read:], decoded with ids[surr:read] as left context."""
        read_text = self._decode(self.ids[self.surr_offset :])
        # decode(ids[surr:]) starts with decode(ids[surr:read]) for BPE / SentencePiece /
        # byte-level decoders, because `read` is only ever placed at a complete character.
        # Like SGLang, slice by length (no re-emission of confirmed text either way).
        return read_text[len(self._surr_text) :]

    def _stop_safe_len(self, text: str) -> int:
        """Length of the longest prefix of `text` that can't be affected by a stop string."""
        emitted = len(self._output_text)
        safe = len(text)
        for s in self._stops:
            pos = text.find(s, emitted)
            if pos != -1 and pos < safe:
                safe = pos
            # Longest suffix of text (within the pending part) that is a proper prefix of s.
            for k in range(min(len(s) - 1, len(text) - emitted), 0, -1):
                if text.endswith(s[:k]):
                    safe = min(safe, len(text) - k)
                    break
        return safe

    def _regex_safe_len(self, text: str) -> int:
        """Length of the longest prefix of `text` before which no stop regex can match:
        the start of the first full or partial match beginning in the pending text."""
        emitted = len(self._output_text)
        safe = len(text)
        for pattern in self._partial:
            if pattern is None:
                return emitted
            found = pattern.search(text, emitted, partial=True)
            if found is not None:
                safe = min(safe, found.start())
        return max(safe, emitted)

    def _emit(self, candidate: str) -> str:
        emitted = len(self._output_text)
        if len(candidate) <= emitted:
            return ""
        delta = candidate[emitted:]
        self._output_text += delta
        return delta
