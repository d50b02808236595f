"""The scheduler process: continuous batching around one model worker.

Loop (DESIGN.md §4, the normal loop):
    recv requests -> batch = get_next_batch_to_run() -> result = run_batch(batch)
    -> process_batch_result(batch, result)
Prefill (EXTEND) batches have priority; otherwise every running request decodes one
token. Finished requests leave the running set at once and their KV returns to the pool.

Admission is conservative: a request is admitted only when the free KV slots cover
its prompt plus every token it and all running requests may still generate, so decode
never runs out of slots.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import traceback

import torch
import zmq

from tandem.managers.finish_check import FinishChecker
from tandem.managers.io_struct import (
    AbortReq,
    BatchTokenIDOutput,
    GetServerStateReq,
    ReadyMessage,
    ServerStateOutput,
    TokenizedGenerateReqInput,
)
from tandem.managers.schedule_batch import Req, ScheduleBatch
from tandem.managers.tp_worker import GenerationBatchResult, TpModelWorker
from tandem.model_executor.forward_batch import ForwardMode
from tandem.server_args import PortArgs, ServerArgs
from tandem.utils import zmq_io
from tandem.utils.process import configure_logging, notify_parent_of_failure, set_parent_death_signal
from tandem.utils.tokenizer import get_eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

# How long an idle scheduler blocks waiting for input, in milliseconds.
IDLE_POLL_MS = 1000


class Scheduler:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, tp_rank: int = 0):
        self.server_args = server_args
        self.worker = TpModelWorker(server_args, tp_rank=tp_rank)
        runner = self.worker.model_runner
        self.device = runner.device
        self.req_to_token_pool = runner.req_to_token_pool
        self.token_to_kv_pool = runner.token_to_kv_pool
        self.max_running_requests = runner.max_running_requests
        self.max_total_num_tokens = runner.max_total_num_tokens
        self.context_len = runner.context_len
        self.tokenizer = None if server_args.skip_tokenizer_init else load_tokenizer(server_args.tokenizer_path)
        self.finish_checker = FinishChecker(self.tokenizer, get_eos_token_ids(runner.config, self.tokenizer, server_args.model_path))

        self.waiting_queue: list[Req] = []
        self.running: list[Req] = []

        ctx = zmq.Context(2)
        self.recv_from_tokenizer = zmq_io.make_socket(ctx, zmq.PULL, port_args.tokenizer_to_scheduler, bind=True)
        self.send_to_detokenizer = zmq_io.make_socket(ctx, zmq.PUSH, port_args.scheduler_to_detokenizer, bind=False)
        self.send_to_tokenizer = zmq_io.make_socket(ctx, zmq.PUSH, port_args.scheduler_to_tokenizer, bind=False)
        self.poller = zmq.Poller()
        self.poller.register(self.recv_from_tokenizer, zmq.POLLIN)

    def info(self) -> dict:
        """Resolved capacities reported to the parent at start-up."""
        return {
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": self.max_running_requests,
            "context_length": self.context_len,
            "vocab_size": self.worker.model_runner.vocab_size,
            "eos_token_ids": sorted(self.finish_checker.eos_token_ids),
        }

    # ---- the loop ------------------------------------------------------------------
    def event_loop_normal(self) -> None:
        while True:
            self.process_input_requests(self.recv_requests())
            batch = self.get_next_batch_to_run()
            if batch is None:
                self.poller.poll(IDLE_POLL_MS)
                continue
            result = self.run_batch(batch)
            self.process_batch_result(batch, result)

    # ---- input ---------------------------------------------------------------------
    def recv_requests(self) -> list:
        return zmq_io.recv_nowait(self.recv_from_tokenizer)

    def process_input_requests(self, reqs: list) -> None:
        for msg in reqs:
            if isinstance(msg, TokenizedGenerateReqInput):
                self.handle_generate_request(msg)
            elif isinstance(msg, AbortReq):
                self.handle_abort(msg)
            elif isinstance(msg, GetServerStateReq):
                zmq_io.send(self.send_to_tokenizer, self.server_state(msg.request_id))
            else:
                logger.error("scheduler got an unknown message %r", type(msg))

    def handle_generate_request(self, msg: TokenizedGenerateReqInput) -> None:
        req = Req(rid=msg.rid, origin_input_ids=list(msg.input_ids), sampling_params=msg.sampling_params,
                  stream=msg.stream, return_logprob=msg.return_logprob,
                  logprob_start_len=msg.logprob_start_len, top_logprobs_num=msg.top_logprobs_num)
        sp = req.sampling_params
        # The tokenizer manager has rejected prompts that cannot fit the context.
        sp.max_new_tokens = min(sp.max_new_tokens, self.context_len - req.prompt_len)
        if req.prompt_len + sp.max_new_tokens > self.max_total_num_tokens:
            req.finished_reason = {"type": "abort", "message": (
                f"the request needs {req.prompt_len + sp.max_new_tokens} KV slots, more than the "
                f"{self.max_total_num_tokens} the server has (raise --max-total-tokens or lower max_new_tokens)")}
            self.send_outputs([req])
            return
        self.waiting_queue.append(req)

    def server_state(self, request_id: str) -> ServerStateOutput:
        return ServerStateOutput(
            request_id=request_id,
            max_total_num_tokens=self.max_total_num_tokens,
            free_kv_slots=self.token_to_kv_pool.available_size(),
            evictable_cached_slots=0,
            protected_cached_slots=0,
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting_queue),
            free_req_rows=self.req_to_token_pool.available_size(),
        )

    def handle_abort(self, msg: AbortReq) -> None:
        def match(req: Req) -> bool:
            return msg.abort_all or req.rid == msg.rid

        aborted = [r for r in self.waiting_queue if match(r)]
        self.waiting_queue = [r for r in self.waiting_queue if not match(r)]
        for req in aborted:
            req.finished_reason = {"type": "abort", "message": msg.message}
        if aborted:
            self.send_outputs(aborted)
        for req in self.running:
            if match(req):
                req.to_abort = msg.message

    # ---- batching ------------------------------------------------------------------
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        prefill = self.get_new_prefill_batch()
        if prefill is not None:
            return prefill
        if not self.running:
            return None
        batch = ScheduleBatch(reqs=list(self.running), forward_mode=ForwardMode.DECODE)
        self.prepare_for_decode(batch)
        return batch

    def _reserved_tokens(self) -> int:
        """KV slots the running requests may still need for their remaining tokens."""
        return sum(r.sampling_params.max_new_tokens - len(r.output_ids) for r in self.running)

    def get_new_prefill_batch(self) -> ScheduleBatch | None:
        if not self.waiting_queue:
            return None
        budget = self.token_to_kv_pool.available_size() - self._reserved_tokens()
        prefill_tokens = 0
        admitted: list[Req] = []
        for req in self.waiting_queue:
            if len(self.running) + len(admitted) >= self.max_running_requests:
                break
            if self.req_to_token_pool.available_size() <= len(admitted):
                break
            extend_len = len(req.seq_ids) - req.kv_len
            need = extend_len + req.sampling_params.max_new_tokens - len(req.output_ids)
            if need > budget:
                break
            if admitted and prefill_tokens + extend_len > self.server_args.max_prefill_tokens:
                break
            admitted.append(req)
            budget -= need
            prefill_tokens += extend_len
        if not admitted:
            return None
        self.waiting_queue = self.waiting_queue[len(admitted):]
        batch = ScheduleBatch(reqs=admitted, forward_mode=ForwardMode.EXTEND)
        self.prepare_for_extend(batch)
        return batch

    def prepare_for_extend(self, batch: ScheduleBatch) -> None:
        locs = []
        for req in batch.reqs:
            if req.req_pool_idx is None:
                req.req_pool_idx = self.req_to_token_pool.alloc()
            extend_len = len(req.seq_ids) - req.kv_len
            slots = self.token_to_kv_pool.alloc(extend_len)
            assert slots is not None, "admission guaranteed these slots"
            self.req_to_token_pool.write(req.req_pool_idx, req.kv_len, slots)
            locs.append(slots)
        batch.out_cache_loc = torch.cat(locs)

    def prepare_for_decode(self, batch: ScheduleBatch) -> None:
        slots = self.token_to_kv_pool.alloc(batch.batch_size())
        assert slots is not None, "admission guaranteed these slots"
        for i, req in enumerate(batch.reqs):
            self.req_to_token_pool.write(req.req_pool_idx, req.kv_len, slots[i : i + 1])
        batch.out_cache_loc = slots

    # ---- running -------------------------------------------------------------------
    def run_batch(self, batch: ScheduleBatch) -> GenerationBatchResult:
        return self.worker.forward_batch_generation(batch)

    def process_batch_result(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        for i, (req, token_id) in enumerate(zip(batch.reqs, result.next_token_ids)):
            req.kv_len = len(req.seq_ids)
            if batch.forward_mode.is_extend() and result.input_logprobs and result.input_logprobs[i] is not None:
                self._record_input_logprobs(req, result.input_logprobs[i])
            if req.sampling_params.max_new_tokens == 0:  # prefill only (e.g. input logprobs)
                req.finished_reason = {"type": "length", "length": 0}
                self.release_kv(req)
                continue
            req.output_ids.append(token_id)
            if req.return_logprob:
                req.output_token_logprobs.append((result.next_token_logprobs[i], token_id))
                req.output_top_logprobs.append(result.next_top_logprobs[i])
            if req.to_abort is not None:
                req.finished_reason = {"type": "abort", "message": req.to_abort}
            else:
                req.finished_reason = self.finish_checker.check(req)
            if req.finished():
                self.release_kv(req)
        if batch.forward_mode.is_extend():
            self.running.extend(r for r in batch.reqs if not r.finished())
        self.running = [r for r in self.running if not r.finished()]
        self.send_outputs(batch.reqs)

    @staticmethod
    def _record_input_logprobs(req: Req, logprobs) -> None:
        ids = req.origin_input_ids[req.logprob_start_len :]
        req.input_token_logprobs = list(zip(logprobs.token_logprobs, ids))
        req.input_top_logprobs = logprobs.top_logprobs

    def release_kv(self, req: Req) -> None:
        row = req.req_pool_idx
        if row is None:
            return
        self.token_to_kv_pool.free(self.req_to_token_pool.req_to_token[row, : req.kv_len].clone())
        self.req_to_token_pool.free(row)
        req.req_pool_idx = None
        req.kv_len = 0

    # ---- output --------------------------------------------------------------------
    def send_outputs(self, reqs: list[Req]) -> None:
        """One BatchTokenIDOutput for every request that has something to report."""
        out = BatchTokenIDOutput()
        interval = self.server_args.stream_interval
        for req in reqs:
            new_len = len(req.output_ids) - req.sent_len
            due = req.finished() or (req.stream and (req.sent_len == 0 or new_len >= interval))
            if not due or (new_len == 0 and not req.finished()):
                continue
            out.rids.append(req.rid)
            out.new_token_ids.append(req.output_ids[req.sent_len :])
            out.finished_reasons.append(req.finished_reason)
            out.detokenize_params.append(None if req.sent_detokenize_params else req.detokenize_params())
            out.prompt_tokens.append(req.prompt_len)
            out.completion_tokens.append(len(req.output_ids))
            out.cached_tokens.append(req.cached_tokens)
            self._add_logprobs(out, req)
            req.sent_len = len(req.output_ids)
            req.sent_detokenize_params = True
        if out.rids:
            zmq_io.send(self.send_to_detokenizer if self.tokenizer is not None else self.send_to_tokenizer, out)

    @staticmethod
    def _add_logprobs(out: BatchTokenIDOutput, req: Req) -> None:
        if not req.return_logprob:
            for lst in (out.output_token_logprobs, out.output_top_logprobs,
                        out.input_token_logprobs, out.input_top_logprobs):
                lst.append(None)
            return
        out.output_token_logprobs.append(req.output_token_logprobs[req.sent_len :])
        out.output_top_logprobs.append(req.output_top_logprobs[req.sent_len :])
        first = not req.sent_detokenize_params
        out.input_token_logprobs.append(req.input_token_logprobs if first else None)
        out.input_top_logprobs.append(req.input_top_logprobs if first else None)


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, tp_rank: int = 0) -> None:
    """Entry of the scheduler subprocess: set up, report readiness, then loop forever."""
    set_parent_death_signal()
    configure_logging(server_args.log_level, f"scheduler TP{tp_rank}")
    faulthandler.register(signal.SIGUSR1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    ready = zmq_io.make_socket(zmq.Context.instance(), zmq.PUSH, port_args.ready, bind=False)
    try:
        scheduler = Scheduler(server_args, port_args, tp_rank)
    except Exception as e:  # report the start-up failure, then exit
        logger.error("scheduler failed to start:\n%s", traceback.format_exc())
        zmq_io.send(ready, ReadyMessage(process="scheduler", ok=False, error=f"{type(e).__name__}: {e}"))
        sys.exit(1)
    zmq_io.send(ready, ReadyMessage(process="scheduler", info=scheduler.info()))
    try:
        scheduler.event_loop_normal()
    except Exception:
        logger.error("scheduler crashed:\n%s", traceback.format_exc())
        notify_parent_of_failure()
        sys.exit(1)
