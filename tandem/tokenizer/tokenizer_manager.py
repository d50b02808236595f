"""The tokenizer manager: lives in the main process, on the HTTP server's asyncio loop.

It tokenizes and validates requests, sends them to the scheduler, keeps one `ReqState`
per request, and runs `handle_loop`, which receives outputs (`BatchStrOutput` from the
detokenizer, or `BatchTokenIDOutput` straight from the scheduler under
--skip-tokenizer-init) and wakes each waiting request. Outputs are dicts shaped like
SGLang's `/generate` response: {"text", "output_ids", "meta_info"}.

Identity: each request (each sample of an n > 1 request) gets an internal id that is
never reused; states, the scheduler, the detokenizer, outputs and aborts all use it. The
client's `rid` is a label: echoed in meta_info["id"], used by /abort_request, and refused
("Duplicate request ID detected", as SGLang words it) while a request with it runs. So a
late output or abort of an ended request can never reach a newer one with the same rid.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import logging
import time
import traceback
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

import tandem
from tandem import finish_reason
from tandem.constrained.grammar_key import verify_grammar
from tandem.entrypoints.native_protocol import GenerateReqInput
from tandem.lora.manager import parse_lora_paths
from tandem.messages import (
    AbortLabelReq,
    AbortReq,
    BatchStrOutput,
    BatchTokenIDOutput,
    ControlOutput,
    ControlReq,
    FlushCacheOutput,
    FlushCacheReq,
    GetServerStateReq,
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    ProfileReq,
    ProfileReqOutput,
    ReqOutput,
    ServerStateOutput,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightsReq,
)
from tandem.metrics.collector import TokenizerMetricsCollector
from tandem.metrics.request_logger import RequestLogger
from tandem.sampling import custom_logit_processor
from tandem.sampling.sampling_params import SamplingParams
from tandem.server_args import PortArgs, ServerArgs
from tandem.speculative.meta import spec_meta_info
from tandem.tokenizer.multi_tokenizer import rid_prefix
from tandem.tokenizer.text_encoder import TextEncoder
from tandem.utils import zmq_io
from tandem.utils.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
_INPUT_LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def _live_counts(state: ServerStateOutput) -> dict[str, Any]:
    """A scheduler's live counts as /server_info shows them."""
    return {k: v for k, v in dataclasses.asdict(state).items() if k not in ("request_id", "dp_rank_states")}


class SchedulerTimeout(asyncio.TimeoutError):
    """A control call got no reply in time (the HTTP routes answer 503)."""


@dataclass
class ReqState:
    """Everything the main process knows about one request in flight."""

    rid: str  # the internal id
    label: str  # the client's rid (or a fresh one), echoed as meta_info["id"]
    group: str | None  # the label of the n > 1 request this is a sample of
    prompt_tokens: int
    created: float
    return_logprob: bool
    return_text_in_logprobs: bool
    # Top alternatives per position; 0: the top-logprob keys are left out, as in SGLang.
    top_logprobs_num: int = 0
    # Whether token_ids_logprob was given; if not, its keys are left out, as in SGLang.
    token_ids_logprob: bool = False
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, list] = field(default_factory=lambda: {k: [] for k in LOGPROB_KEYS})
    input_logprobs: dict[str, list] | None = None
    # Deltas received since the consumer last looked: (text, ids, logprob deltas, meta).
    pending: list[tuple[str, list[int], dict[str, list], dict[str, Any]]] = field(default_factory=list)
    finished: bool = False
    stream: bool = False
    # The request as received, kept for --log-requests' "Finish" line (else None).
    obj: GenerateReqInput | None = None
    # When its last tokens arrived (time.time()), for the latency metrics; None: none yet.
    last_token_time: float | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)


