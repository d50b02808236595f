"""The tokenizer manager: lives in the main process, on the HTTP server's asyncio loop.

It tokenizes and validates requests, sends them to the scheduler, keeps one `ReqState`
per rid, and runs `handle_loop`, which receives `BatchStrOutput` from the detokenizer
and wakes each waiting request. A request's outputs are yielded as dicts shaped like
SGLang's `/generate` response: {"text", "output_ids", "meta_info"}.
"""

from __future__ import annotations

import asyncio
import copy
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
    GenerateReqInput,
    TokenizedGenerateReqInput,
)
from tandem.sampling.sampling_params import SamplingParams
from tandem.server_args import PortArgs, ServerArgs
from tandem.utils import zmq_io
from tandem.utils.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class ReqState:
    """Everything the main process knows about one request in flight."""

    rid: str
    prompt_tokens: int
    created: float
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    # Chunks received since the consumer last looked; each (text_delta, new_ids, meta).
    pending: list[tuple[str, list[int], dict[str, Any]]] = field(default_factory=list)
    finished: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, scheduler_info: dict[str, Any]):
        self.server_args = server_args
        self.tokenizer = load_tokenizer(server_args.tokenizer_path)
        self.context_len: int = scheduler_info["context_length"]
        self.vocab_size: int = scheduler_info["vocab_size"]
        self.scheduler_info = scheduler_info
        self.rid_to_state: dict[str, ReqState] = {}
        ctx = zmq.asyncio.Context(2)
        self.send_to_scheduler = zmq_io.make_socket(ctx, zmq.PUSH, port_args.tokenizer_to_scheduler, bind=False)
        self.recv_from_detokenizer = zmq_io.make_socket(ctx, zmq.PULL, port_args.detokenizer_to_tokenizer, bind=True)
        self._handle_loop_task: asyncio.Task | None = None

    # ---- requests ------------------------------------------------------------------
    def generate_request(self, obj: GenerateReqInput) -> list[AsyncIterator[dict[str, Any]]]:
        """Validate, tokenize and send every prompt of `obj`; one output stream per prompt.

        Raises ValueError (a client error naming the field) before anything is sent, so a
        batch with one bad prompt sends none. Each stream yields one final dict, or chunks
        when `obj.stream`. Closing a stream early aborts its request.
        """
        self._ensure_handle_loop()
        items = [obj.item(i) for i in range(obj.batch_size)] if obj.is_batch else [obj]
        tokenized = [self._tokenize(item) for item in items]
        rids = [t.rid for t in tokenized]
        if len(set(rids)) != len(rids):
            raise ValueError("rid: the rids of a batch must be distinct")
        streams = []
        for item, req in zip(items, tokenized):
            state = ReqState(rid=req.rid, prompt_tokens=len(req.input_ids), created=time.time())
            self.rid_to_state[req.rid] = state
            zmq_io.send(self.send_to_scheduler, req)
            streams.append(self._wait_for_outputs(state, item.stream))
        return streams

    async def _wait_for_outputs(self, state: ReqState, stream: bool) -> AsyncIterator[dict[str, Any]]:
        incremental = self.server_args.incremental_streaming_output
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                chunks, state.pending = state.pending, []
                if not chunks:
                    continue
                meta = chunks[-1][2]
                if stream:
                    if incremental:
                        text = "".join(c[0] for c in chunks)
                        ids = [t for c in chunks for t in c[1]]
                        yield {"text": text, "output_ids": ids, "meta_info": meta}
                    else:
                        yield {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}
                if state.finished:
                    if not stream:
                        yield {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}
                    return
        finally:
            if not state.finished:
                # The consumer went away (client disconnect): stop the request.
                self.abort_request(state.rid)
            self.rid_to_state.pop(state.rid, None)

    def _tokenize(self, obj: GenerateReqInput) -> TokenizedGenerateReqInput:
        assert not obj.is_batch
        if obj.input_ids is not None:
            input_ids = list(obj.input_ids)
            bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"input_ids: token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        else:
            input_ids = self.tokenizer.encode(obj.text)
            if not input_ids:
                raise ValueError("text: the prompt tokenizes to no tokens")
        if len(input_ids) >= self.context_len:
            raise ValueError(
                f"text/input_ids: the prompt has {len(input_ids)} tokens, the context length is "
                f"{self.context_len}; it must be shorter"
            )
        params = SamplingParams.from_dict(copy.deepcopy(obj.sampling_params))
        params.verify(self.vocab_size)
        if params.n != 1:
            raise ValueError("sampling_params.n: only n=1 is supported by /generate so far")
        rid = obj.rid or uuid.uuid4().hex
        if rid in self.rid_to_state:
            raise ValueError(f"rid: a request with rid {rid!r} is already running")
        return TokenizedGenerateReqInput(rid=rid, input_ids=input_ids, sampling_params=params,
                                         stream=obj.stream, input_text=obj.text)

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        zmq_io.send(self.send_to_scheduler, AbortReq(rid=rid, abort_all=abort_all))

    # ---- outputs -------------------------------------------------------------------
    def _ensure_handle_loop(self) -> None:
        if self._handle_loop_task is None or self._handle_loop_task.done():
            self._handle_loop_task = asyncio.get_running_loop().create_task(self.handle_loop())

    async def handle_loop(self) -> None:
        while True:
            msg = await zmq_io.recv_async(self.recv_from_detokenizer)
            if isinstance(msg, BatchStrOutput):
                self._handle_batch_output(msg)
            else:
                logger.error("tokenizer manager got an unknown message %r", type(msg))

    def _handle_batch_output(self, msg: BatchStrOutput) -> None:
        now = time.time()
        for i, rid in enumerate(msg.rids):
            state = self.rid_to_state.get(rid)
            if state is None:  # aborted by its client; the scheduler's last words
                continue
            finished = msg.finished_reasons[i]
            state.text += msg.text_deltas[i]
            state.output_ids.extend(msg.new_token_ids[i])
            meta = {
                "id": rid,
                "finish_reason": finished,
                "prompt_tokens": msg.prompt_tokens[i],
                "completion_tokens": msg.completion_tokens[i],
                "cached_tokens": msg.cached_tokens[i],
                "e2e_latency": now - state.created,
            }
            state.pending.append((msg.text_deltas[i], msg.new_token_ids[i], meta))
            state.finished = finished is not None
            state.event.set()
