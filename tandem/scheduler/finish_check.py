"""Decides whether a request is finished after a new token, and why (SGLang's shapes)."""

from __future__ import annotations

from tandem import finish_reason
from tandem.scheduler.schedule_batch import Req


class FinishChecker:
    """Stop conditions in the order SGLang applies them: length, then the end of the
    request's grammar, then stop token ids and EOS, then stop strings (found by decoding
    only the tail of the output, with one id before it as context)."""

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
        return None

    def _output_tail(self, req: Req, window: int, skip_special_tokens: bool) -> str:
        """The text of the last `window` output ids as it reads in the whole text: decoded
        after the id before them (an output id, or the prompt's last), whose text is then
        cut off, so that a SentencePiece decoder keeps the first one's leading space."""
        out = req.output_ids
        context = out[-window - 1 : -window] if len(out) > window else req.origin_input_ids[-1:]
        text = self.tokenizer.decode(context + out[-window:], skip_special_tokens=skip_special_tokens)
        return text[len(self.tokenizer.decode(context, skip_special_tokens=skip_special_tokens)) :]
