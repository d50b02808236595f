"""The scheduler's generation throughput: output tokens per second over the last few
seconds, SGLang's `gen_throughput` (reported by /v1/loads and /server_info, shown by the
chat page's status line)."""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable

# Seconds of recent batches the rate is taken over.
GEN_THROUGHPUT_WINDOW_S = 5.0


class GenThroughput:
    """Each processed batch's output tokens, stamped; the rate is the tokens of the last
    `window` seconds over the time since the oldest stamp among them (whose own tokens
    mark the span's start), so a stream that has just begun reads its rate at once, and
    an idle scheduler's rate falls to 0 within `window`."""

    def __init__(self, window: float = GEN_THROUGHPUT_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window, self.clock = window, clock
        self._batches: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, tokens: int) -> None:
        if tokens > 0:
            now = self.clock()
            self._batches.append((now, tokens))
            self._forget_before(now - self.window)

    def rate(self) -> float:
        """Output tokens per second (0.0 with fewer than two batches in the window)."""
        now = self.clock()
        self._forget_before(now - self.window)
        if len(self._batches) < 2:
            return 0.0
        span = now - self._batches[0][0]
        tokens = sum(n for _, n in itertools.islice(self._batches, 1, None))
        return tokens / span if span > 0 else 0.0

    def _forget_before(self, t: float) -> None:
        while self._batches and self._batches[0][0] <= t:
            self._batches.popleft()
