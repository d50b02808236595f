"""How many intra-op threads the scheduler's forwards use on CPU.

Intra-op threads wait for each other at every kernel, so a compute thread that shares
its core with another busy process stalls all the others. Whether the cores are free
depends on what else runs: the HTTP and detokenizer processes stream every step's
tokens while the next step computes, and other programs may load the machine. So the
policy measures instead of guessing:
- prefill uses every core (the other processes are mostly idle meanwhile);
- decode starts on every core but one, and every `PROBE_EVERY` decode steps probes:
  `2 * PROBE_STEPS` steps alternate between the other candidate count (every core, or
  every core but one) and the kept one, so that each probed step is compared with its
  neighbours, of the same batch and nearly the same lengths (a batch that grows or
  drains between two separate runs of steps would decide instead of the thread count).
  When the probed steps' median costs less than `SWITCH_MARGIN` of the kept steps'
  (time per request of the batch), decode switches to that count. A probe also comes at
  once when steps cost twice what the last probe's winner did (the machine got busy), when
  the batch is half as large as at the last probe, and when it is twice as large unless
  every core already won (a larger batch only parallelizes better): the best count
  depends on the batch (a server's warm-up request decodes alone; a burst of 64 does not).
  Each probe's steps on the slower count cost time (at 16 requests on 2 cores, three
  steps of 44 ms instead of 26).
  Measured on 2 cores (docs/perf-log/cpu-decode.md, "Threads, measured"): a 100M model decodes ~1.7x
  faster on both cores of a quiet machine, a 7M model gains nothing from the second
  thread, and on a machine loaded with other work two threads can be several times
  slower than one.
The ranks of a tensor-parallel group on one machine split its cores evenly (each rank's
"every core" is its share), so that no two compute threads share a core.
OMP_NUM_THREADS, when set, fixes the count for everything.

Placement. A server with one scheduler on a CPU binds its compute threads, member i of the
forward's OpenMP team to the i-th CPU it may use (the forward's own thread, which in the
normal loop also runs the scheduler's Python between steps, to the first; in the overlap loop
the scheduler's thread keeps to the last CPU with the rest), and keeps everything else of the server
to the last CPU: the HTTP process, the detokenizer, and the scheduler's other threads (its
ZMQ I/O threads). A streamed token wakes about six threads across those processes (~1 ms of
CPU a token on 2 cores); unbound, each wake-up lands on whichever core the OS picks and
stalls the decode region's other thread at its next barrier, whichever thread it preempted.
Bound, they share the last core with the last compute thread (whose share of a linear layer
of 2 MB or more the others take over: ops.h, `Share`) and never preempt the first, which runs
the step's one-thread phases (and, in the normal loop, the scheduler's Python). Measured on 2 cores
(docs/perf-log/avx2-step-floor.md, "Placement"): one stream served 8-25% faster; 16 and 64
concurrent streams alike within the noise.
Not bound: GPUs, several scheduler ranks on the machine (tensor or data parallel), tokenizer
workers (their processes are left free; the scheduler still binds), an Engine's own process
(the caller's), `TANDEM_CPU_BIND=0`, and where the user binds OpenMP threads
(OMP_PROC_BIND, OMP_PLACES, GOMP_CPU_AFFINITY); without the C++ kernels the scheduler binds
nothing (the front end still keeps to the last CPU). A thread that the bound forward thread
starts later shares its CPU, so the scheduler's helper threads start before the binding (the
grammar backend's compile thread among them).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import statistics
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from tandem.forward_batch import ForwardMode
from tandem.kernels import cpu as cpu_kernels

logger = logging.getLogger(__name__)

PROBE_STEPS = 3  # decode steps on the probed count per probe (alternating with the kept count)
FIRST_PROBE_AFTER = 8  # decode steps before the first probe
PROBE_EVERY = 200  # decode steps between probes
SWITCH_MARGIN = 0.9  # the probed count wins when its steps cost under 90%
SLOWDOWN_PROBE = 2.0  # steps costing this many times the last probe's winner probe at once


@dataclass
class ComputeThreads:
    cores: int
    decode: int
    current: int = 0
    probes: int = 0  # probes done (for the first one's earlier start)
    _since_probe: int = 0
    _recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=PROBE_STEPS))
    _probe: list[float] | None = None  # costs while probing: even steps at `alternative()`, odd kept
    _winner_cost: float | None = None  # cost per request of the count the last probe kept
    _probe_batch: int = 0  # batch size at the last probe

    @classmethod
    def for_device(cls, device: str, ranks: int = 1) -> ComputeThreads | None:
        """The policy for a CPU scheduler, one of `ranks` sharing the machine, or None
        (GPU, or OMP_NUM_THREADS set)."""
        if device != "cpu" or "OMP_NUM_THREADS" in os.environ:
            return None
        cores = max(1, len(os.sched_getaffinity(0)) // ranks)
        return cls(cores=cores, decode=max(1, cores - 1))

    def alternative(self) -> int:
        """The decode thread count a probe tries."""
        return max(1, self.cores - 1) if self.decode == self.cores else self.cores

    def apply(self, mode: ForwardMode) -> None:
        """Set the thread count for the forward about to run."""
        if mode.is_extend():
            wanted = self.cores
        else:
            probing_alternative = self._probe is not None and len(self._probe) % 2 == 0
            wanted = self.alternative() if probing_alternative else self.decode
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted

    def observe_decode(self, seconds: float, batch_size: int) -> None:
        """Record a decode step (run at the count `apply` set); probe, or switch, when due."""
        cost = seconds / max(1, batch_size)
        if self._probe is not None:
            self._probe.append(cost)
            if len(self._probe) == 2 * PROBE_STEPS:
                probed, kept = statistics.median(self._probe[0::2]), statistics.median(self._probe[1::2])
                logger.debug(
                    "decode threads: %d cost %.2f ms/request, %d cost %.2f",
                    self.alternative(),
                    probed * 1e3,
                    self.decode,
                    kept * 1e3,
                )
                if probed < SWITCH_MARGIN * kept:
                    self.decode = self.alternative()
                    self._recent.clear()
                    self._recent.extend(self._probe[0::2])
                self._winner_cost = min(probed, kept)
                self._probe_batch = batch_size
                self._probe, self._since_probe = None, 0
                self.probes += 1
            return
        self._recent.append(cost)
        self._since_probe += 1
        if self.cores < 2 or len(self._recent) < PROBE_STEPS:
            return
        due = FIRST_PROBE_AFTER if self.probes == 0 else PROBE_EVERY
        slower = self._winner_cost is not None and statistics.median(self._recent) > SLOWDOWN_PROBE * self._winner_cost
        # A larger batch only parallelizes better: once every core won, growth is no reason.
        grew = batch_size >= 2 * self._probe_batch and self.decode < self.cores
        resized = self.probes > 0 and (grew or batch_size <= self._probe_batch / 2)
        if self._since_probe >= due or slower or (resized and self._since_probe >= PROBE_STEPS):
            self._probe = []


BIND_ENV = "TANDEM_CPU_BIND"  # "0": leave every thread where the OS puts it
USER_BINDING_ENV = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")


def front_end_cpu(device: str, local_ranks: int) -> int | None:
    """The CPU a server's other work keeps to while its compute threads are bound (see
    "Placement" above), or None where nothing is bound. `local_ranks`: the scheduler ranks on
    this machine (every replica's)."""
    if not device.startswith("cpu") or local_ranks != 1 or not hasattr(os, "sched_setaffinity"):
        return None
    if os.environ.get(BIND_ENV, "1") in ("0", "off") or any(v in os.environ for v in USER_BINDING_ENV):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[-1] if len(cpus) >= 2 else None


def keep_threads_to(cpu: int, spare: Collection[int] = ()) -> None:
    """Bind every thread of this process but `spare` (thread ids) to `cpu`; threads they
    start later inherit it."""
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        if tid not in spare:
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, {cpu})


def bind_compute_threads(threads: int, front: int) -> list[int]:
    """On the thread that runs the forwards: member i of its OpenMP team of `threads` onto
    the i-th CPU this thread may use, and the process's other threads onto `front`; returns
    the team's thread ids. Without the C++ kernels nothing is bound (PyTorch's OpenMP threads
    cannot be told from the others) and the list is empty."""
    ops = cpu_kernels.load()
    if ops is None:
        return []
    cpus = sorted(os.sched_getaffinity(0))[: max(1, threads)]
    team = list(ops.bind_threads(cpus))
    keep_threads_to(front, spare=team)
    logger.info("compute threads bound to CPUs %s; the server's other threads to CPU %d", cpus[: len(team)], front)
    return team
