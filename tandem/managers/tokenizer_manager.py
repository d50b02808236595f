"""The tokenizer manager: lives in the main process, on the HTTP server's asyncio loop.

It tokenizes and validates requests, sends them to the scheduler, keeps one `ReqState`
per rid, and runs `handle_loop`, which receives outputs (`BatchStrOutput` from the
detokenizer, or `BatchTokenIDOutput` straight from the scheduler under
--skip-tokenizer-init) and wakes each waiting request. Outputs are dicts shaped like
SGLang's `/generate` response: {"text", "output_ids", "meta_info"}.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio

from tandem.managers.io_struct import (
    AbortReq,
    BatchStrOutput,
    BatchTokenIDOutput,
    FlushCacheOutput,
    FlushCacheReq,
    GenerateReqInput,
    GetServerStateReq,
    ServerStateOutput,
    TokenizedGenerateReqInput,
)
from tandem.sampling.sampling_params import SamplingParams
from tandem.server_args import PortArgs, ServerArgs
from tandem.utils import zmq_io
from tandem.utils.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs")


@dataclass
class ReqState:
    """Everything the main process knows about one request in flight."""

    rid: str
    created: float
    return_logprob: bool
    return_text_in_logprobs: bool
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, list] = field(default_factory=lambda: {k: [] for k in LOGPROB_KEYS})
    input_logprobs: dict[str, list] | None = None
    # Deltas received since the consumer last looked: (text, ids, logprob deltas, meta).
    pending: list[tuple[str, list[int], dict[str, list], dict[str, Any]]] = field(default_factory=list)
    finished: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, scheduler_info: dict[str, Any]):
        self.server_args = server_args
        self.tokenizer = None if server_args.skip_tokenizer_init else load_tokenizer(server_args.tokenizer_path)
        self.context_len: int = scheduler_info["context_length"]
        self.vocab_size: int = scheduler_info["vocab_size"]
        self.scheduler_info = scheduler_info
        self.rid_to_state: dict[str, ReqState] = {}
        # rid of an n > 1 request -> the rids of its samples ("{rid}-{i}"), while any runs.
        self.sample_rids: dict[str, list[str]] = {}
        self._control_waiters: dict[str, asyncio.Future] = {}
        ctx = zmq.asyncio.Context(2)
        self.send_to_scheduler = zmq_io.make_socket(ctx, zmq.PUSH, port_args.tokenizer_to_scheduler, bind=False)
        self.recv_from_detokenizer = zmq_io.make_socket(ctx, zmq.PULL, port_args.detokenizer_to_tokenizer, bind=True)
        self.recv_from_scheduler = zmq_io.make_socket(ctx, zmq.PULL, port_args.scheduler_to_tokenizer, bind=True)
        self._loop_tasks: list[asyncio.Task] = []

    # ---- requests ------------------------------------------------------------------
    def generate_request(self, obj: GenerateReqInput, incremental: bool | None = None
                         ) -> list[AsyncIterator[dict[str, Any]]]:
        """Validate, tokenize and send every prompt of `obj`; one output stream per sample.

        A batch of B prompts with sampling_params.n = n gives B * n streams, prompt-major.
        Raises ValueError (a client error naming the field) before anything is sent, so a
        batch with one bad prompt sends none. Each stream yields one final dict, or chunks
        when `obj.stream`; with `incremental` (default: --incremental-streaming-output)
        chunks carry only what is new. Closing a stream early aborts its request.
        """
        self._ensure_handle_loop()
        if incremental is None:
            incremental = self.server_args.incremental_streaming_output
        items = [obj.item(i) for i in range(obj.batch_size)] if obj.is_batch else [obj]
        reqs: list[tuple[GenerateReqInput, TokenizedGenerateReqInput]] = []
        for item in items:
            first = self._tokenize(item)
            n = first.sampling_params.n
            first.sampling_params.n = 1
            if n == 1:
                reqs.append((item, first))
                continue
            samples = [dataclasses.replace(first, rid=f"{first.rid}-{i}", sampling_params=copy.copy(first.sampling_params))
                       for i in range(n)]
            reqs.extend((item, sample) for sample in samples)
            self.sample_rids[first.rid] = [sample.rid for sample in samples]
        rids = [r.rid for _, r in reqs]
        if len(set(rids)) != len(rids) or any(rid in self.rid_to_state for rid in rids):
            raise ValueError("rid: every request must have a distinct rid, not one already running")
        streams = []
        for item, req in reqs:
            state = ReqState(rid=req.rid, created=time.time(), return_logprob=item.return_logprob,
                             return_text_in_logprobs=item.return_text_in_logprobs)
            self.rid_to_state[req.rid] = state
            zmq_io.send(self.send_to_scheduler, req)
            streams.append(self._wait_for_outputs(state, item.stream, incremental))
        return streams

    async def _wait_for_outputs(self, state: ReqState, stream: bool, incremental: bool
                                ) -> AsyncIterator[dict[str, Any]]:
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                chunks, state.pending = state.pending, []
                if not chunks:
                    continue
                if stream and incremental:
                    yield self._output(state, chunks, delta=True)
                elif stream or state.finished:
                    yield self._output(state, chunks, delta=False)
                if state.finished:
                    return
        finally:
            if not state.finished:
                # The consumer went away (client disconnect): stop the request.
                self.abort_request(state.rid)
            self.rid_to_state.pop(state.rid, None)
            parent = state.rid.rsplit("-", 1)[0]
            if parent in self.sample_rids and not any(r in self.rid_to_state for r in self.sample_rids[parent]):
                del self.sample_rids[parent]

    def _output(self, state: ReqState, chunks: list, delta: bool) -> dict[str, Any]:
        meta = dict(chunks[-1][3])
        if delta:
            text = "".join(c[0] for c in chunks)
            ids = [t for c in chunks for t in c[1]]
        else:
            text, ids = state.text, list(state.output_ids)
        if state.return_logprob:
            for key in LOGPROB_KEYS:
                meta[key] = [x for c in chunks for x in c[2][key]] if delta else list(state.logprobs[key])
            inputs = state.input_logprobs or {"input_token_logprobs": [], "input_top_logprobs": []}
            meta.update(inputs)
        out: dict[str, Any] = {"output_ids": ids, "meta_info": meta}
        if self.tokenizer is not None:
            out = {"text": text, **out}
        return out

    def _tokenize(self, obj: GenerateReqInput) -> TokenizedGenerateReqInput:
        assert not obj.is_batch
        if obj.input_ids is not None:
            input_ids = list(obj.input_ids)
            bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"input_ids: token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        else:
            if self.tokenizer is None:
                raise ValueError("text: the server runs with --skip-tokenizer-init; send input_ids")
            input_ids = self.tokenizer.encode(obj.text)
            if not input_ids:
                raise ValueError("text: the prompt tokenizes to no tokens")
        max_tokens = self.scheduler_info["max_total_num_tokens"]
        if len(input_ids) + 1 > max_tokens:
            raise ValueError(
                f"text/input_ids: the prompt has {len(input_ids)} tokens; the KV cache holds only "
                f"{max_tokens} (--max-total-tokens), so it can never run"
            )
        if len(input_ids) >= self.context_len:
            raise ValueError(
                f"text/input_ids: the prompt has {len(input_ids)} tokens, the context length is "
                f"{self.context_len}; it must be shorter"
            )
        params = SamplingParams.from_dict(copy.deepcopy(obj.sampling_params))
        params.verify(self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("sampling_params.stop: stop strings need a tokenizer; this server runs with "
                             "--skip-tokenizer-init (use stop_token_ids)")
        if obj.logprob_start_len >= len(input_ids):
            raise ValueError(f"logprob_start_len: must be < the prompt length ({len(input_ids)})")
        if obj.top_logprobs_num > self.vocab_size:
            raise ValueError(f"top_logprobs_num: must be <= the vocabulary size ({self.vocab_size})")
        rid = obj.rid or uuid.uuid4().hex
        return TokenizedGenerateReqInput(
            rid=rid, input_ids=input_ids, sampling_params=params, stream=obj.stream, input_text=obj.text,
            return_logprob=obj.return_logprob, logprob_start_len=obj.logprob_start_len if obj.return_logprob else -1,
            top_logprobs_num=obj.top_logprobs_num if obj.return_logprob else 0)

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Stop one request (every sample of an n > 1 request), or all: queued ones leave
        the queue, running ones stop within a step."""
        if abort_all:
            zmq_io.send(self.send_to_scheduler, AbortReq(abort_all=True))
            return
        for target in self.sample_rids.get(rid, [rid]):
            zmq_io.send(self.send_to_scheduler, AbortReq(rid=target))

    async def get_server_state(self, timeout: float = 10.0) -> ServerStateOutput:
        """Live scheduler counts (memory, queue lengths)."""
        return await self._control_call(GetServerStateReq(request_id=uuid.uuid4().hex), timeout)

    async def server_info(self) -> dict[str, Any]:
        """Resolved arguments (api_key hidden), capacities and the live scheduler counts."""
        state = await self.get_server_state()
        args = {k: v for k, v in self.server_args.to_dict().items() if k != "api_key"}
        live = {k: v for k, v in dataclasses.asdict(state).items() if k != "request_id"}
        return {**args, **self.scheduler_info, **live}

    async def flush_cache(self, timeout: float = 10.0) -> FlushCacheOutput:
        """Empty the prefix cache; the scheduler refuses while requests run or wait."""
        return await self._control_call(FlushCacheReq(request_id=uuid.uuid4().hex), timeout)

    async def _control_call(self, msg: GetServerStateReq | FlushCacheReq, timeout: float) -> Any:
        """Send a control request; await the scheduler's reply with the same request_id."""
        self._ensure_handle_loop()
        future = asyncio.get_running_loop().create_future()
        self._control_waiters[msg.request_id] = future
        zmq_io.send(self.send_to_scheduler, msg)
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._control_waiters.pop(msg.request_id, None)

    async def close(self) -> None:
        """Stop the receive loops (call on the manager's event loop before it stops)."""
        tasks, self._loop_tasks = self._loop_tasks, []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- outputs -------------------------------------------------------------------
    def _ensure_handle_loop(self) -> None:
        if not self._loop_tasks or any(t.done() for t in self._loop_tasks):
            for t in self._loop_tasks:
                t.cancel()
            loop = asyncio.get_running_loop()
            self._loop_tasks = [loop.create_task(self.handle_loop(self.recv_from_detokenizer)),
                                loop.create_task(self.handle_loop(self.recv_from_scheduler))]

    async def handle_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            msg = await zmq_io.recv_async(sock)
            if isinstance(msg, (BatchStrOutput, BatchTokenIDOutput)):
                self._handle_batch_output(msg)
            elif isinstance(msg, (ServerStateOutput, FlushCacheOutput)):
                future = self._control_waiters.get(msg.request_id)
                if future is not None and not future.done():
                    future.set_result(msg)
            else:
                logger.error("tokenizer manager got an unknown message %r", type(msg))

    def _handle_batch_output(self, msg: BatchStrOutput | BatchTokenIDOutput) -> None:
        now = time.time()
        has_text = isinstance(msg, BatchStrOutput)
        for i, rid in enumerate(msg.rids):
            state = self.rid_to_state.get(rid)
            if state is None:  # aborted by its client; the scheduler's last words
                continue
            finished = msg.finished_reasons[i]
            text = msg.text_deltas[i] if has_text else ""
            state.text += text
            state.output_ids.extend(msg.new_token_ids[i])
            deltas = {k: [] for k in LOGPROB_KEYS}
            if state.return_logprob and msg.output_token_logprobs[i] is not None:
                deltas["output_token_logprobs"] = self._with_text(msg.output_token_logprobs[i], state)
                deltas["output_top_logprobs"] = [self._with_text(top, state) for top in msg.output_top_logprobs[i]]
                for key in LOGPROB_KEYS:
                    state.logprobs[key].extend(deltas[key])
                if msg.input_token_logprobs[i] is not None:
                    state.input_logprobs = {
                        "input_token_logprobs": self._with_text(msg.input_token_logprobs[i], state),
                        "input_top_logprobs": [self._with_text(top, state) for top in msg.input_top_logprobs[i]],
                    }
            meta = {
                "id": rid,
                "finish_reason": finished,
                "prompt_tokens": msg.prompt_tokens[i],
                "completion_tokens": msg.completion_tokens[i],
                "cached_tokens": msg.cached_tokens[i],
                "retractions": msg.retractions[i],
                "e2e_latency": now - state.created,
            }
            state.pending.append((text, msg.new_token_ids[i], deltas, meta))
            state.finished = finished is not None
            state.event.set()

    def _with_text(self, pairs: list, state: ReqState) -> list[list]:
        """(logprob, id) pairs -> SGLang's [logprob, id, text or None] triples."""
        if state.return_text_in_logprobs and self.tokenizer is not None:
            return [[lp, tid, self.tokenizer.decode([tid])] for lp, tid in pairs]
        return [[lp, tid, None] for lp, tid in pairs]