class TokenizerManager:
    def __init__(
        self, server_args: ServerArgs, port_args: PortArgs, scheduler_info: dict[str, Any], worker_id: int | None = None
    ):
        """`worker_id`: this manager's number among --tokenizer-worker-num N > 1 worker
        processes (None: the only one)."""
        self.server_args = server_args
        self.tokenizer = None if server_args.skip_tokenizer_init else load_tokenizer(server_args.tokenizer_path)
        self.text_encoder = None if self.tokenizer is None else TextEncoder(self.tokenizer)
        self.context_len: int = scheduler_info["context_length"]
        self.vocab_size: int = scheduler_info["vocab_size"]
        self.scheduler_info = scheduler_info
        self.rid_to_state: dict[str, ReqState] = {}  # by internal id
        # Label -> internal ids of the running requests it names: a request's own label, and
        # the label of an n > 1 request for all its samples (whose own labels are "{rid}-{i}").
        self.label_to_rids: dict[str, list[str]] = {}
        # Internal ids are "{prefix}-{counter}"; the prefix starts with the worker's number,
        # so that outputs find their owner (tandem/tokenizer/multi_tokenizer.py).
        self.worker_id = worker_id
        self._rid_prefix = rid_prefix(worker_id or 0)
        self._rid_counter = itertools.count()
        self.num_requests = 0  # requests (samples) sent to the scheduler
        self._control_waiters: dict[str, asyncio.Future] = {}
        # LoRA adapters loaded (name -> path), as of the last load or unload this manager made.
        self.lora_adapters: dict[str, str] = parse_lora_paths(server_args.lora_paths)
        # Set on SIGTERM/SIGINT (entrypoints/shutdown.py): new requests get 503, /health 503.
        self.draining = False
        # When the last message from the scheduler side arrived (time.time(); SGLang's name).
        self.last_receive_tstamp = 0.0
        ctx = zmq.asyncio.Context(2)
        self.send_to_scheduler = zmq_io.make_socket(ctx, zmq.PUSH, port_args.tokenizer_to_scheduler, bind=False)
        # Other workers, told of an /abort_request by label that may name their requests.
        self._peers: list[zmq.asyncio.Socket] = []
        if worker_id is None:
            self.recv_from_detokenizer = zmq_io.make_socket(
                ctx, zmq.PULL, port_args.detokenizer_to_tokenizer, bind=True
            )
            self.recv_from_scheduler = zmq_io.make_socket(ctx, zmq.PULL, port_args.scheduler_to_tokenizer, bind=True)
            self._recv_socks = [self.recv_from_detokenizer, self.recv_from_scheduler]
        else:  # outputs (detokenizer), control replies (the main process's router), peers' aborts
            self._recv_socks = [zmq_io.make_socket(ctx, zmq.PULL, port_args.tokenizer_worker(worker_id), bind=True)]
            self._peers = [
                zmq_io.make_socket(ctx, zmq.PUSH, port_args.tokenizer_worker(k), bind=False)
                for k in range(server_args.tokenizer_worker_num)
                if k != worker_id
            ]
        self._loop_tasks: list[asyncio.Task] = []
        self.metrics = TokenizerMetricsCollector(server_args.served_model_name) if server_args.enable_metrics else None
        self.request_logger = RequestLogger(server_args.log_requests_level) if server_args.log_requests else None

    # ---- requests ------------------------------------------------------------------
    async def generate_request(
        self, obj: GenerateReqInput, incremental: bool | None = None
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
        reqs: list[tuple[GenerateReqInput, TokenizedGenerateReqInput, str, str | None]] = []
        for item in items:
            if self.request_logger is not None:
                self.request_logger.log_received(item)
            first = await self._tokenize(item)
            n = first.sampling_params.n
            first.sampling_params.n = 1
            label = item.rid or uuid.uuid4().hex
            if n == 1:
                reqs.append((item, first, label, None))
                continue
            reqs.extend(
                (
                    item,
                    dataclasses.replace(first, rid=self._new_rid(), sampling_params=copy.copy(first.sampling_params)),
                    f"{label}-{i}",
                    label,
                )
                for i in range(n)
            )
        self._check_labels([label for *_, label, _ in reqs] + list(dict.fromkeys(g for *_, g in reqs if g)))
        streams = []
        for item, req, label, group in reqs:
            state = ReqState(
                rid=req.rid,
                label=label,
                group=group,
                prompt_tokens=len(req.input_ids),
                created=time.time(),
                return_logprob=item.return_logprob,
                return_text_in_logprobs=item.return_text_in_logprobs,
                top_logprobs_num=req.top_logprobs_num,
                token_ids_logprob=req.token_ids_logprob is not None,
                stream=item.stream,
                obj=item if self.request_logger is not None else None,
            )
            self.rid_to_state[req.rid] = state
            self.num_requests += 1
            for name in filter(None, (label, group)):
                self.label_to_rids.setdefault(name, []).append(req.rid)
            zmq_io.send(self.send_to_scheduler, req)
            streams.append(self._wait_for_outputs(state, item.stream, incremental))
        return streams

    def _new_rid(self) -> str:
        return f"{self._rid_prefix}-{next(self._rid_counter)}"

    def _check_labels(self, labels: list[str]) -> None:
        """Refuse a rid used twice in one request or by a request still running."""
        seen: set[str] = set()
        for label in labels:
            if label in seen or label in self.label_to_rids:
                raise ValueError(f"Duplicate request ID detected: {label}")
            seen.add(label)

    def _forget(self, state: ReqState) -> None:
        self.rid_to_state.pop(state.rid, None)
        for name in filter(None, (state.label, state.group)):
            rids = self.label_to_rids.get(name, [])
            if state.rid in rids:
                rids.remove(state.rid)
            if not rids:
                self.label_to_rids.pop(name, None)

    async def _wait_for_outputs(
        self, state: ReqState, stream: bool, incremental: bool
    ) -> AsyncIterator[dict[str, Any]]:
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                # NOTE: whether *these* chunks end the request, read before yielding: more
                # outputs (the finish among them) may arrive while the consumer holds a chunk.
                chunks, state.pending, finished = state.pending, [], state.finished
                if not chunks:
                    continue
                if stream or finished:
                    yield self._checked_output(state, chunks, delta=stream and incremental)
                if finished:
                    return
        finally:
            if not state.finished:
                # The consumer went away (client disconnect): stop the request.
                self._send_abort(state.rid)
            self._forget(state)

    def _checked_output(self, state: ReqState, chunks: list, delta: bool) -> dict[str, Any]:
        """`_output`, or, if building it raises, an error finish for this request alone."""
        try:
            return self._output(state, chunks, delta)
        except Exception as e:  # noqa: BLE001 - the second wall
            reason = self._fail(state, "building its response", e)
            out: dict[str, Any] = {"output_ids": [], "meta_info": self._error_meta(state, reason)}
            return {"text": "", **out} if self.tokenizer is not None else out

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
            meta.update(state.input_logprobs or {k: [] for k in _INPUT_LOGPROB_KEYS})
            if not state.top_logprobs_num:
                del meta["output_top_logprobs"], meta["input_top_logprobs"]
            if not state.token_ids_logprob:
                del meta["output_token_ids_logprobs"], meta["input_token_ids_logprobs"]
        out: dict[str, Any] = {"output_ids": ids, "meta_info": meta}
        if self.tokenizer is not None:
            out = {"text": text, **out}
        return out

    async def _tokenize(self, obj: GenerateReqInput) -> TokenizedGenerateReqInput:
        assert not obj.is_batch
        # The prompt must leave room for one generated token in the context and the KV cache.
        most_tokens = min(self.context_len, self.scheduler_info["max_total_num_tokens"]) - 1
        if obj.input_ids is not None:
            input_ids = list(obj.input_ids)
        else:
            if self.text_encoder is None:
                raise ValueError("text: the server runs with --skip-tokenizer-init; send input_ids")
            input_ids = await self.text_encoder.encode(obj.text, "text", max_tokens=most_tokens)
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
                f"text/input_ids: The input ({len(input_ids)} tokens) is longer than the model's context "
                f"length ({self.context_len} tokens)."  # SGLang's wording: clients match on it
            )
        if obj.input_ids is not None:
            bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"input_ids: token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        params = SamplingParams.from_dict(obj.sampling_params)
        params.normalize(self.vocab_size)
        if params.grammar_key() is not None:
            verify_grammar(
                params.grammar_key(),
                self.server_args.grammar_backend,
                self.tokenizer is not None,
                not self.server_args.constrained_json_disable_any_whitespace,
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "sampling_params.stop: stop strings need a tokenizer; this server runs with "
                "--skip-tokenizer-init (use stop_token_ids)"
            )
        if obj.custom_logit_processor:
            if not self.server_args.enable_custom_logit_processor:  # SGLang's words
                raise ValueError(
                    "custom_logit_processor: The server is not configured to enable custom logit processor. "
                    f"Please set `{custom_logit_processor.ENABLE_FLAG}` to enable this feature."
                )
            custom_logit_processor.check_format(obj.custom_logit_processor)
        if obj.lora_path is not None and not self.server_args.enable_lora:
            raise ValueError(
                "lora_path: LoRA is not enabled on this server (start it with --enable-lora or --lora-paths)"
            )
        if obj.logprob_start_len >= len(input_ids):
            raise ValueError(f"logprob_start_len: must be < the prompt length ({len(input_ids)})")
        if obj.top_logprobs_num > self.vocab_size:
            raise ValueError(f"top_logprobs_num: must be <= the vocabulary size ({self.vocab_size})")
        bad = [t for t in obj.token_ids_logprob or [] if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"token_ids_logprob: contains out-of-vocabulary token id {bad[0]}; "
                f"valid range is [0, {self.vocab_size})"
            )
        return TokenizedGenerateReqInput(
            rid=self._new_rid(),
            input_ids=input_ids,
            sampling_params=params,
            stream=obj.stream,
            input_text=obj.text,
            return_logprob=obj.return_logprob,
            logprob_start_len=obj.logprob_start_len if obj.return_logprob else -1,
            top_logprobs_num=obj.top_logprobs_num if obj.return_logprob else 0,
            token_ids_logprob=obj.token_ids_logprob if obj.return_logprob else None,
            priority=obj.priority,
            custom_logit_processor=obj.custom_logit_processor or None,
            lora_name=obj.lora_path,
        )

    def abort_request(self, rid: str | None = None, abort_all: bool = False, message: str = "aborted") -> None:
        """Stop the running request(s) labelled `rid` (every sample of an n > 1 request),
        or all: queued ones leave the queue, running ones stop within a step. With
        `abort_all`, `message` is the finish_reason's message. Under several tokenizer
        workers, the other workers abort what they run under the label too."""
        if abort_all:
            zmq_io.send(self.send_to_scheduler, AbortReq(abort_all=True, message=message))
            return
        for peer in self._peers:
            zmq_io.send(peer, AbortLabelReq(label=rid))
        self._abort_label(rid)

    def _abort_label(self, label: str) -> None:
        for internal in self.label_to_rids.get(label, []):
            self._send_abort(internal)

    def _send_abort(self, rid: str) -> None:
        """Abort by internal id; the scheduler ignores an id that has ended."""
        zmq_io.send(self.send_to_scheduler, AbortReq(rid=rid))

    async def get_server_state(self, timeout: float = 10.0) -> ServerStateOutput:
        """Live scheduler counts (memory, queue lengths)."""
        return await self._control_call(GetServerStateReq(request_id=self._new_rid()), timeout)

    async def server_info(self) -> dict[str, Any]:
        """Resolved arguments (api_key hidden), capacities and the live scheduler counts."""
        state = await self.get_server_state()
        args = {k: v for k, v in self.server_args.to_dict().items() if k != "api_key"}
        live = _live_counts(state)
        # SGLang's keys: the live counts per data-parallel rank (one entry per replica under
        # --dp-size > 1; the top-level counts are then their sums), and the version.
        internal_states = [_live_counts(s) for s in state.dp_rank_states] if state.dp_rank_states else [live]
        info = {
            **args,
            **self.scheduler_info,
            **live,
            "internal_states": internal_states,
            "version": tandem.__version__,
        }
        if self.worker_id is not None:  # which worker answered, and how many requests it has sent
            info.update(tokenizer_worker_id=self.worker_id, tokenizer_worker_num_requests=self.num_requests)
        return info

    async def flush_cache(self, timeout: float = 10.0) -> FlushCacheOutput:
        """Empty the prefix cache; the scheduler refuses while requests run or wait."""
        return await self._control_call(FlushCacheReq(request_id=self._new_rid()), timeout)

    async def profile(self, req: ProfileReq, timeout: float = 60.0) -> ProfileReqOutput:
        """Start or stop the scheduler's torch profiler (stopping writes the trace)."""
        req.request_id = self._new_rid()
        if req.action == "start":
            req.profile_id = req.profile_id or str(time.time())
        return await self._control_call(req, timeout)

    async def update_weights(self, req: UpdateWeightsReq, timeout: float = 600.0) -> UpdateWeightFromDiskReqOutput:
        """Load new weights of the same architecture (from disk or from tensors); the
        scheduler pauses admission and swaps them in once the running requests have
        finished (or were aborted)."""
        req.request_id = self._new_rid()
        return await self._control_call(req, timeout)

    async def get_weights_by_name(
        self, req: GetWeightsByNameReqInput, timeout: float = 60.0
    ) -> GetWeightsByNameReqOutput:
        """The first rows of a served checkpoint tensor (ModelRunner.get_weights_by_name)."""
        req.request_id = self._new_rid()
        return await self._control_call(req, timeout)

    async def update_lora(
        self, req: LoadLoRAAdapterReqInput | UnloadLoRAAdapterReqInput, timeout: float = 600.0
    ) -> LoRAUpdateOutput:
        """Load or unload a LoRA adapter (tandem/lora/control.py); `lora_adapters` then holds
        the scheduler's list (name -> path), which /v1/models shows."""
        req.request_id = self._new_rid()
        out = await self._control_call(req, timeout)
        self.lora_adapters = dict(out.loaded_adapters) if self.server_args.enable_lora else {}
        return out

    async def _control_call(self, msg: ControlReq, timeout: float) -> Any:
        """Send a control request; await the scheduler's reply with the same request_id."""
        self._ensure_handle_loop()
        future = asyncio.get_running_loop().create_future()
        self._control_waiters[msg.request_id] = future
        zmq_io.send(self.send_to_scheduler, msg)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError as e:
            raise SchedulerTimeout(f"the scheduler did not answer {type(msg).__name__}") from e
        finally:
            self._control_waiters.pop(msg.request_id, None)

    async def close(self) -> None:
        """Stop the receive loops and the tokenizer thread (call on the manager's event loop
        before it stops)."""
        if self.text_encoder is not None:
            self.text_encoder.close()
        tasks, self._loop_tasks = self._loop_tasks, []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.send_to_scheduler.context.destroy(linger=0)  # every socket, and the I/O threads

    # ---- outputs -------------------------------------------------------------------
    def _ensure_handle_loop(self) -> None:
        if not self._loop_tasks or any(t.done() for t in self._loop_tasks):
            for t in self._loop_tasks:
                t.cancel()
            loop = asyncio.get_running_loop()
            self._loop_tasks = [loop.create_task(self.handle_loop(sock)) for sock in self._recv_socks]

    async def handle_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            msg = await zmq_io.recv_async(sock)
            self.last_receive_tstamp = time.time()
            if isinstance(msg, (BatchStrOutput, BatchTokenIDOutput)):
                self._handle_batch_output(msg)
            elif isinstance(msg, ControlOutput):
                future = self._control_waiters.get(msg.request_id)
                if future is not None and not future.done():
                    future.set_result(msg)
            elif isinstance(msg, AbortLabelReq):
                self._abort_label(msg.label)
            else:
                logger.error("tokenizer manager got an unknown message %r", type(msg))

    def _handle_batch_output(self, msg: BatchStrOutput | BatchTokenIDOutput) -> None:
        now = time.time()
        for out in msg.outputs:
            state = self.rid_to_state.get(out.rid)
            if state is None or state.finished:  # a late output of a request that has ended
                continue
            try:
                self._apply_output(state, out, now)
                self._observe(state, out, now)
            except Exception as e:  # noqa: BLE001 - the second wall
                reason = self._fail(state, "handling its output", e)
                state.pending.append(("", [], {k: [] for k in LOGPROB_KEYS}, self._error_meta(state, reason)))
            state.event.set()

    def _apply_output(self, state: ReqState, out: ReqOutput, now: float) -> None:
        """One request's record (its text_delta is "" when no detokenizer runs)."""
        finished = out.finished_reason
        state.text += out.text_delta
        state.output_ids.extend(out.new_token_ids)
        deltas = {k: [] for k in LOGPROB_KEYS}
        if state.return_logprob and out.output_token_logprobs is not None:
            deltas["output_token_logprobs"] = self._with_text(out.output_token_logprobs, state)
            deltas["output_top_logprobs"] = [self._with_text(top, state) for top in out.output_top_logprobs]
            deltas["output_token_ids_logprobs"] = [
                self._with_text(pairs, state) for pairs in out.output_token_ids_logprobs or []
            ]
            for key in LOGPROB_KEYS:
                state.logprobs[key].extend(deltas[key])
            if out.input_token_logprobs is not None:
                state.input_logprobs = {
                    "input_token_logprobs": self._with_text(out.input_token_logprobs, state),
                    "input_top_logprobs": [self._with_text(top, state) for top in out.input_top_logprobs],
                    "input_token_ids_logprobs": [
                        None if pairs is None else self._with_text(pairs, state)
                        for pairs in out.input_token_ids_logprobs or []
                    ],
                }
        meta = self._meta(
            state, finished, out.prompt_tokens, out.completion_tokens, out.cached_tokens, out.retractions, now
        )
        meta["weight_version"] = out.weight_version
        if out.spec_verify_ct is not None:
            meta.update(
                spec_meta_info(
                    out.spec_verify_ct, out.spec_draft_token_num, out.spec_accept_token_num, out.completion_tokens
                )
            )
        state.pending.append((out.text_delta, out.new_token_ids, deltas, meta))
        state.finished = finished is not None
        if finished is not None and finished.get("status_code") == finish_reason.INTERNAL_ERROR_STATUS:
            self._send_abort(state.rid)  # failed in the detokenizer: the scheduler may still run it

    def _observe(self, state: ReqState, out: ReqOutput, now: float) -> None:
        """The request-level metrics and the --log-requests "Finish" line of one output."""
        if self.metrics is not None:
            if out.new_token_ids:
                if state.last_token_time is None:
                    self.metrics.observe_time_to_first_token(now - state.created, state.stream)
                else:
                    self.metrics.observe_inter_token_latency(now - state.last_token_time, len(out.new_token_ids))
                state.last_token_time = now
            if out.finished_reason is not None:
                self.metrics.observe_finished_request(
                    out.prompt_tokens,
                    out.completion_tokens,
                    out.cached_tokens,
                    now - state.created,
                    state.stream,
                    str(out.finished_reason.get("type")),
                )
        if self.request_logger is not None and out.finished_reason is not None:
            self.request_logger.log_finished(state.obj, self._output(state, state.pending[-1:], delta=False))

    @staticmethod
    def _meta(
        state: ReqState,
        finished: dict[str, Any] | None,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        retractions: int,
        now: float,
    ) -> dict[str, Any]:
        meta = {
            "id": state.label,
            "finish_reason": finished,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": cached_tokens,
            "num_retractions": retractions,
        }
        if finished is not None:
            meta["e2e_latency"] = now - state.created
        return meta

    def _error_meta(self, state: ReqState, reason: dict[str, Any]) -> dict[str, Any]:
        return self._meta(state, reason, state.prompt_tokens, len(state.output_ids), 0, 0, time.time())

    def _fail(self, state: ReqState, where: str, exc: Exception) -> dict[str, Any]:
        """End one request after handling it raised (docs/architecture.md, "Failure handling"): log,
        mark it finished, make sure the scheduler stops it; returns its finish reason."""
        logger.error("request %s (rid %s) failed while %s:\n%s", state.rid, state.label, where, traceback.format_exc())
        state.finished = True
        self._send_abort(state.rid)
        return finish_reason.internal_error(where, exc)

    def _with_text(self, pairs: list, state: ReqState) -> list[list]:
        """(logprob, id) pairs -> SGLang's [logprob, id, text or None] triples."""
        if state.return_text_in_logprobs and self.tokenizer is not None:
            return [[lp, tid, self.tokenizer.decode([tid])] for lp, tid in pairs]
        return [[lp, tid, None] for lp, tid in pairs]
