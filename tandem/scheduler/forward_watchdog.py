"""The scheduler's watchdog (SGLang's --watchdog-timeout): a forward step that runs
longer than the timeout is a hung server, which is worse than none.

The scheduler wraps every forward in `watching(batch)`, which stamps the step's start
(time.monotonic(), the same clock in every process) into a value shared with the main
process, 0.0 between steps. A daemon thread in the scheduler checks the stamp; past the
timeout it dumps every thread's stack (faulthandler) and the batch to the log and calls
`on_timeout` (which brings the server down). The main process reads the same stamp for
GET /health (`forward_stuck_for`), so it answers 503 even when the scheduler is frozen
whole and its own thread cannot run.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from tandem.scheduler.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)

# Test hook, read once when the scheduler starts: every forward step sleeps this many
# seconds first (inside the watched region), to hang or pace the server in tests. The
# first such step logs TEST_FORWARD_SLEEP_LOG (a warning) once its stamp is set, so that
# a test can wait for a forward to be under way instead of guessing when it is.
TEST_FORWARD_SLEEP_ENV = "TANDEM_TEST_FORWARD_SLEEP_S"
TEST_FORWARD_SLEEP_LOG = "test hook TANDEM_TEST_FORWARD_SLEEP_S: the first forward step has started"


def new_forward_stamp(ctx: Any = mp) -> Any:
    """A shared double for the forward-start stamp; `ctx` is the multiprocessing context
    the scheduler is started with."""
    return ctx.RawValue("d", 0.0)


def forward_stuck_for(stamp: Any) -> float:
    """Seconds the current forward step has been running (0.0 between steps)."""
    started = stamp.value
    return time.monotonic() - started if started > 0.0 else 0.0


class ForwardWatchdog:
    def __init__(self, timeout: float, stamp: Any = None):
        self.timeout = timeout
        self.stamp = stamp if stamp is not None else new_forward_stamp()
        self.batch: ScheduleBatch | None = None
        self.test_sleep_s = float(os.environ.get(TEST_FORWARD_SLEEP_ENV, "0") or 0)
        self._test_sleep_logged = False

    @contextlib.contextmanager
    def watching(self, batch: ScheduleBatch) -> Iterator[None]:
        """Around one forward step of `batch`."""
        self.batch = batch
        self.stamp.value = time.monotonic()
        try:
            if self.test_sleep_s:
                if not self._test_sleep_logged:
                    self._test_sleep_logged = True
                    logger.warning("%s; each sleeps %g s first", TEST_FORWARD_SLEEP_LOG, self.test_sleep_s)
                time.sleep(self.test_sleep_s)
            yield
        finally:
            self.stamp.value = 0.0
            self.batch = None

    def start(self, on_timeout: Callable[[], None]) -> None:
        """Start the checking thread; `on_timeout` runs once, after the dumps."""
        threading.Thread(target=self._loop, args=(on_timeout,), name="forward-watchdog", daemon=True).start()

    def _loop(self, on_timeout: Callable[[], None]) -> None:
        period = min(1.0, self.timeout / 4)
        while True:
            time.sleep(period)
            batch, stuck = self.batch, forward_stuck_for(self.stamp)
            if stuck > self.timeout:
                break
        logger.error(
            "watchdog: a forward step has run for %.1f s, past --watchdog-timeout %g s; "
            "dumping every thread's stack and the batch, then bringing the server down",
            stuck,
            self.timeout,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        logger.error("watchdog: the batch being forwarded: %s", describe_batch(batch))
        for handler in logging.getLogger().handlers:
            handler.flush()
        on_timeout()


def describe_batch(batch: ScheduleBatch | None) -> str:
    """One line: the forward mode and each request's rid and lengths."""
    if batch is None:
        return "none"
    reqs = ", ".join(
        f"{r.rid} (prompt_len={r.prompt_len}, output_len={len(r.output_ids)}, kv_len={r.kv_len})" for r in batch.reqs
    )
    return f"{batch.forward_mode.name} of {len(batch.reqs)} requests: {reqs}"
