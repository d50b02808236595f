"""Decides whether a request is finished after a new token, and why (SGLang's shapes)."""

from __future__ import annotations

import re
import sys
from functools import lru_cache

from tandem import finish_reason
from tandem.scheduler.schedule_batch import Req


class FinishChecker:
    """Stop conditions in the order SGLang applies them: length, then the end of the
    request's grammar, then stop token ids and EOS, then stop strings, then stop regexes
    (both found by decoding only the tail of the output, with one id before it as
    context). A stop regex is searched (`re.search`, as SGLang) in the text of the last
    4 * W + 1 output ids, W its longest match in characters (a character is at most 4
    UTF-8 bytes, so at most 4 tokens); one whose matches are unbounded (`\\d+`, `.*`) is
    searched in the whole output. The finish names the pattern, as SGLang's
    FINISHED_MATCHED_REGEX does."""

    def __init__(self, tokenizer, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def check(self, req: Req) -> finish_reason.FinishReason | None:
        sp = req.sampling_params
        last = req.output_ids[-1]
        if len(req.output_ids) >= sp.max_new_tokens:
            return finish_reason.length(sp.max_new_tokens)
        if req.grammar is not None and req.grammar.is_terminated():  # its stop token was accepted
            return finish_reason.stop(last)
        if last in sp.stop_token_ids:
            return finish_reason.stop(last)
        if not sp.ignore_eos and last in self.eos_token_ids:
            return finish_reason.stop(last)
        if sp.stop and self.tokenizer is not None:  # no stop strings without a tokenizer
            # A stop string of B UTF-8 bytes spans at most B tokens (+1 partial token).
            window = max(len(s.encode("utf-8")) for s in sp.stop) + 1
            tail = self._output_tail(req, window, sp.skip_special_tokens)
            for stop in sp.stop:
                if stop in tail:
                    return finish_reason.stop(stop)
        if sp.stop_regex and self.tokenizer is not None:
            window = max(regex_window(p) for p in sp.stop_regex)
            tail = self._output_tail(req, min(window, len(req.output_ids)), sp.skip_special_tokens)
            for pattern in sp.stop_regex:
                if _compiled(pattern).search(tail):
                    return finish_reason.stop(pattern)
        return None

    def _output_tail(self, req: Req, window: int, skip_special_tokens: bool) -> str:
        """The text of the last `window` output ids as it reads in the whole text: decoded
        after the id before them (an output id, or the prompt's last), whose text is then
        cut off, so that a SentencePiece decoder keeps the first one's leading space."""
        out = req.output_ids
        context = out[-window - 1 : -window] if len(out) > window else req.origin_input_ids[-1:]
        text = self.tokenizer.decode(context + out[-window:], skip_special_tokens=skip_special_tokens)
        return text[len(self.tokenizer.decode(context, skip_special_tokens=skip_special_tokens)) :]


@lru_cache(maxsize=1024)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern)


@lru_cache(maxsize=1024)
def regex_window(pattern: str) -> int:
    """Output ids whose text can hold a whole match of `pattern`: 4 per character of its
    longest match, plus one; unbounded patterns get a window past any output."""
    try:
        longest = re._parser.parse(pattern).getwidth()[1]  # noqa: SLF001 - no public API for this
    except Exception:  # noqa: BLE001 - a parser that changed: search everything
        return sys.maxsize
    if longest >= re._constants.MAXREPEAT or longest > 1 << 20:  # noqa: SLF001
        return sys.maxsize
    return 4 * longest + 1
