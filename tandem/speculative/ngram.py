"""NGRAM drafts: the tokens that followed the latest earlier occurrence of the sequence's
suffix, in the request's own prompt and output.

The suffix tried first is the longest (`--speculative-ngram-max-match-window-size`
tokens), then shorter ones down to `--speculative-ngram-min-match-window-size`; the
first that occurred earlier gives the drafts (up to `limit`), a chain. The search runs
in C (`bytes.rfind` over the ids packed as 32-bit integers).
"""

from __future__ import annotations

from array import array


class NgramProposer:
    def __init__(self, min_window: int, max_window: int):
        self.min_window = min_window
        self.max_window = max_window

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` draft tokens to follow `tokens` ([] when no suffix recurs)."""
        if limit <= 0 or len(tokens) < self.min_window + 1:
            return []
        packed = array("i", tokens).tobytes()
        for window in range(min(self.max_window, len(tokens) - 1), self.min_window - 1, -1):
            start = _latest_earlier(packed, len(tokens), window)
            if start is not None:
                return tokens[start + window : start + window + limit]
        return []


def _latest_earlier(packed: bytes, n: int, window: int) -> int | None:
    """Token index of the latest occurrence of the last `window` ids that ends before the
    last id (so at least one id follows it), or None."""
    pattern = packed[(n - window) * 4 :]
    end = (n - 1) * 4  # the occurrence must end at or before token n - 2
    while True:
        at = packed.rfind(pattern, 0, end)
        if at < 0:
            return None
        if at % 4 == 0:
            return at // 4
        end = at + len(pattern) - 1  # misaligned: look further left
