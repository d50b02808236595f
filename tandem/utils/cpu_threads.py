"""How many intra-op threads the scheduler's forwards use on CPU.

Intra-op threads wait for each other at every kernel, so a compute thread that shares
its core with another busy process stalls all the others. While a decode step runs, the
HTTP and detokenizer processes are busy streaming the previous step's tokens, which
costs them about a millisecond or two per step. So:
- prefill uses every core (the other processes are mostly idle meanwhile);
- decode leaves one core to them while decode steps are short (small models: a stalled
  thread would cost a large share of the step), and takes every core once steps are
  long enough that the extra thread's compute outweighs that stall (large models).
  Measured on 2 cores (docs/benchmarks.md): a 7M model streams ~15% more tokens/s with
  one decode thread, a 100M model far more with two.
The ranks of a tensor-parallel group on one machine split its cores evenly (each rank's
"every core" is its share), so that no two compute threads share a core.
OMP_NUM_THREADS, when set, fixes the count for everything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tandem.forward_batch import ForwardMode

# Decode steps longer than this (seconds, moving average) get every core.
LONG_DECODE_STEP_S = 0.030
EMA_WEIGHT = 0.1


@dataclass
class ComputeThreads:
    cores: int
    decode: int
    current: int = 0
    decode_step_ema: float | None = None

    @classmethod
    def for_device(cls, device: str, ranks: int = 1) -> "ComputeThreads | None":
        """The policy for a CPU scheduler, one of `ranks` sharing the machine, or None
        (GPU, or OMP_NUM_THREADS set)."""
        if device != "cpu" or "OMP_NUM_THREADS" in os.environ:
            return None
        cores = max(1, len(os.sched_getaffinity(0)) // ranks)
        return cls(cores=cores, decode=max(1, cores - 1))

    def apply(self, mode: ForwardMode) -> None:
        """Set the thread count for the forward about to run."""
        wanted = self.cores if mode.is_extend() else self.decode
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted

    def observe_decode(self, seconds: float) -> None:
        """Record a decode step's duration; long steps switch decode to every core."""
        ema = self.decode_step_ema
        self.decode_step_ema = seconds if ema is None else (1 - EMA_WEIGHT) * ema + EMA_WEIGHT * seconds
        if self.decode < self.cores and self.decode_step_ema > LONG_DECODE_STEP_S:
            self.decode = self.cores
