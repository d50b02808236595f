"""Where the scheduler's forwards run, and how busy they keep the model.

`ForwardExecutor` runs each launched forward at once, on the scheduler's thread (the
normal loop). `ForwardThread` (the overlap loop) hands it to a dedicated forward thread
through a queue and returns at once: PyTorch releases the GIL inside its kernels, so the
scheduler processes the previous result and forms the next batch meanwhile. On CUDA
that thread issues its kernels on its own stream, after an event recorded at launch
(the scheduler's writes of KV slots and rows come first). Forwards run one at a time in
launch order in both, which is what `FutureMap` relies on.

`BatchLauncher` is the scheduler's side of it: it snapshots a batch, gives it its vocab
mask, launches it on the executor and waits for its result under the watchdog.

`ForwardStats` measures, per forward, how long it computed (busy) and how long the
forward lane sat idle waiting for the scheduler before it (idle); a gap after the
scheduler had nothing to run is not counted.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tandem.constrained.vocab_mask import batch_vocab_mask, fill_when_due
from tandem.forward_batch import ForwardMode
from tandem.scheduler.forward_watchdog import ForwardWatchdog
from tandem.scheduler.profiler import SchedulerProfiler
from tandem.scheduler.schedule_batch import ModelWorkerBatch, ScheduleBatch
from tandem.scheduler.tp_worker import GenerationBatchResult, HostBatchResult, TpModelWorker
from tandem.utils.cpu_threads import ComputeThreads, bind_compute_threads

logger = logging.getLogger(__name__)

# Forwards over which the rolling idle fraction is taken.
STATS_WINDOW = 100


class ForwardStats:
    def __init__(self, window: int = STATS_WINDOW):
        self._steps: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        self._last_end: float | None = None

    def record(self, start: float, end: float, what: str = "") -> None:
        """One forward from `start` to `end` (perf_counter s); `what` names it in the debug log."""
        idle = 0.0 if self._last_end is None else max(0.0, start - self._last_end)
        self._last_end = end
        self._steps.append((end - start, idle))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "forward %s busy %.2f ms, idle before it %.2f ms, rolling idle fraction %.3f",
                what,
                (end - start) * 1e3,
                idle * 1e3,
                self.idle_fraction(),
            )

    def mark_idle(self) -> None:
        """The scheduler has nothing to run: the next gap is not its overhead."""
        self._last_end = None

    def idle_fraction(self) -> float:
        """idle / (busy + idle) over the last STATS_WINDOW forwards (0 before any)."""
        steps = list(self._steps)
        busy, idle = sum(s[0] for s in steps), sum(s[1] for s in steps)
        return idle / (busy + idle) if busy + idle > 0 else 0.0


class ForwardExecutor:
    """Runs each forward when it is launched, on the calling thread."""

    def __init__(self, worker: TpModelWorker, ranks: int = 1):
        """`ranks`: scheduler processes sharing this machine's cores (tensor parallelism)."""
        self.worker = worker
        self.compute_threads = ComputeThreads.for_device(str(worker.device), ranks=ranks)
        self.stats = ForwardStats()
        self._bind_front: int | None = None

    def bind_cpus(self, front: int) -> None:
        """Bind the compute threads, from the next forward on (on the thread that runs it),
        and this process's other threads to CPU `front` (tandem/utils/cpu_threads.py, "Placement")."""
        self._bind_front = front

    def launch(self, mwb: ModelWorkerBatch) -> Future[GenerationBatchResult]:
        future: Future[GenerationBatchResult] = Future()
        future.set_result(self._run(mwb))
        return future

    def _run(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        mode = mwb.forward_batch.forward_mode
        if self._bind_front is not None:
            team = self.compute_threads.cores if self.compute_threads is not None else torch.get_num_threads()
            bind_compute_threads(team, self._bind_front)
            self._bind_front = None
        if self.compute_threads is not None:
            # NOTE: per thread: the forward's own. A speculative verify forward (an EXTEND of
            # a few tokens per request) takes the decode step's count.
            self.compute_threads.apply(ForwardMode.DECODE if mwb.draft_ids is not None else mode)
        start = time.perf_counter()
        result = self.worker.forward_batch_generation(mwb)
        if result.copy_done is not None:
            result.copy_done.synchronize()
        end = time.perf_counter()
        if self.compute_threads is not None and mode.is_decode():
            self.compute_threads.observe_decode(end - start, mwb.forward_batch.batch_size)
        fb = mwb.forward_batch
        what = (
            f"{mode.name} bs={fb.batch_size} tokens={fb.num_tokens} threads={torch.get_num_threads()}"
            if logger.isEnabledFor(logging.DEBUG)
            else ""
        )
        self.stats.record(start, end, what)
        return result

    def close(self) -> None:
        """Stop accepting forwards (nothing to do when they run inline)."""


class ForwardThread(ForwardExecutor):
    """Runs forwards on a dedicated thread (and, on CUDA, stream), in launch order."""

    def __init__(self, worker: TpModelWorker, ranks: int = 1):
        super().__init__(worker, ranks)
        if self.compute_threads is not None:
            # NOTE: the scheduler thread's own tensor ops are tiny; with several threads its
            # idle OpenMP workers would spin on the cores the forward's threads compute on.
            torch.set_num_threads(1)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stream = torch.cuda.Stream() if str(worker.device).startswith("cuda") else None
        # NOTE: the current CUDA device is per thread; the forward thread takes ours.
        self._cuda_device = torch.cuda.current_device() if self._stream is not None else None
        self._thread = threading.Thread(target=self._loop, name="forward", daemon=True)
        self._thread.start()

    def launch(self, mwb: ModelWorkerBatch) -> Future[GenerationBatchResult]:
        future: Future[GenerationBatchResult] = Future()
        launched = None
        if self._stream is not None:
            launched = torch.cuda.Event()
            launched.record()  # after the scheduler's writes on its stream
        self._queue.put((mwb, launched, future))
        return future

    def _loop(self) -> None:
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            while (item := self._queue.get()) is not None:
                mwb, launched, future = item
                if launched is not None:
                    self._stream.wait_event(launched)
                try:
                    future.set_result(self._run(mwb))
                except BaseException as e:  # noqa: BLE001 - re-raised in the scheduler's thread
                    future.set_exception(e)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


@dataclass
class LaunchedBatch:
    """A batch whose forward was launched; its result arrives through `future`."""

    batch: ScheduleBatch
    mwb: ModelWorkerBatch
    future: Future[GenerationBatchResult]


class BatchLauncher:
    """Launch a batch's forward and wait for its result, on either executor."""

    def __init__(
        self,
        executor: ForwardExecutor,
        watchdog: ForwardWatchdog,
        profiler: SchedulerProfiler,
        grammar_backend,
        vocab_size: int,
        device: str,
    ):
        self.executor = executor
        self.watchdog = watchdog
        self.profiler = profiler
        self.grammar_backend = grammar_backend
        self.vocab_size = vocab_size
        self.device = device

    def launch(self, batch: ScheduleBatch, fill_vocab_mask: bool = True) -> LaunchedBatch:
        """Snapshot `batch` (advancing its requests' lengths) and start its forward. A batch
        with constrained requests carries a vocab mask, filled now unless `fill_vocab_mask`
        is False (then `fill_vocab_mask` later: the worker's sampling waits for it)."""
        mwb = batch.launch(self.vocab_size, self.device)
        mwb.vocab_mask = batch_vocab_mask(self.grammar_backend, batch.reqs, fill_vocab_mask)
        return LaunchedBatch(batch, mwb, self.executor.launch(mwb))

    def fill_vocab_mask(self, launched: LaunchedBatch) -> None:
        """Fill `launched`'s vocab mask if it was left for later (see `fill_when_due`)."""
        fill_when_due(self.grammar_backend, launched.mwb.vocab_mask, launched.batch.reqs)

    def wait(self, launched: LaunchedBatch) -> HostBatchResult:
        """The result of a launched forward, on the host (the overlap loop)."""
        self.fill_vocab_mask(launched)  # never wait on a sampler that waits for its mask
        with self.watchdog.watching(launched.batch):
            launched.future.result()
        return self._host_result(launched)

    def run(self, batch: ScheduleBatch) -> HostBatchResult:
        """Launch `batch` and wait for its result (the normal loop: the forward runs inside
        `launch`, so the watchdog watches that)."""
        with self.watchdog.watching(batch):
            launched = self.launch(batch)
        return self._host_result(launched)

    def _host_result(self, launched: LaunchedBatch) -> HostBatchResult:
        self.profiler.step()
        return launched.future.result().to_host(launched.mwb)
