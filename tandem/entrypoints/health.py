"""Health checks. GET /health (`EngineHealth`): are the engine's processes alive and its
forward steps moving? GET /health_generate (`GenerationProbe`): is the engine producing
tokens? (SGLang's routes and rules.)

/health_generate is open to anyone (no API key, for load balancers), so it must not let them drive the
model: when the scheduler side sent anything in the last RECENT_PROGRESS_S seconds, the
answer is yes without running anything; otherwise one probe generation (one token) runs,
and every call that arrives meanwhile shares it. The probe times out after
TANDEM_HEALTH_CHECK_TIMEOUT seconds (SGLANG_HEALTH_CHECK_TIMEOUT in SGLang; default 20).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from tandem.entrypoints.native_protocol import GenerateReqInput
from tandem.entrypoints.streams import last_outputs
from tandem.scheduler.forward_watchdog import forward_stuck_for
from tandem.tokenizer.tokenizer_manager import TokenizerManager
from tandem.utils.process import pid_alive

HEALTH_CHECK_TIMEOUT_S = 20.0
RECENT_PROGRESS_S = 2.0


@dataclass
class EngineHealth:
    """The engine's processes (name -> pid) and scheduler rank 0's forward stamp (when its
    current forward step started, time.monotonic(); 0.0 between steps). Picklable, so
    that every tokenizer worker process checks the same."""

    pids: dict[str, int]
    forward_stamp: Any = None

    def problem(self, watchdog_timeout: float) -> str | None:
        """Why the engine cannot serve (a process has exited, a forward step is stuck past
        --watchdog-timeout), or None."""
        dead = [name for name, pid in self.pids.items() if not pid_alive(pid)]
        if dead:
            return f"the {dead[0]} process has exited"
        stuck = forward_stuck_for(self.forward_stamp) if self.forward_stamp is not None else 0.0
        if stuck > watchdog_timeout:
            return f"a forward step has run for {stuck:.0f} s (--watchdog-timeout {watchdog_timeout:g})"
        return None


class GenerationProbe:
    def __init__(self, tm: TokenizerManager):
        self.tm = tm
        self.timeout_s = float(os.environ.get("TANDEM_HEALTH_CHECK_TIMEOUT", HEALTH_CHECK_TIMEOUT_S))
        self._probe: asyncio.Task | None = None

    async def check(self) -> str | None:
        """None when the engine made progress recently or the (shared) probe succeeded,
        else why not."""
        if time.time() - self.tm.last_receive_tstamp < RECENT_PROGRESS_S:
            return None
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._run())
        return await asyncio.shield(self._probe)

    async def _run(self) -> str | None:
        obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
        try:
            async with asyncio.timeout(self.timeout_s):
                await last_outputs(await self.tm.generate_request(obj))
        except Exception as e:  # noqa: BLE001 - any failure means unhealthy
            return f"engine did not answer: {type(e).__name__}: {e}"
        return None
