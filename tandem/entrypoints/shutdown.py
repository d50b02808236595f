"""Graceful shutdown of the HTTP server: SIGTERM and SIGINT drain, then everything exits.

On the first SIGTERM or SIGINT the server drains: `TokenizerManager.draining` is set, so
every route but DRAIN_OPEN_PATHS (new requests, /health, /health_generate) answers 503
"the server is shutting down"; the running requests get --graceful-shutdown-timeout
seconds to finish; those still running then are aborted (finish_reason abort with
ABORT_MESSAGE) and, once they have answered (at most ABORT_FLUSH_S), uvicorn closes the
connections and `run()` returns, so the caller ends the children and exits 0. A second
signal aborts the running requests at once. When idle, the whole shutdown takes well
under a second.

uvicorn's own handling is replaced: it would stop accepting at once and, after serving,
re-raise the signal, so the process would die by it (exit -15, or a KeyboardInterrupt
traceback) instead of exiting normally.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Iterator

import uvicorn
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.tokenizer.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Under --tokenizer-worker-num N > 1 the main process drains each worker with this signal
# (the workers ignore SIGINT and SIGTERM, which a terminal or a service manager sends to
# the whole group: a worker hit by both would take the second as "hurry").
WORKER_DRAIN_SIGNAL = signal.SIGUSR2
DRAINING_MESSAGE = "the server is shutting down"
ABORT_MESSAGE = "the server is shutting down: the request did not finish within --graceful-shutdown-timeout"
# Routes that still answer while draining: aborting, and reading the server's state.
DRAIN_OPEN_PATHS = frozenset({"/abort_request", "/server_info", "/get_server_info", "/model_info", "/get_model_info"})
# After the abort at the end of the grace period: how long the aborted requests get to answer.
ABORT_FLUSH_S = 2.0
# After the drain: how long uvicorn waits for open responses to be written before it cancels them.
CLOSE_TIMEOUT_S = 5
_POLL_S = 0.02


class DrainGate:
    """ASGI middleware: while `tm.draining`, answer 503 (`refusal()`) on every route but
    DRAIN_OPEN_PATHS."""

    def __init__(self, app: ASGIApp, tm: TokenizerManager, refusal: Callable[[], Response]):
        self.app, self.tm, self.refusal = app, tm, refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.tm.draining and scope["path"] not in DRAIN_OPEN_PATHS:
            await self.refusal()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on SIGTERM/SIGINT before it shuts down (module docstring)."""

    def __init__(
        self, config: uvicorn.Config, tm: TokenizerManager, grace_s: float, stop_signals: tuple[int, ...] = STOP_SIGNALS
    ):
        config.timeout_graceful_shutdown = CLOSE_TIMEOUT_S
        super().__init__(config)
        self.tm = tm
        self.grace_s = grace_s
        self.stop_signals = stop_signals
        self._drain_task: asyncio.Task | None = None
        self._hurry = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in self.stop_signals:
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        try:
            yield
        finally:
            for sig in self.stop_signals:
                loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_IGN)  # the caller is ending the children

    def _on_stop_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self._drain_task is None:
            logger.warning(
                "%s received: draining (new requests get 503; %d running get up to %g s to finish)",
                name,
                len(self.tm.rid_to_state),
                self.grace_s,
            )
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        else:
            logger.warning("%s received again: aborting the running requests now", name)
            self._hurry.set()

    async def _drain(self) -> None:
        self.tm.draining = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._until_idle(), self.grace_s)
        if self.tm.rid_to_state:
            logger.warning("aborting %d requests still running", len(self.tm.rid_to_state))
            self.tm.abort_request(abort_all=True, message=ABORT_MESSAGE)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._until_idle(hurry=False), ABORT_FLUSH_S)
        self.should_exit = True

    async def _until_idle(self, hurry: bool = True) -> None:
        """Return when no request runs (or, with `hurry`, on a second stop signal)."""
        while self.tm.rid_to_state and not (hurry and self._hurry.is_set()):
            await asyncio.sleep(_POLL_S)
