"""`GrammarQueue`: requests that wait in the scheduler for their grammar to compile.

A constrained request does not join the waiting queue until its compiled grammar is
ready (SGLang's grammar queue); the scheduler polls each loop iteration and never
blocks a batch on a compile. One whose grammar fails to compile finishes with a 400
naming the problem; one still waiting after `timeout_s` with a 400 saying so (SGLang
waits SGLANG_GRAMMAR_TIMEOUT, 300 s, the same default).

Under tensor parallelism every rank must admit the same requests in the same step, and
compile times differ between ranks, so there `blocking` makes `pop_ready` wait for each
compile (the batch waits; ranks stay in step).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tandem import finish_reason
from tandem.constrained.backend import GrammarBackend

DEFAULT_TIMEOUT_S = 300.0


@dataclass
class _Entry:
    req: Any  # a scheduler Req
    future: Future
    deadline: float


class GrammarQueue:
    def __init__(self, backend: GrammarBackend | None, timeout_s: float = DEFAULT_TIMEOUT_S, blocking: bool = False):
        self.backend = backend
        self.timeout_s = timeout_s
        self.blocking = blocking
        self._entries: list[_Entry] = []

    def __len__(self) -> int:
        return len(self._entries)

    def reqs(self) -> list:
        """The requests waiting for their grammar, in arrival order."""
        return [e.req for e in self._entries]

    def add(self, req) -> None:
        """Start compiling `req`'s grammar (or find it compiled) and hold `req` until then."""
        self._entries.append(
            _Entry(req, self.backend.compile(req.sampling_params.grammar_key()), time.monotonic() + self.timeout_s)
        )

    def pop_ready(self) -> tuple[list, list]:
        """(requests whose grammar is ready, now with `req.grammar` set; requests that
        failed, with their `finished_reason` set), both in arrival order."""
        ready, failed, waiting = [], [], []
        now = time.monotonic()
        if self.blocking and self._entries:
            futures.wait(
                [e.future for e in self._entries], timeout=max(0.0, max(e.deadline for e in self._entries) - now)
            )
            now = time.monotonic()
        for entry in self._entries:
            if entry.future.done():
                exc = entry.future.exception()
                if exc is None:
                    entry.req.grammar = self.backend.make_grammar(entry.future.result())
                    ready.append(entry.req)
                else:
                    entry.req.finished_reason = finish_reason.abort(str(exc), 400)
                    failed.append(entry.req)
            elif now >= entry.deadline:
                kind = entry.req.sampling_params.grammar_key()[0]
                entry.req.finished_reason = finish_reason.abort(
                    f"sampling_params.{kind}: the grammar did not compile within {self.timeout_s:g} s", 400
                )
                failed.append(entry.req)
            else:
                waiting.append(entry)
        self._entries = waiting
        return ready, failed

    def remove(self, match: Callable[[Any], bool]) -> list:
        """Take out (and return) the waiting requests that `match`."""
        taken = [e.req for e in self._entries if match(e.req)]
        self._entries = [e for e in self._entries if not match(e.req)]
        return taken
