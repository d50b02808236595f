"""The scheduler process: continuous batching around one model worker.

Loops (DESIGN.md §4); both share batch forming (`get_next_batch_to_run`) and result
processing (`process_batch_result`):
    normal:   recv -> batch = get_next_batch_to_run() -> result = run_batch(batch)
              -> process_batch_result(batch, result)
    overlap:  recv -> batch = get_next_batch_to_run() -> launch(batch) on the forward
              thread -> process the PREVIOUS batch's result while this one computes
Prefill (EXTEND) batches have priority, except that a decode step of the running
requests follows every chunk of a chunked prefill, so decode never stalls behind a
long prompt. Finished requests leave the running set at once; their KV goes to the
prefix cache (or back to the pool with --disable-radix-cache).

Memory: admission (schedule_policy.PrefillAdder) reserves an estimate of the KV that
admitted requests will still need. When a decode step finds no free slot anyway, the
running requests that lose least are retracted: their KV is released (into the prefix
cache) and they return to the front of the queue with their outputs kept, to resume.

Constrained requests (tandem/constrained) wait in the grammar queue until their grammar
has compiled; a batch holding any carries a vocab mask, filled from their matchers once
every earlier result is processed (under overlap, while the batch computes: delayed
sampling), and each accepted token advances the matcher.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from tandem.constrained.grammar_queue import GrammarQueue
from tandem.constrained.vocab_mask import VocabMask
from tandem.constrained.xgrammar_backend import XGrammarBackend
from tandem.distributed import init_tp_group, is_peer_failure
from tandem.distributed.placement import SchedulerRank, describe_other_nodes, gpu_id, init_method
from tandem.managers.finish_check import FinishChecker
from tandem.managers.forward_executor import ForwardExecutor, ForwardThread
from tandem.managers.forward_watchdog import ForwardWatchdog
from tandem.managers.io_struct import (
    AbortReq,
    ControlOutput,
    ControlReq,
    FlushCacheOutput,
    FlushCacheReq,
    GetServerStateReq,
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    ProfileReq,
    ReadyMessage,
    ServerStateOutput,
    TokenizedGenerateReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsReq,
    error_finish_reason,
)
from tandem.managers.profiler import SchedulerProfiler
from tandem.managers.schedule_batch import ModelWorkerBatch, Req, ScheduleBatch
from tandem.managers.schedule_policy import NewTokenRatio, PrefillAdder, SchedulePolicy
from tandem.managers.scheduler_io import SchedulerIOBase, make_scheduler_io
from tandem.managers.scheduler_output import build_batch_output
from tandem.managers.throughput import GenThroughput
from tandem.managers.tp_worker import GenerationBatchResult, HostBatchResult, TpModelWorker
from tandem.mem_cache.chunk_cache import ChunkCache
from tandem.mem_cache.radix_cache import RadixCache
from tandem.mem_cache.req_kv import ReqKVManager
from tandem.forward_batch import ForwardMode
from tandem.sampling.sampling_params import SamplingParams
from tandem.server_args import PortArgs, ServerArgs
from tandem.utils import zmq_io
from tandem.utils.process import (
    configure_logging, ignore_stop_signals, report_scheduler_failure, set_parent_death_signal, set_process_title,
)
from tandem.utils.tokenizer import get_eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

# How long an idle scheduler blocks waiting for input, in milliseconds; and while a
# grammar compiles (nothing else to run).
IDLE_POLL_MS = 1000
GRAMMAR_POLL_MS = 2


@dataclass
class LaunchedBatch:
    """A batch whose forward was launched; its result arrives through `future`."""

    batch: ScheduleBatch
    mwb: ModelWorkerBatch
    future: "Future[GenerationBatchResult]"


class Scheduler:
    def __init__(self, server_args: ServerArgs, io: SchedulerIOBase, worker: TpModelWorker | None = None,
                 tp_rank: int = 0, forward_stamp: Any = None, dp_rank: int | None = None):
        """`io` receives and sends every message; `worker` runs the forwards (built from
        `server_args` when not given: tests inject their own)."""
        self.server_args = server_args
        self.io = io
        self.worker = worker if worker is not None else TpModelWorker(
            server_args, tp_rank=tp_rank, tp_size=server_args.tp_size)
        runner = self.worker.model_runner
        self.device = runner.device
        self.vocab_size = runner.vocab_size
        self.max_running_requests = runner.max_running_requests
        self.max_total_num_tokens = runner.max_total_num_tokens
        self.gguf = getattr(runner.config, "gguf", None)  # the GGUF file(s) and tensor types, if any
        self.context_len = runner.context_len
        self.tokenizer = None if server_args.skip_tokenizer_init else load_tokenizer(server_args.tokenizer_path)
        self.finish_checker = FinishChecker(
            self.tokenizer, get_eos_token_ids(runner.config, self.tokenizer, server_args.model_path))
        # Constrained decoding: requests wait in the grammar queue until their grammar compiled.
        self.grammar_backend = None
        if server_args.grammar_backend == "xgrammar" and self.tokenizer is not None:
            self.grammar_backend = XGrammarBackend(
                self.tokenizer, self.vocab_size, sorted(self.finish_checker.eos_token_ids),
                any_whitespace=not server_args.constrained_json_disable_any_whitespace)
        self.grammar_queue = GrammarQueue(self.grammar_backend, blocking=server_args.tp_size > 1)

        cache_cls = ChunkCache if server_args.disable_radix_cache else RadixCache
        self.tree_cache = cache_cls(runner.token_to_kv_pool)
        self.kv = ReqKVManager(runner.req_to_token_pool, runner.token_to_kv_pool, self.tree_cache)
        self.policy = SchedulePolicy(server_args.schedule_policy, self.kv)
        self.new_token_ratio = NewTokenRatio()
        self.chunk_size = server_args.chunked_prefill_size if server_args.chunked_prefill_size > 0 else None
        self.enable_overlap = not server_args.disable_overlap_schedule
        executor_cls = ForwardThread if self.enable_overlap else ForwardExecutor
        # The scheduler processes sharing this machine's cores (every replica's ranks on this node).
        self.executor = executor_cls(self.worker, ranks=server_args.dp_size * server_args.tp_size // server_args.nnodes)
        # --watchdog-timeout; `forward_stamp` is shared with the main process (its /health).
        self.watchdog = ForwardWatchdog(server_args.watchdog_timeout, forward_stamp)
        self.profiler = SchedulerProfiler(tp_rank, dp_rank)

        self.waiting_queue: list[Req] = []
        self.running: list[Req] = []
        # The request whose prompt is being prefilled chunk by chunk (not yet running).
        self.chunked_req: Req | None = None
        self.last_batch_was_chunk = False
        self.num_finished_reqs = 0
        self.gen_throughput = GenThroughput()  # output tokens per second, for /v1/loads
        # Overlap loop: the launched batch whose result is not processed yet.
        self.inflight: LaunchedBatch | None = None
        # A weight update waiting for the running requests to finish; admission is paused
        # meanwhile (`update_weights_when_idle`).
        self.pending_weight_update: UpdateWeightsReq | None = None
        self.weight_version = "default"
        self.num_weight_updates = 0
        # Control calls: message type -> handler returning the reply (None: it replies later).
        self.control_handlers: dict[type, Callable[[Any], ControlOutput | None]] = {
            GetServerStateReq: lambda msg: self.server_state(msg.request_id),
            FlushCacheReq: lambda msg: self.flush_cache(msg.request_id),
            ProfileReq: self.profiler.handle,
            UpdateWeightFromDiskReqInput: self.handle_update_weights,
            UpdateWeightsFromTensorReqInput: self.handle_update_weights,
            GetWeightsByNameReqInput: self.get_weights_by_name,
        }

    def info(self) -> dict:
        """Resolved capacities reported to the parent at start-up."""
        return {
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": self.max_running_requests,
            "context_length": self.context_len,
            "vocab_size": self.vocab_size,
            "eos_token_ids": sorted(self.finish_checker.eos_token_ids),
            **({"gguf": self.gguf} if self.gguf else {}),
        }

    # ---- the loops -----------------------------------------------------------------
    def event_loop(self) -> None:
        """The overlap loop, or the normal one under --disable-overlap-schedule."""
        while True:
            self.process_input_requests(self.recv_requests())
            self.update_weights_when_idle()
            if not self.step():
                self.executor.stats.mark_idle()
                self.io.wait(GRAMMAR_POLL_MS if len(self.grammar_queue) else IDLE_POLL_MS)

    def step(self) -> bool:
        """One step of the selected loop after its input; False when there was no work."""
        return self.step_overlap() if self.enable_overlap else self.step_normal()

    def step_normal(self) -> bool:
        """event_loop_normal's step: form a batch, run it, process its result."""
        batch = self.get_next_batch_to_run()
        if batch is None:
            return False
        self.process_batch_result(batch, self.run_batch(batch))
        return True

    def step_overlap(self) -> bool:
        """event_loop_overlap's step: launch batch N, then process batch N-1's result
        while N computes. A prefill's result is processed before the next batch is
        formed: its requests decode from it, and two prefills in a row keep their first
        tokens prompt (SGLang's rule)."""
        if self.inflight is not None and self.inflight.batch.forward_mode.is_extend():
            self.sync_inflight()
        batch = self.get_next_batch_to_run()
        previous, self.inflight = self.inflight, None
        if batch is not None:
            # Delayed sampling: with a result pending, the grammars have not seen its
            # tokens yet; its processing fills the mask while `batch` computes.
            self.inflight = self.launch(batch, fill_vocab_mask=previous is None)
        if previous is not None:
            self.process_launched(previous)
        return batch is not None or previous is not None

    # ---- input ---------------------------------------------------------------------
    def recv_requests(self) -> list:
        return self.io.recv()

    def process_input_requests(self, reqs: list) -> None:
        """Handle each message; one that raises ends only its own request (DESIGN.md §9)."""
        for msg in reqs:
            try:
                self.handle_input(msg)
            except Exception as e:  # noqa: BLE001 - the second wall
                self._input_failed(msg, e)
        self.move_ready_grammar_requests()

    def move_ready_grammar_requests(self) -> None:
        """Requests whose grammar compiled join the waiting queue; those whose grammar
        failed (or timed out) finish with a 400."""
        if not len(self.grammar_queue):
            return
        ready, failed = self.grammar_queue.pop_ready()
        self.waiting_queue.extend(ready)
        if failed:
            self.send_outputs(failed)

    def handle_input(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            self.handle_generate_request(msg)
        elif isinstance(msg, AbortReq):
            self.handle_abort(msg)
        elif isinstance(msg, ControlReq) and type(msg) in self.control_handlers:
            reply = self.control_handlers[type(msg)](msg)
            if reply is not None:
                self.io.send_reply(reply)
        else:
            logger.error("scheduler got an unknown message %r", type(msg))

    def _input_failed(self, msg, exc: Exception) -> None:
        """A request whose input raised finishes at once with an error; a control message
        that raised is logged (its caller times out)."""
        if not isinstance(msg, TokenizedGenerateReqInput):
            logger.error("handling %s failed:\n%s", type(msg).__name__, traceback.format_exc())
            return
        req = Req(rid=msg.rid, origin_input_ids=[], sampling_params=SamplingParams())
        self._abort_on_error(req, "handling its input", exc)
        self.send_outputs([req])

    def handle_generate_request(self, msg: TokenizedGenerateReqInput) -> None:
        req = Req(rid=msg.rid, origin_input_ids=list(msg.input_ids), sampling_params=msg.sampling_params,
                  stream=msg.stream, return_logprob=msg.return_logprob,
                  logprob_start_len=msg.logprob_start_len, top_logprobs_num=msg.top_logprobs_num,
                  token_ids_logprob=msg.token_ids_logprob)
        limit = self.server_args.max_queued_requests
        if limit is not None and len(self.waiting_queue) + len(self.grammar_queue) >= limit:
            req.finished_reason = {"type": "abort", "status_code": 503,
                                   "message": f"the server is busy: {limit} requests are already waiting"}
            self.send_outputs([req])
            return
        sp = req.sampling_params
        # The tokenizer manager has rejected prompts that cannot fit the context or the
        # KV pool; the output is capped so that one request alone always fits both.
        sp.max_new_tokens = min(sp.max_new_tokens, self.context_len - req.prompt_len,
                                self.max_total_num_tokens - req.prompt_len)
        sp.min_new_tokens = min(sp.min_new_tokens, sp.max_new_tokens)
        if sp.min_new_tokens > 0:
            # A grammar ends only with EOS (its stop token), so it decides where the output ends.
            eos = set() if sp.ignore_eos or sp.grammar_key() is not None else self.finish_checker.eos_token_ids
            req.min_tokens_banned = sorted(set(sp.stop_token_ids) | eos)
        if sp.grammar_key() is None:
            self.waiting_queue.append(req)
        elif self.grammar_backend is None:  # the tokenizer manager refuses these first
            req.finished_reason = {"type": "abort", "status_code": 400,
                                   "message": "structured output is disabled on this server"}
            self.send_outputs([req])
        else:
            self.grammar_queue.add(req)

    def active_reqs(self) -> list[Req]:
        """Unfinished requests that hold or are computing KV: running, chunked, and the
        newly admitted ones of a prefill still in flight."""
        reqs = {id(r): r for r in self.running}
        if self.chunked_req is not None:
            reqs[id(self.chunked_req)] = self.chunked_req
        if self.inflight is not None:
            reqs.update((id(r), r) for r in self.inflight.batch.reqs if not r.finished())
        return list(reqs.values())

    def server_state(self, request_id: str) -> ServerStateOutput:
        return ServerStateOutput(
            request_id=request_id,
            max_total_num_tokens=self.max_total_num_tokens,
            free_kv_slots=self.kv.token_to_kv_pool.available_size(),
            evictable_cached_slots=self.tree_cache.evictable_size(),
            protected_cached_slots=self.tree_cache.protected_size(),
            num_running_reqs=len(self.active_reqs()),
            num_waiting_reqs=len(self.waiting_queue) + len(self.grammar_queue),
            free_req_rows=self.kv.req_to_token_pool.available_size(),
            forward_idle_fraction=self.executor.stats.idle_fraction(),
            weight_version=self.weight_version,
            num_finished_reqs=self.num_finished_reqs,
            gen_throughput=round(self.gen_throughput.rate(), 2),
        )

    def flush_cache(self, request_id: str) -> FlushCacheOutput:
        if self.active_reqs() or self.waiting_queue:
            return FlushCacheOutput(request_id, False, "cannot flush the cache while requests are running or waiting")
        self.sync_inflight()  # an extra step of a finished request may still write its KV
        self.tree_cache.reset()
        return FlushCacheOutput(request_id, True)

    def get_weights_by_name(self, msg: GetWeightsByNameReqInput) -> GetWeightsByNameReqOutput:
        try:
            values = self.worker.model_runner.get_weights_by_name(msg.name, msg.truncate_size)
        except ValueError as e:
            return GetWeightsByNameReqOutput(msg.request_id, None, str(e))
        return GetWeightsByNameReqOutput(msg.request_id, values)

    def handle_update_weights(self, msg: UpdateWeightsReq) -> UpdateWeightFromDiskReqOutput | None:
        """Pause admission (optionally aborting every request); the update runs, and is
        answered, once nothing runs (`update_weights_when_idle`)."""
        if self.pending_weight_update is not None:
            return UpdateWeightFromDiskReqOutput(msg.request_id, False, "another weight update is in progress",
                                                 weight_version=self.weight_version)
        if msg.abort_all_requests:
            self.handle_abort(AbortReq(abort_all=True, message="aborted for a weight update"))
        self.pending_weight_update = msg
        return None

    def update_weights_when_idle(self) -> None:
        """Run the pending weight update once no request runs: load (every TP rank, or
        none), flush the prefix cache (its KV came from the old weights), set the version,
        resume admission."""
        msg = self.pending_weight_update
        if msg is None or self.active_reqs():
            return
        self.sync_inflight()  # an extra step of a finished request may still write its KV
        runner = self.worker.model_runner
        if isinstance(msg, UpdateWeightsFromTensorReqInput):
            success, message = runner.update_weights_from_tensor([(name, t.to_tensor()) for name, t in msg.named_tensors],
                                                                msg.load_format)
        else:
            success, message = runner.update_weights_from_disk(msg.model_path, msg.load_format)
        if success and msg.flush_cache:
            self.tree_cache.reset()
        if success:
            self.num_weight_updates += 1
            self.weight_version = msg.weight_version or str(self.num_weight_updates)
        self.pending_weight_update = None
        self.io.send_reply(UpdateWeightFromDiskReqOutput(msg.request_id, success, message,
                                                         num_paused_requests=len(self.waiting_queue),
                                                         weight_version=self.weight_version))

    def handle_abort(self, msg: AbortReq) -> None:
        def match(req: Req) -> bool:
            return msg.abort_all or req.rid == msg.rid

        aborted = [r for r in self.waiting_queue if match(r)] + self.grammar_queue.remove(match)
        self.waiting_queue = [r for r in self.waiting_queue if not match(r)]
        for req in aborted:
            req.finished_reason = {"type": "abort", "message": msg.message}
            self.kv.release(req)  # a retracted request holds no KV; this is a no-op then
        if aborted:
            self.send_outputs(aborted)
        for req in self.active_reqs():
            if match(req):
                req.to_abort = msg.message

    # ---- batching ------------------------------------------------------------------
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        decode_due = self.last_batch_was_chunk and self.running
        prefill = None if decode_due else self.get_new_prefill_batch()
        self.last_batch_was_chunk = False
        if prefill is not None:
            self.last_batch_was_chunk = self.chunked_req is not None
            if self.server_args.enable_mixed_chunk and self.running:
                self._mix_in_running(prefill)
            return prefill
        if not self.running:
            return None
        return self.prepare_decode_batch()

    def _mix_in_running(self, batch: ScheduleBatch) -> None:
        """Append the running requests to a prefill batch, one token each (SGLang's mixed
        chunk): one forward reads the weights for both. When their slots do not fit, the
        batch stays a plain prefill and the next decode step retracts as usual."""
        slots = self.kv.alloc_decode(self.running)
        if slots is None:
            return
        self.new_token_ratio.step()
        batch.mix_in_decodes(self.running, slots)
        self.last_batch_was_chunk = False  # the running requests have had their step

    def get_new_prefill_batch(self) -> ScheduleBatch | None:
        """Continue the chunked request, then admit waiting requests while KV fits."""
        if self.chunked_req is None and not self.waiting_queue:
            return None
        adder = PrefillAdder(self.kv, self.new_token_ratio.value, self.running, self.max_running_requests,
                             self.server_args.max_prefill_tokens, self.chunk_size)
        if self.chunked_req is not None:
            adder.add_chunked_req(self.chunked_req)
        if self.pending_weight_update is None:  # a weight update pauses admission
            adder.add_waiting(self.policy.order(self.waiting_queue))
        if not adder.reqs:
            return None
        if adder.chunked_req is not None:
            self.chunked_req = adder.chunked_req
        taken = {id(r) for r in adder.reqs}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in taken]
        batch = ScheduleBatch(reqs=adder.reqs, forward_mode=ForwardMode.EXTEND, extend_lens=adder.extend_lens)
        batch.out_cache_loc = self.kv.alloc_extend(adder.reqs, adder.extend_lens)
        return batch

    def prepare_decode_batch(self) -> ScheduleBatch | None:
        """A decode batch of the running requests, retracting some if memory is short
        (after processing the result in flight, which may free some)."""
        self.new_token_ratio.step()
        while self.running:
            slots = self.kv.alloc_decode(self.running)
            if slots is not None:
                return ScheduleBatch(reqs=list(self.running), forward_mode=ForwardMode.DECODE, out_cache_loc=slots)
            if self.inflight is not None:
                self.sync_inflight()
            else:
                self.retract_one()
        return None

    def retract_one(self) -> None:
        """Send back the request that loses least: fewest generated tokens, then the longest
        prompt (it frees the most); a half-prefilled chunked request counts too. Its KV goes
        to the prefix cache, its outputs are kept, and it resumes from the queue later.

        A request alone always fits (max_new_tokens is capped by the pool), so with one
        running request and nothing else holding KV this is never reached."""
        candidates = self.running + ([self.chunked_req] if self.chunked_req is not None else [])
        if len(candidates) <= 1:
            raise RuntimeError("out of KV memory with a single request; --max-total-tokens is too small")
        victim = min(candidates, key=lambda r: (len(r.output_ids), -r.prompt_len))
        if victim is self.chunked_req:
            self.chunked_req = None
        else:
            self.running.remove(victim)
        self.kv.release(victim)
        victim.retractions += 1
        self.waiting_queue.insert(0, victim)
        self.new_token_ratio.on_retract()
        logger.info("retracted request %s (%d outputs) under memory pressure", victim.rid, len(victim.output_ids))

    # ---- running -------------------------------------------------------------------
    def launch(self, batch: ScheduleBatch, fill_vocab_mask: bool = True) -> LaunchedBatch:
        """Snapshot `batch` (advancing its requests' lengths) and start its forward. A batch
        with constrained requests carries a vocab mask, filled now unless `fill_vocab_mask`
        is False (then `fill_vocab_mask` later: the worker's sampling waits for it)."""
        mwb = batch.launch(self.vocab_size, self.device)
        if any(r.grammar is not None for r in batch.reqs):
            mwb.vocab_mask = VocabMask(len(batch.reqs), self.grammar_backend.vocab_size)
            if fill_vocab_mask:
                self.grammar_backend.fill_vocab_mask(mwb.vocab_mask, [r.grammar for r in batch.reqs])
        return LaunchedBatch(batch, mwb, self.executor.launch(mwb))

    def fill_vocab_mask(self, launched: LaunchedBatch) -> None:
        """Fill `launched`'s vocab mask from its requests' grammars, once. Every result
        before it must have been processed (the grammars have seen every token): at
        launch with nothing in flight, or right after the tokens of the batch in flight
        were accepted (`process_batch_result`, before sending its outputs)."""
        mask = launched.mwb.vocab_mask
        if mask is not None and not mask.is_ready():
            # A request that finished meanwhile allows every token: its token is dropped.
            self.grammar_backend.fill_vocab_mask(mask, [None if r.finished() else r.grammar
                                                        for r in launched.batch.reqs])

    def wait_result(self, launched: LaunchedBatch) -> HostBatchResult:
        self.fill_vocab_mask(launched)  # never wait on a sampler that waits for its mask
        with self.watchdog.watching(launched.batch):
            launched.future.result()
        return self.host_result(launched)

    def host_result(self, launched: LaunchedBatch) -> HostBatchResult:
        """The finished forward's result on the host."""
        self.profiler.step()
        return launched.future.result().to_host(launched.mwb)

    def run_batch(self, batch: ScheduleBatch) -> HostBatchResult:
        """Launch `batch` and wait for its result (the normal loop: the forward runs
        inside `launch`, so the watchdog watches that)."""
        with self.watchdog.watching(batch):
            launched = self.launch(batch)
        return self.host_result(launched)

    def process_launched(self, launched: LaunchedBatch) -> None:
        self.process_batch_result(launched.batch, self.wait_result(launched))

    def sync_inflight(self) -> None:
        """Process the result in flight now: what comes next depends on it."""
        launched, self.inflight = self.inflight, None
        if launched is not None:
            self.process_launched(launched)

    def process_batch_result(self, batch: ScheduleBatch, result: HostBatchResult) -> None:
        """Advance every request of the batch by its result; one whose processing raises
        (finish check, stop-string decode, ...) ends alone with an error (DESIGN.md §9).
        A request that finished after this batch was launched (overlap) is skipped: its
        extra token is dropped, and its KV was released when it finished."""
        advanced = []
        generated = 0
        for i, req in enumerate(batch.reqs):
            if req.finished():
                continue
            advanced.append(req)
            before = len(req.output_ids)
            try:
                self._process_result_of(batch, result, i)
            except Exception as e:  # noqa: BLE001 - the second wall
                self._abort_on_error(req, "processing its output", e)
            generated += len(req.output_ids) - before
        self.gen_throughput.add(generated)
        self.running = [r for r in self.running if not r.finished()]
        if self.inflight is not None:  # delayed sampling: its sampler waits for the mask, not for our outputs
            self.fill_vocab_mask(self.inflight)
        self.send_outputs(advanced)

    def _process_result_of(self, batch: ScheduleBatch, result: HostBatchResult, i: int) -> None:
        req, token_id = batch.reqs[i], result.next_token_ids[i]
        prefilling = batch.is_prefill(i)  # False for running requests mixed into a prefill
        if prefilling and result.input_logprobs and result.input_logprobs[i] is not None:
            self._record_input_logprobs(req, result.input_logprobs[i])
        if prefilling and req.kv_len < req.seq_len:  # a chunk of a longer prompt
            self.kv.cache_unfinished(req)
            req.finished_reason = self._abort_reason(req)
            if req.finished():
                self.chunked_req = None
                self.kv.release(req)
            return
        req.pending_tokens -= 1
        if req is self.chunked_req:
            self.chunked_req = None
        if prefilling:
            self.kv.cache_unfinished(req)
        if req.sampling_params.max_new_tokens == 0:  # prefill only (e.g. prompt logprobs, /v1/score)
            if req.return_logprob:  # as SGLang: the next position's top and chosen-id logprobs, no token
                self._record_output_logprobs(req, result, i, token_id=None)
            req.finished_reason = {"type": "length", "length": 0}
            self.kv.release(req)
            return
        req.output_ids.append(token_id)
        if req.grammar is not None:
            req.grammar.accept_token(token_id)
        if req.return_logprob:
            self._record_output_logprobs(req, result, i, token_id)
        req.finished_reason = self._abort_reason(req) or self.finish_checker.check(req)
        if req.finished():
            self.kv.release(req)
        elif prefilling:
            self.running.append(req)

    @staticmethod
    def _abort_reason(req: Req) -> dict[str, Any] | None:
        """The abort finish of `req` when an abort came while it was in a batch
        (`handle_abort` sets `to_abort`), else None."""
        return None if req.to_abort is None else {"type": "abort", "message": req.to_abort}

    def _abort_on_error(self, req: Req, where: str, exc: Exception) -> None:
        """End `req` alone after handling it raised: an error finish, its KV released (a
        no-op if already released) and it leaves the running set and the chunk slot."""
        logger.error("request %s failed while %s:\n%s", req.rid, where, traceback.format_exc())
        req.finished_reason = error_finish_reason(where, exc)
        self.kv.release(req)
        if req is self.chunked_req:
            self.chunked_req = None
        self.running = [r for r in self.running if r is not req]

    @staticmethod
    def _record_input_logprobs(req: Req, logprobs) -> None:
        ids = req.origin_input_ids[req.logprob_start_len :]
        req.input_token_logprobs = list(zip(logprobs.token_logprobs, ids))
        req.input_top_logprobs = logprobs.top_logprobs
        req.input_token_ids_logprobs = logprobs.token_ids_logprobs

    @staticmethod
    def _record_output_logprobs(req: Req, result: HostBatchResult, i: int, token_id: int | None) -> None:
        """Record the logprobs of the position after `req`'s last token; `token_id` is the
        token sampled there (None for a prefill-only request, which gets none)."""
        if token_id is not None:
            req.output_token_logprobs.append((result.next_token_logprobs[i], token_id))
        req.output_top_logprobs.append(result.next_top_logprobs[i])
        if req.token_ids_logprob is not None:
            req.output_token_ids_logprobs.append(result.next_token_ids_logprobs[i])

    # ---- output --------------------------------------------------------------------
    def send_outputs(self, reqs: list[Req]) -> None:
        """One BatchTokenIDOutput for every request of `reqs` that has something due."""
        out = build_batch_output(reqs, self.server_args.stream_interval, self.weight_version,
                                 lambda req, e: self._abort_on_error(req, "building its output", e))
        if out is not None:
            self.num_finished_reqs += sum(o.finished_reason is not None for o in out.outputs)
            self.io.send_output(out)


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, rank: SchedulerRank = SchedulerRank(0),
                          forward_stamp: Any = None) -> None:
    """Entry of the scheduler subprocess of `rank`: set up, report readiness, then loop
    until the parent ends it (SIGKILL). A crash, a forward past --watchdog-timeout, or a
    collective that fails because another rank (or node) is gone brings the server down
    (`report_scheduler_failure`)."""
    name = rank.name
    set_parent_death_signal()
    set_process_title(f"tandem::{name}")
    configure_logging(server_args.log_level, name.replace("_", " "))
    faulthandler.register(signal.SIGUSR1)
    ignore_stop_signals()  # the parent drains, then ends us
    ready = zmq_io.make_socket(zmq.Context.instance(), zmq.PUSH, port_args.ready, bind=False)
    try:
        tp = init_tp_group(rank.tp_rank, server_args.tp_size, server_args.device,
                           init_method(server_args, port_args.ipc_dir, rank.dp_rank), gpu_id(server_args, rank),
                           timeout_s=server_args.watchdog_timeout)
        io = make_scheduler_io(port_args, server_args.skip_tokenizer_init, tp, rank.dp_rank)
        scheduler = Scheduler(server_args, io, tp_rank=rank.tp_rank, forward_stamp=forward_stamp,
                              dp_rank=rank.dp_rank)
    except Exception as e:  # report the start-up failure, then exit
        logger.error("scheduler failed to start:\n%s", traceback.format_exc())
        zmq_io.send(ready, ReadyMessage(process=name, ok=False, error=f"{type(e).__name__}: {e}"))
        sys.exit(1)
    zmq_io.send(ready, ReadyMessage(process=name, info=scheduler.info()))
    scheduler.watchdog.start(on_timeout=report_scheduler_failure)
    try:
        scheduler.event_loop()
    except Exception as e:
        if tp.size > 1 and is_peer_failure(e):
            others = describe_other_nodes(server_args)
            logger.error("%s: a collective of the TP group failed: another rank%s died or stopped answering "
                         "(%s); shutting down", name, f" ({others})" if others else "", e)
        else:
            logger.error("scheduler crashed:\n%s", traceback.format_exc())
        report_scheduler_failure()
        sys.exit(1)
