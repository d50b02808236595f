"""Batch formation: which requests the next forward runs.

`BatchFormer` owns the scheduler's queues: the waiting queue, the running set, and the
request whose prompt is prefilled chunk by chunk. Prefill (EXTEND) batches have priority,
except that a decode step of the running requests follows every chunk of a chunked
prefill, so decode never stalls behind a long prompt. Under --enable-mixed-chunk the
running requests ride along in the prefill instead, one token each.

Memory: admission (`schedule_policy.PrefillAdder`) reserves an estimate of the KV that
admitted requests will still need. When a decode step finds no free slot anyway, the
running requests that lose least are retracted: their KV is released (into the prefix
cache) and they return to the front of the queue with their outputs kept, to resume.

Priority (--enable-priority-scheduling, SGLang's semantics): the queue is ordered by
priority; when its most preferred request does not fit (running slots or KV), running
requests it outranks by more than the preemption threshold are preempted, least
preferred (then newest) first, only if together they make room: each is retracted as
above (outputs kept, it resumes when admitted again).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tandem.forward_batch import ForwardMode
from tandem.mem_cache.req_kv import ReqKVManager
from tandem.scheduler.schedule_batch import Req, ScheduleBatch
from tandem.scheduler.schedule_policy import (
    NewTokenRatio,
    PrefillAdder,
    PriorityOrder,
    SchedulePolicy,
    expected_future_tokens,
)
from tandem.server_args import ServerArgs

logger = logging.getLogger(__name__)


class BatchFormer:
    def __init__(self, server_args: ServerArgs, kv: ReqKVManager, max_running_requests: int, spec=None):
        """`spec`: the SpeculativeDecoder whose verify batches replace decode steps (None: off)."""
        self.kv = kv
        self.spec = spec
        self.priority = (
            PriorityOrder(
                server_args.schedule_low_priority_values_first, server_args.priority_scheduling_preemption_threshold
            )
            if server_args.enable_priority_scheduling
            else None
        )
        self.policy = SchedulePolicy(server_args.schedule_policy, kv, self.priority)
        self.new_token_ratio = NewTokenRatio()
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = server_args.max_prefill_tokens
        self.chunk_size = server_args.chunked_prefill_size if server_args.chunked_prefill_size > 0 else None
        self.mixed_chunk = server_args.enable_mixed_chunk
        self.max_loras = server_args.max_loras_per_batch if server_args.enable_lora else None
        self.waiting_queue: list[Req] = []
        self.running: list[Req] = []
        # The request whose prompt is being prefilled chunk by chunk (not yet running).
        self.chunked_req: Req | None = None
        self.last_batch_was_chunk = False

    def next_batch(self, admit: bool, make_room: Callable[[], bool]) -> ScheduleBatch | None:
        """The next batch to run, or None. `admit` False pauses admission of waiting
        requests (a weight update is pending); `make_room` processes the result in flight,
        if any (True), which may free KV before a decode step retracts a request."""
        decode_due = self.last_batch_was_chunk and self.running
        if not decode_due and admit and self.priority is not None:
            self.preempt_for_priority(make_room)
        prefill = None if decode_due else self.get_new_prefill_batch(admit)
        self.last_batch_was_chunk = False
        if prefill is not None:
            self.last_batch_was_chunk = self.chunked_req is not None
            if self.mixed_chunk and self.running:
                self._mix_in_running(prefill)
            return prefill
        if not self.running:
            return None
        return self.prepare_decode_batch(make_room)

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

    def get_new_prefill_batch(self, admit: bool = True) -> ScheduleBatch | None:
        """Continue the chunked request, then admit waiting requests while KV fits."""
        if self.chunked_req is None and not self.waiting_queue:
            return None
        adder = PrefillAdder(
            self.kv,
            self.new_token_ratio.value,
            self.running,
            self.max_running_requests,
            self.max_prefill_tokens,
            self.chunk_size,
            self.max_loras,
        )
        if self.chunked_req is not None:
            adder.add_chunked_req(self.chunked_req)
        if admit:
            adder.add_waiting(self.policy.order(self.waiting_queue))
        if not adder.reqs:
            return None
        if adder.chunked_req is not None:
            self.chunked_req = adder.chunked_req
        taken = {id(r) for r in adder.reqs}
        now = time.perf_counter()
        for req in adder.reqs:
            if not req.forward_entry_time:  # its first forward (the running timeout counts from it)
                req.forward_entry_time = now
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in taken]
        batch = ScheduleBatch(reqs=adder.reqs, forward_mode=ForwardMode.EXTEND, extend_lens=adder.extend_lens)
        batch.out_cache_loc = self.kv.alloc_extend(adder.reqs, adder.extend_lens)
        return batch

    def prepare_decode_batch(self, make_room: Callable[[], bool]) -> ScheduleBatch | None:
        """A decode batch of the running requests, retracting some if memory is short
        (after `make_room`, which may free some)."""
        self.new_token_ratio.step()
        if self.spec is not None and (verify := self.spec.verify_batch(self.running, self.kv)) is not None:
            return verify
        while self.running:
            slots = self.kv.alloc_decode(self.running)
            if slots is not None:
                return ScheduleBatch(reqs=list(self.running), forward_mode=ForwardMode.DECODE, out_cache_loc=slots)
            if not make_room():
                self.retract_one()
        return None

    def preempt_for_priority(self, make_room: Callable[[], bool]) -> None:
        """Retract running requests for the most preferred waiting request when it does
        not fit and they are enough to make room (SGLang's preempt_to_schedule)."""
        if self.chunked_req is not None or not self.waiting_queue or not self.running:
            return
        head = min(self.waiting_queue, key=self.priority.key)
        if not self._victims_for(head, settled=False):
            return
        make_room()  # every result processed first: a request with one in flight is not retracted
        chosen = self._victims_for(head, settled=True)
        for victim in chosen:
            self._retract(victim)
            logger.info(
                "preempted request %s (priority %s, %d outputs) for request %s (priority %s)",
                victim.rid,
                victim.priority,
                len(victim.output_ids),
                head.rid,
                head.priority,
            )

    def _victims_for(self, head: Req, settled: bool) -> list[Req]:
        """The running requests to retract so that `head` fits; [] when it fits already
        or when those it outranks by more than the threshold are not enough. `settled`:
        only requests with no result in flight count."""
        ratio = self.new_token_ratio.value
        cached = self.kv.tree_cache.match_prefix(head.cache_key(head.seq_len - 1)).slots.numel()
        need = head.seq_len - max(cached, head.kv_len) + expected_future_tokens(head, ratio)
        running = [r for r in self.running if not r.finished()]
        free = self.kv.available_size() - sum(expected_future_tokens(r, ratio) for r in running)
        slots = self.max_running_requests - len(running)
        rows = self.kv.req_to_token_pool.available_size()
        if need <= free and slots > 0 and rows > 0:
            return []
        eligible = sorted(
            (r for r in running if (r.pending_tokens == 0 or not settled) and self.priority.preempts(head, r)),
            key=lambda r: (-self.priority.preference(r), -r.queue_entry_time),
        )
        chosen = []
        for victim in eligible:
            chosen.append(victim)
            free += victim.kv_len + expected_future_tokens(victim, ratio)
            slots, rows = slots + 1, rows + 1
            if need <= free and slots > 0 and rows > 0:
                return chosen
        return []

    def _retract(self, victim: Req) -> None:
        """Send a running or half-prefilled request back to the front of the queue: its KV
        to the prefix cache, its outputs kept, to resume when admitted again."""
        if victim is self.chunked_req:
            self.chunked_req = None
        else:
            self.running = [r for r in self.running if r is not victim]
        self.kv.release(victim)
        victim.retractions += 1
        self.waiting_queue.insert(0, victim)

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
        self._retract(victim)
        self.new_token_ratio.on_retract()
        logger.info("retracted request %s (%d outputs) under memory pressure", victim.rid, len(victim.output_ids))

    def take_waiting(self, match: Callable[[Req], bool]) -> list[Req]:
        """Take out (and return) the waiting requests that `match`."""
        taken = [r for r in self.waiting_queue if match(r)]
        self.waiting_queue = [r for r in self.waiting_queue if not match(r)]
        return taken

    def drop_finished(self) -> None:
        """Finished requests leave the running set and the chunk slot."""
        self.running = [r for r in self.running if not r.finished()]
        if self.chunked_req is not None and self.chunked_req.finished():
            self.chunked_req = None
