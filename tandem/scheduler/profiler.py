"""The scheduler's torch profiler: SGLang's /start_profile and /stop_profile.

`SchedulerProfiler.handle(ProfileReq)` starts or stops one `torch.profiler.profile`
around the scheduler loop; `step()` (called after every forward step) stops it after
`num_steps` steps when the start asked for that. The trace is written on stop as
`{output_dir}/{profile_prefix-}{profile_id}-TP-0.trace.json.gz` (`-TP-0-DP-{k}` for
replica k under --dp-size > 1), SGLang's file name,
and opens in Perfetto or chrome://tracing.
"""

from __future__ import annotations

import logging
import os

import torch

from tandem.messages import ProfileReq, ProfileReqOutput

logger = logging.getLogger(__name__)

# Where traces go when the request names no directory (SGLang: SGLANG_TORCH_PROFILER_DIR).
PROFILER_DIR_ENV = "TANDEM_TORCH_PROFILER_DIR"
_ACTIVITIES = {"CPU": torch.profiler.ProfilerActivity.CPU, "GPU": torch.profiler.ProfilerActivity.CUDA}


class SchedulerProfiler:
    def __init__(self, tp_rank: int = 0, dp_rank: int | None = None):
        # SGLang's file name suffix: `-TP-{tp}`, and `-DP-{dp}` for a data-parallel replica.
        self.rank_suffix = f"-TP-{tp_rank}" + (f"-DP-{dp_rank}" if dp_rank is not None else "")
        self.profiler: torch.profiler.profile | None = None
        self.trace_path: str | None = None
        self.steps_left: int | None = None

    def handle(self, req: ProfileReq) -> ProfileReqOutput:
        if req.action == "start":
            return self._start(req)
        return self._stop(req.request_id)

    def step(self) -> None:
        """Count one forward step; stop when the requested number of steps has run."""
        if self.profiler is None or self.steps_left is None:
            return
        self.steps_left -= 1
        if self.steps_left <= 0:
            self._stop("")

    def _start(self, req: ProfileReq) -> ProfileReqOutput:
        if self.profiler is not None:
            return ProfileReqOutput(
                req.request_id, False, "Profiling is already in progress. Call /stop_profile first."
            )
        names = req.activities or ["CPU", "GPU"]
        unknown = [a for a in names if a not in _ACTIVITIES]
        if unknown:
            return ProfileReqOutput(
                req.request_id, False, f"activities: unknown activity {unknown[0]!r} (supported: CPU, GPU)"
            )
        activities = [_ACTIVITIES[a] for a in names if a == "CPU" or torch.cuda.is_available()]
        output_dir = os.path.abspath(req.output_dir or os.environ.get(PROFILER_DIR_ENV, "/tmp"))
        try:
            os.makedirs(output_dir, exist_ok=True)
        except OSError as e:
            return ProfileReqOutput(req.request_id, False, f"output_dir: cannot create {output_dir!r}: {e}")
        prefix = f"{req.profile_prefix}-" if req.profile_prefix else ""
        self.trace_path = os.path.join(output_dir, f"{prefix}{req.profile_id}{self.rank_suffix}.trace.json.gz")
        self.steps_left = req.num_steps if req.num_steps and req.num_steps > 0 else None
        self.profiler = torch.profiler.profile(
            activities=activities, with_stack=req.with_stack is not False, record_shapes=bool(req.record_shapes)
        )
        self.profiler.start()
        logger.info("Profiling starts. Traces will be saved to: %s", self.trace_path)
        return ProfileReqOutput(req.request_id, True, "Succeeded")

    def _stop(self, request_id: str) -> ProfileReqOutput:
        if self.profiler is None:
            return ProfileReqOutput(request_id, False, "Profiling is not in progress. Call /start_profile first.")
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        profiler.export_chrome_trace(self.trace_path)
        logger.info("Profiling done. Traces are saved to: %s", self.trace_path)
        return ProfileReqOutput(request_id, True, f"Succeeded. Trace: {self.trace_path}")
