"""A real `Scheduler` on a tiny model, in-process: its I/O is an in-memory object, so
tests drive the loop step by step and read every output it sent."""

from __future__ import annotations

import collections
import time
from typing import Any

import pytest

from tandem.messages import AbortReq, BatchTokenIDOutput, TokenizedGenerateReqInput
from tandem.sampling.sampling_params import SamplingParams
from tandem.scheduler.scheduler import Scheduler
from tandem.server_args import ServerArgs


def loop_configurations(small_pool_tokens: int) -> list:
    """pytest params of `server_args` under which the overlap and the normal loop must
    agree: the defaults, chunked prefill, mixed chunks, no radix
    cache, and a KV pool of `small_pool_tokens` slots, small enough that the caller's
    workload retracts (so its size depends on that workload)."""
    return [
        pytest.param({}, id="default"),
        pytest.param({"chunked_prefill_size": 8}, id="chunked"),
        pytest.param({"enable_mixed_chunk": True, "chunked_prefill_size": 16}, id="mixed-chunk"),
        pytest.param({"disable_radix_cache": True}, id="no-radix"),
        pytest.param({"max_total_tokens": small_pool_tokens, "chunked_prefill_size": 16}, id="small-pool"),
    ]


class LocalIO:
    """In-memory SchedulerIO: `inbox` is what `recv` returns next; sends are recorded."""

    def __init__(self) -> None:
        self.inbox: list[Any] = []
        self.outputs: list[BatchTokenIDOutput] = []
        self.replies: list[Any] = []

    def recv(self) -> list[Any]:
        msgs, self.inbox = self.inbox, []
        return msgs

    def wait(self, timeout_ms: int) -> None:
        pass

    def send_output(self, out: BatchTokenIDOutput) -> None:
        self.outputs.append(out)

    def send_reply(self, msg: Any) -> None:
        self.replies.append(msg)

    def close(self) -> None:
        pass


class Collected:
    """What the client of each internal id would see: its ids, logprobs, finish and counts."""

    def __init__(self) -> None:
        self.ids: dict[str, list[int]] = collections.defaultdict(list)
        self.logprobs: dict[str, list] = collections.defaultdict(list)
        self.finishes: dict[str, dict] = {}
        self.completion_tokens: dict[str, int] = {}
        self.cached_tokens: dict[str, int] = {}
        self.retractions: dict[str, int] = {}

    def add(self, out: BatchTokenIDOutput) -> None:
        for rec in out.outputs:
            rid = rec.rid
            assert rid not in self.finishes, f"output for {rid} after its finish"
            self.ids[rid] += rec.new_token_ids
            if rec.output_token_logprobs is not None:
                self.logprobs[rid].append(
                    (
                        rec.output_token_logprobs,
                        rec.output_top_logprobs,
                        rec.output_token_ids_logprobs,
                        rec.input_token_logprobs,
                    )
                )
            if rec.finished_reason is not None:
                self.finishes[rid] = rec.finished_reason
                self.completion_tokens[rid] = rec.completion_tokens
                self.cached_tokens[rid] = rec.cached_tokens
                self.retractions[rid] = rec.retractions


class SchedulerHarness:
    """A Scheduler with an in-memory I/O; `released` counts KV releases per request."""

    def __init__(self, model_dir, **server_args):
        args = {"max_total_tokens": 2048, **server_args}
        self.io = LocalIO()
        self.scheduler = Scheduler(ServerArgs(model_path=str(model_dir), **args), self.io)
        self.collected = Collected()
        self.released: collections.Counter = collections.Counter()
        release = self.scheduler.kv.release

        def counting_release(req) -> None:
            self.released[req.rid] += req.req_pool_idx is not None
            release(req)

        self.scheduler.kv.release = counting_release

    def submit(
        self,
        rid: str,
        stream: bool = False,
        input_ids: list[int] | None = None,
        logprobs: dict | None = None,
        lora_name: str | None = None,
        **params,
    ) -> None:
        sp = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0)
        for name, value in params.items():
            setattr(sp, name, value)  # NOTE: unchecked on purpose, to poison a request
        self.io.inbox.append(
            TokenizedGenerateReqInput(
                rid=rid,
                input_ids=input_ids or [1, 2, 3, 4],
                sampling_params=sp,
                stream=stream,
                lora_name=lora_name,
                **(logprobs or {}),
            )
        )

    def abort(self, rid: str) -> None:
        self.io.inbox.append(AbortReq(rid=rid))

    def step(self) -> bool:
        """One iteration of the scheduler's loop (the one its flags select); False once
        nothing is running, waiting or in flight."""
        s = self.scheduler
        s.process_input_requests(s.recv_requests())
        busy = s.step()
        if not busy and len(s.grammar_queue):
            time.sleep(0.002)  # the loop's short wait while a grammar compiles
        self._collect()
        return busy or bool(s.batches.waiting_queue) or bool(len(s.grammar_queue))

    def run_until_idle(self, max_steps: int = 10_000) -> dict[str, dict]:
        """Step until nothing runs; the finish reason of each request that finished meanwhile."""
        before = set(self.collected.finishes)
        for _ in range(max_steps):
            if not self.step() and not self.io.inbox:
                return {rid: r for rid, r in self.collected.finishes.items() if rid not in before}
        raise AssertionError("the scheduler did not become idle")

    def _collect(self) -> None:
        outputs, self.io.outputs = self.io.outputs, []
        for out in outputs:
            self.collected.add(out)

    def close(self) -> None:
        self.scheduler.executor.close()

    def assert_released_once(self, admitted: bool = True) -> None:
        """Every finished request's KV was released once per admission (each retraction
        is one); `admitted=False` also allows never (aborted while waiting)."""
        for rid in self.collected.finishes:
            extra = self.released[rid] - self.collected.retractions[rid]
            assert extra == 1 or (not admitted and extra == 0), (rid, self.released[rid])

    def assert_memory_idle(self) -> None:
        state = self.scheduler.control.server_state("check")
        assert state.num_running_reqs == state.num_waiting_reqs == 0
        assert state.free_kv_slots + state.evictable_cached_slots == state.max_total_num_tokens, state
        assert state.protected_cached_slots == 0, state
        assert state.free_req_rows == self.scheduler.max_running_requests, state
