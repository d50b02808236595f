"""How many intra-op threads the scheduler's forwards use on CPU.

Intra-op threads wait for each other at every kernel, so a compute thread that shares
its core with another busy process stalls all the others. While a decode step runs,
the HTTP and detokenizer processes are busy streaming the previous step's tokens, so
decode leaves them one core. While a prefill runs they are mostly idle, so prefill
uses every core. OMP_NUM_THREADS, when set, fixes the count for both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tandem.model_executor.forward_batch import ForwardMode


@dataclass
class ComputeThreads:
    prefill: int
    decode: int
    current: int = 0

    @classmethod
    def for_device(cls, device: str) -> "ComputeThreads | None":
        """The policy for a CPU scheduler, or None (GPU, or OMP_NUM_THREADS set)."""
        if device != "cpu" or "OMP_NUM_THREADS" in os.environ:
            return None
        cores = len(os.sched_getaffinity(0))
        return cls(prefill=cores, decode=max(1, cores - 1))

    def apply(self, mode: ForwardMode) -> None:
        wanted = self.prefill if mode.is_extend() else self.decode
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted
