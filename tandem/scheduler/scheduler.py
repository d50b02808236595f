"""The scheduler process: continuous batching around one model worker.

The loop; both variants share batch forming (`BatchFormer.next_batch`) and result
processing (`process_batch_result`):
    normal:   recv -> batch = next batch -> result = run(batch) -> process_batch_result
    overlap:  recv -> batch = next batch -> launch(batch) on the forward thread
              -> process the PREVIOUS batch's result while this one computes
Each request that finishes ends in one place (`_end`): its KV goes to the prefix cache (or
back to the pool with --disable-radix-cache) and it leaves the running set once reported.

Where the rest lives: which requests run next, admission and retraction in
batch_former.py (with schedule_policy.py); launching a forward and waiting for it in
forward_executor.py; control calls and weight updates in control.py; a request's own
state and how a result advances it in schedule_batch.py; its KV in mem_cache/req_kv.py.

Constrained requests (tandem/constrained) wait in the grammar queue until their grammar
has compiled; a batch holding any carries a vocab mask, filled from their matchers once
every earlier result is processed (under overlap, while the batch computes: delayed
sampling), and each accepted token advances the matcher.

Failure is isolated per request: a message or a result whose handling raises ends only
its own request, with a 500 finish (`finish_reason.internal_error`).
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from typing import Any

from tandem import finish_reason
from tandem.constrained.backend import create_grammar_backend
from tandem.constrained.grammar_queue import GrammarQueue
from tandem.mem_cache.chunk_cache import ChunkCache
from tandem.mem_cache.radix_cache import RadixCache
from tandem.mem_cache.req_kv import ReqKVManager
from tandem.messages import AbortReq, TokenizedGenerateReqInput
from tandem.sampling.custom_logit_processor import ENABLE_FLAG, RequestProcessor
from tandem.sampling.sampling_params import SamplingParams
from tandem.scheduler.batch_former import BatchFormer
from tandem.scheduler.control import SchedulerControl
from tandem.scheduler.finish_check import FinishChecker
from tandem.scheduler.forward_executor import BatchLauncher, ForwardExecutor, ForwardThread, LaunchedBatch
from tandem.scheduler.forward_watchdog import ForwardWatchdog
from tandem.scheduler.profiler import SchedulerProfiler
from tandem.scheduler.schedule_batch import Req, ScheduleBatch
from tandem.scheduler.scheduler_io import SchedulerIOBase
from tandem.scheduler.scheduler_output import build_batch_output
from tandem.scheduler.throughput import GenThroughput
from tandem.scheduler.tp_worker import HostBatchResult, TpModelWorker
from tandem.server_args import ServerArgs
from tandem.speculative.spec_decoder import SpecReqState, SpeculativeDecoder
from tandem.utils.tokenizer import get_eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

# How long an idle scheduler blocks waiting for input, in milliseconds; and while a
# grammar compiles (nothing else to run).
IDLE_POLL_MS = 1000
GRAMMAR_POLL_MS = 2
# SGLang's request timeouts (seconds; unset or <= 0: off) and the aborts they end with.
WAITING_TIMEOUT_ENV = "SGLANG_REQ_WAITING_TIMEOUT"
RUNNING_TIMEOUT_ENV = "SGLANG_REQ_RUNNING_TIMEOUT"
WAITING_TIMEOUT_MESSAGE = "Request waiting timeout reached."
RUNNING_TIMEOUT_MESSAGE = "Request running timeout reached."
TIMEOUT_STATUS = 503
# --max-queued-requests: SGLang's words for the refused newcomer, and for the waiting
# request a higher-priority newcomer pushes out (both 503).
QUEUE_FULL_MESSAGE = "The request queue is full."
OUTRANKED_MESSAGE = "The request is aborted by a higher priority request."


def timeout_from_env(name: str) -> float | None:
    """Seconds from environment variable `name`; None when unset, empty or <= 0 (off)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{name}: must be a number of seconds, got {raw!r}") from None
    return seconds if seconds > 0 else None


class Scheduler:
    def __init__(
        self,
        server_args: ServerArgs,
        io: SchedulerIOBase,
        worker: TpModelWorker | None = None,
        tp_rank: int = 0,
        forward_stamp: Any = None,
        dp_rank: int | None = None,
    ):
        """`io` receives and sends every message; `worker` runs the forwards (built from
        `server_args` when not given: tests inject their own)."""
        self.server_args = server_args
        self.io = io
        self.worker = (
            worker if worker is not None else TpModelWorker(server_args, tp_rank=tp_rank, tp_size=server_args.tp_size)
        )
        runner = self.worker.model_runner
        self.max_running_requests = runner.max_running_requests
        self.max_total_num_tokens = runner.max_total_num_tokens
        self.context_len = runner.context_len
        self.tokenizer = None if server_args.skip_tokenizer_init else load_tokenizer(server_args.tokenizer_path)
        self.finish_checker = FinishChecker(
            self.tokenizer, get_eos_token_ids(runner.config, self.tokenizer, server_args.model_path)
        )
        # Constrained decoding: requests wait in the grammar queue until their grammar compiled.
        self.grammar_backend = create_grammar_backend(
            server_args.grammar_backend,
            self.tokenizer,
            runner.vocab_size,
            sorted(self.finish_checker.eos_token_ids),
            any_whitespace=not server_args.constrained_json_disable_any_whitespace,
        )
        self.grammar_queue = GrammarQueue(self.grammar_backend, blocking=server_args.tp_size > 1)

        cache_cls = ChunkCache if server_args.disable_radix_cache else RadixCache
        self.tree_cache = cache_cls(runner.token_to_kv_pool)
        self.kv = ReqKVManager(runner.req_to_token_pool, runner.token_to_kv_pool, self.tree_cache)
        # --speculative-algorithm: verify batches replace decode steps (tandem/speculative).
        self.spec = SpeculativeDecoder(server_args, runner) if server_args.speculative_algorithm else None
        self.batches = BatchFormer(server_args, self.kv, self.max_running_requests, self.spec)

        self.enable_overlap = not server_args.disable_overlap_schedule
        executor_cls = ForwardThread if self.enable_overlap else ForwardExecutor
        # The scheduler processes sharing this machine's cores.
        self.executor = executor_cls(self.worker, ranks=server_args.local_scheduler_ranks)
        # --watchdog-timeout; `forward_stamp` is shared with the main process (its /health).
        self.watchdog = ForwardWatchdog(server_args.watchdog_timeout, forward_stamp)
        self.profiler = SchedulerProfiler(tp_rank, dp_rank)
        self.launcher = BatchLauncher(
            self.executor, self.watchdog, self.profiler, self.grammar_backend, runner.vocab_size, runner.device
        )
        # Overlap loop: the launched batch whose result is not processed yet.
        self.inflight: LaunchedBatch | None = None
        self.control = SchedulerControl(self)
        self.num_finished_reqs = 0
        self.gen_throughput = GenThroughput()  # output tokens per second, for /v1/loads
        # SGLang's SGLANG_REQ_WAITING_TIMEOUT / SGLANG_REQ_RUNNING_TIMEOUT (None: off).
        self.waiting_timeout = timeout_from_env(WAITING_TIMEOUT_ENV)
        self.running_timeout = timeout_from_env(RUNNING_TIMEOUT_ENV)

    def info(self) -> dict:
        """Resolved capacities reported to the parent at start-up."""
        runner = self.worker.model_runner
        gguf = getattr(runner.config, "gguf", None)  # the GGUF file(s) and tensor types, if any
        return {
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": self.max_running_requests,
            "context_length": self.context_len,
            "vocab_size": runner.vocab_size,
            "eos_token_ids": sorted(self.finish_checker.eos_token_ids),
            **({"gguf": gguf} if gguf else {}),
        }

    # ---- the loops -----------------------------------------------------------------
    def event_loop(self) -> None:
        """The overlap loop, or the normal one under --disable-overlap-schedule."""
        while True:
            self.process_input_requests(self.recv_requests())
            self.control.update_weights_when_idle()
            if not self.step():
                self.executor.stats.mark_idle()
                self.io.wait(GRAMMAR_POLL_MS if len(self.grammar_queue) else IDLE_POLL_MS)

    def step(self) -> bool:
        """One step of the selected loop after its input; False when there was no work."""
        return self.step_overlap() if self.enable_overlap else self.step_normal()

    def next_batch(self) -> ScheduleBatch | None:
        """The next batch; the request timeouts are applied around its forming: running
        requests past the running timeout are marked first (as SGLang, before a batch is
        launched), waiting requests past the waiting timeout end after admission (one
        that this batch admits is not timed out)."""
        self.abort_on_running_timeout()
        batch = self.batches.next_batch(admit=not self.control.admission_paused(), make_room=self.sync_inflight)
        self.abort_on_waiting_timeout()
        return batch

    def abort_on_running_timeout(self) -> None:
        """SGLang's running timeout: a running request whose first forward was formed
        longer ago than SGLANG_REQ_RUNNING_TIMEOUT ends at its next result with a 503
        abort (its outputs so far are kept in the finish record)."""
        if self.running_timeout is None:
            return
        deadline = time.perf_counter() - self.running_timeout
        for req in self.batches.running:
            if not req.finished() and req.to_abort is None and 0 < req.forward_entry_time < deadline:
                req.to_abort, req.to_abort_status = RUNNING_TIMEOUT_MESSAGE, TIMEOUT_STATUS

    def abort_on_waiting_timeout(self) -> None:
        """SGLang's waiting timeout: a request that has waited in the queue longer than
        SGLANG_REQ_WAITING_TIMEOUT without starting ends now with a 503 abort. A
        retracted request (it has run) is not timed out here; the running timeout
        counts for it."""
        if self.waiting_timeout is None or not self.batches.waiting_queue:
            return
        deadline = time.perf_counter() - self.waiting_timeout
        expired = self.batches.take_waiting(lambda r: not r.admitted_once and 0 < r.queue_entry_time < deadline)
        for req in expired:
            req.finished_reason = finish_reason.abort(WAITING_TIMEOUT_MESSAGE, TIMEOUT_STATUS)
            self._end(req)
        if expired:
            self.send_outputs(expired)

    def step_normal(self) -> bool:
        """event_loop_normal's step: form a batch, run it, process its result."""
        batch = self.next_batch()
        if batch is None:
            return False
        self.process_batch_result(batch, self.launcher.run(batch))
        return True

    def step_overlap(self) -> bool:
        """event_loop_overlap's step: launch batch N, then process batch N-1's result
        while N computes. A prefill's result is processed before the next batch is
        formed: its requests decode from it, and two prefills in a row keep their first
        tokens prompt (SGLang's rule)."""
        if self.inflight is not None and self.inflight.batch.forward_mode.is_extend():
            self.sync_inflight()
        batch = self.next_batch()
        previous, self.inflight = self.inflight, None
        if batch is not None:
            # Delayed sampling: with a result pending, the grammars have not seen its
            # tokens yet; its processing fills the mask while `batch` computes.
            self.inflight = self.launcher.launch(batch, fill_vocab_mask=previous is None)
        if previous is not None:
            self.process_batch_result(previous.batch, self.launcher.wait(previous))
        return batch is not None or previous is not None

    def sync_inflight(self) -> bool:
        """Process the result in flight now (what comes next depends on it); False if none."""
        launched, self.inflight = self.inflight, None
        if launched is None:
            return False
        self.process_batch_result(launched.batch, self.launcher.wait(launched))
        return True

    # ---- input ---------------------------------------------------------------------
    def recv_requests(self) -> list:
        return self.io.recv()

    def process_input_requests(self, reqs: list) -> None:
        """Handle each message; one that raises ends only its own request."""
        for msg in reqs:
            try:
                self.handle_input(msg)
            except Exception as e:  # noqa: BLE001 - the second wall
                self._input_failed(msg, e)
        self.move_ready_grammar_requests()

    def handle_input(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            self.handle_generate_request(msg)
        elif isinstance(msg, AbortReq):
            self.handle_abort(msg)
        elif self.control.handles(msg):
            self.control.handle(msg)
        else:
            logger.error("scheduler got an unknown message %r", type(msg))

    def _input_failed(self, msg, exc: Exception) -> None:
        """A request whose input raised finishes at once with an error; a control message
        that raised is logged (its caller times out)."""
        if not isinstance(msg, TokenizedGenerateReqInput):
            logger.error("handling %s failed:\n%s", type(msg).__name__, traceback.format_exc())
            return
        req = Req(rid=msg.rid, origin_input_ids=[], sampling_params=SamplingParams())
        self._fail(req, "handling its input", exc)
        self.send_outputs([req])

    def handle_generate_request(self, msg: TokenizedGenerateReqInput) -> None:
        req = Req.from_message(msg)
        if self.spec is not None:
            req.spec = SpecReqState()
        priority = self.batches.priority
        if priority is not None and req.priority is None:
            req.priority = priority.lowest
        limit = self.server_args.max_queued_requests
        if limit is not None and len(self.batches.waiting_queue) + len(self.grammar_queue) >= limit:
            # SGLang's answers: the newcomer is refused, unless priority scheduling finds a
            # waiting request it strictly outranks (the least preferred, newest): that one goes.
            waiting = [r for r in self.batches.waiting_queue if not r.admitted_once]
            worst = max(waiting, key=priority.key, default=None) if priority is not None else None
            if worst is None or priority.preference(req) >= priority.preference(worst):
                req.finished_reason = finish_reason.abort(QUEUE_FULL_MESSAGE, TIMEOUT_STATUS)
                self.send_outputs([req])
                return
            self.batches.take_waiting(lambda r: r is worst)
            worst.finished_reason = finish_reason.abort(OUTRANKED_MESSAGE, TIMEOUT_STATUS)
            self._end(worst)
            self.send_outputs([worst])
        req.set_output_limits(min(self.context_len, self.max_total_num_tokens), self.finish_checker.eos_token_ids)
        if req.lora_name is not None:
            req.lora_uid = self.control.lora.uid_of(req.lora_name)
            if req.lora_uid is None:  # unloaded since the tokenizer manager checked it
                req.finished_reason = finish_reason.abort(
                    f"lora_path: LoRA adapter {req.lora_name!r} is not loaded", 400
                )
                self.send_outputs([req])
                return
        if msg.custom_logit_processor is not None and not self._load_custom_logit_processor(req, msg):
            self.send_outputs([req])
            return
        if req.sampling_params.grammar_key() is None:
            req.queue_entry_time = time.perf_counter()
            self.batches.waiting_queue.append(req)
        elif self.grammar_backend is None:  # the tokenizer manager refuses these first
            req.finished_reason = finish_reason.abort("structured output is disabled on this server", 400)
            self.send_outputs([req])
        else:
            self.grammar_queue.add(req)

    def _load_custom_logit_processor(self, req: Req, msg: TokenizedGenerateReqInput) -> bool:
        """Deserialize the request's processor on this rank (every rank runs its own copy
        of it); False, with the request finished by a 400, when that fails."""
        if not self.server_args.enable_custom_logit_processor:  # the tokenizer manager refuses these first
            req.finished_reason = finish_reason.abort(
                f"custom_logit_processor: the server was not started with {ENABLE_FLAG}", 400
            )
            return False
        try:
            req.custom_logit_processor = RequestProcessor.build(
                msg.custom_logit_processor, req.sampling_params.custom_params
            )
        except Exception as e:  # noqa: BLE001 - the client's code: only its request fails
            logger.warning("request %s: its custom logit processor failed to load: %r", req.rid, e)
            req.finished_reason = finish_reason.abort(
                f"custom_logit_processor: could not be deserialized: {type(e).__name__}: {e}", 400
            )
            return False
        return True

    def move_ready_grammar_requests(self) -> None:
        """Requests whose grammar compiled join the waiting queue; those whose grammar
        failed (or timed out) finish with a 400."""
        if not len(self.grammar_queue):
            return
        ready, failed = self.grammar_queue.pop_ready()
        now = time.perf_counter()
        for req in ready:
            req.queue_entry_time = now
        self.batches.waiting_queue.extend(ready)
        if failed:
            self.send_outputs(failed)

    def handle_abort(self, msg: AbortReq) -> None:
        """Waiting requests that match end now; running ones at their next result."""

        def match(req: Req) -> bool:
            return msg.abort_all or req.rid == msg.rid

        aborted = self.batches.take_waiting(match) + self.grammar_queue.remove(match)
        for req in aborted:
            req.finished_reason = finish_reason.abort(msg.message)
            self._end(req)  # a retracted request holds no KV; this is a no-op then
        if aborted:
            self.send_outputs(aborted)
        for req in self.active_reqs():
            if match(req):
                req.to_abort = msg.message

    def active_reqs(self) -> list[Req]:
        """Unfinished requests that hold or are computing KV: running, chunked, and the
        newly admitted ones of a prefill still in flight."""
        reqs = {id(r): r for r in self.batches.running}
        if self.batches.chunked_req is not None:
            reqs[id(self.batches.chunked_req)] = self.batches.chunked_req
        if self.inflight is not None:
            reqs.update((id(r), r) for r in self.inflight.batch.reqs if not r.finished())
        return list(reqs.values())

    # ---- results -------------------------------------------------------------------
    def process_batch_result(self, batch: ScheduleBatch, result: HostBatchResult) -> None:
        """Advance every request of the batch by its result; one whose processing raises
        (finish check, stop-string decode, ...) ends alone with an error. A request that
        finished after this batch was launched (overlap) is skipped: its extra token is
        dropped, and its KV was released when it finished."""
        advanced = []
        generated = 0
        for i, req in enumerate(batch.reqs):
            if req.finished():
                continue
            advanced.append(req)
            before = len(req.output_ids)
            try:
                self._apply_result(batch, result, i)
            except Exception as e:  # noqa: BLE001 - the second wall
                self._fail(req, "processing its output", e)
            if req.finished():
                self._end(req)
            generated += len(req.output_ids) - before
        self.gen_throughput.add(generated)
        if self.inflight is not None:  # delayed sampling: its sampler waits for the mask, not for our outputs
            self.launcher.fill_vocab_mask(self.inflight)
        self.send_outputs(advanced)

    def _apply_result(self, batch: ScheduleBatch, result: HostBatchResult, i: int) -> None:
        """Advance batch.reqs[i] by its row of `result`: a chunk of a longer prompt caches its
        KV; otherwise its token is accepted and the finish checked. A request that finished
        here is ended by the caller; one that just completed its prefill starts running."""
        req, token_id = batch.reqs[i], result.next_token_ids[i]
        prefilling = batch.is_prefill(i)  # False for running requests mixed into a prefill
        if prefilling and result.input_logprobs and result.input_logprobs[i] is not None:
            req.record_input_logprobs(result.input_logprobs[i])
        if prefilling and req.kv_len < req.seq_len:  # a chunk of a longer prompt
            self.kv.cache_unfinished(req)
            req.finished_reason = req.abort_reason()
            return
        req.pending_tokens -= 1
        if req is self.batches.chunked_req:
            self.batches.chunked_req = None
        if prefilling:
            self.kv.cache_unfinished(req)
        if i in result.failed:  # its custom logit processor raised: its token is not kept
            logger.warning("request %s: %s", req.rid, result.failed[i])
            req.finished_reason = finish_reason.abort(result.failed[i], 400)
            return
        if req.sampling_params.max_new_tokens == 0:  # prefill only (e.g. prompt logprobs, /v1/score)
            if req.return_logprob:
                req.record_output_logprobs(result, i, token_id=None)
            req.finished_reason = finish_reason.length(0)
            return
        kept = 0  # under speculation: its accepted drafts and the bonus token, up to its finish
        for row in result.rows_of(i):
            token_id = result.next_token_ids[row]
            req.accept_token(token_id)
            if req.return_logprob:
                req.record_output_logprobs(result, row, token_id)
            req.finished_reason = req.abort_reason() or self.finish_checker.check(req)
            kept += 1
            if req.finished():
                break
        if self.spec is not None and not prefilling:
            self.spec.record_step(req, len(batch.draft_ids[i]) if batch.draft_ids else 0, kept - 1)
            self.kv.release_rejected(req)
        if prefilling and not req.finished():
            self.batches.running.append(req)

    def _fail(self, req: Req, where: str, exc: Exception) -> None:
        """`req` ends alone with an error finish after handling it raised."""
        logger.error("request %s failed while %s:\n%s", req.rid, where, traceback.format_exc())
        req.finished_reason = finish_reason.internal_error(where, exc)

    def _end(self, req: Req) -> None:
        """Where a finished request ends: its KV released (a no-op if it holds none or was
        already released). It leaves the running set and the chunk slot in `send_outputs`."""
        self.kv.release(req)

    # ---- output --------------------------------------------------------------------
    def send_outputs(self, reqs: list[Req]) -> None:
        """One BatchTokenIDOutput for every request of `reqs` that has something due;
        finished requests leave the running set."""

        def failed(req: Req, exc: Exception) -> None:
            self._fail(req, "building its output", exc)
            self._end(req)

        out = build_batch_output(reqs, self.server_args.stream_interval, self.control.weight_version, failed)
        self.batches.drop_finished()
        if out is not None:
            self.num_finished_reqs += sum(o.finished_reason is not None for o in out.outputs)
            self.io.send_output(out)
