"""Scheduler-side state of requests (`Req`) and of the batch being run (`ScheduleBatch`).

`Req` lives in the scheduler from admission until it finishes. KV bookkeeping per req:
  req_pool_idx  its row in the ReqToTokenPool (None while waiting)
  kv_len        leading tokens of seq_ids whose KV is in the pool
  pending_tokens tokens sampled by launched forwards whose results are not yet processed
Lengths advance when a batch is launched (`ScheduleBatch.launch`), not when its result
arrives: kv_len counts the KV that launched forwards compute. Once every result is in,
kv_len == len(seq_ids) - 1 while decoding (the newest output token gets its KV in the
next decode). Under the overlap loop a decode is launched before the previous one's
result is processed; its input is then a placeholder for that pending token, resolved
on the compute side from the worker's `FutureMap`. A prefill (EXTEND) computes
seq_ids[kv_len:kv_len+extend_len] (a chunk of the prompt under chunked prefill, or
prompt + outputs when a retracted request resumes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tandem import finish_reason
from tandem.forward_batch import ForwardBatch, ForwardMode
from tandem.layers.sampler import SamplingBatchInfo
from tandem.messages import DetokenizeParams, TokenizedGenerateReqInput
from tandem.sampling.custom_logit_processor import CustomLogitBatch, ProcessorReq, RequestProcessor
from tandem.sampling.penalties import PenaltyBatch, PenaltyInput, needs_penalties
from tandem.sampling.sampling_params import SamplingParams
from tandem.scheduler.future_map import FutureMap

# Prompt ids the detokenizer gets as left context for the output (SGLang's value).
INIT_INCREMENTAL_DETOKENIZATION_OFFSET = 5


@dataclass
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict[str, Any] | None = None
    req_pool_idx: int | None = None
    kv_len: int = 0
    pending_tokens: int = 0
    # Prefix-cache state (see mem_cache/req_kv.py): locked node and cache-owned length.
    last_node: Any = None
    cache_owned_len: int = 0
    cached_tokens: int = 0
    # Times this request was retracted (sent back to the queue) under memory pressure.
    retractions: int = 0
    # Set once its first prefill has been scheduled (cached_tokens is counted once).
    admitted_once: bool = False
    # Output ids already sent to the detokenizer; and whether its params were sent.
    sent_len: int = 0
    sent_detokenize_params: bool = False
    # Set when the client aborted; honoured at the next result processing (with
    # `to_abort_status`, the status code of a timeout's abort).
    to_abort: str | None = None
    to_abort_status: int | None = None
    # time.perf_counter() when it entered the waiting queue, and when its first forward
    # was formed (0: not yet): the waiting and running timeouts count from these.
    queue_entry_time: float = 0.0
    forward_entry_time: float = 0.0
    # SGLang's priority (--enable-priority-scheduling; set to the lowest when not given).
    priority: int | None = None
    # Logprobs (SGLang semantics: of the model's distribution, before temperature).
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]]] | None = None
    # Token ids whose logprobs are returned at every position (None: none asked for);
    # per position, their (logprob, token_id) pairs (None: an input position with no score).
    token_ids_logprob: list[int] | None = None
    output_token_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None
    # Token ids masked until min_new_tokens are generated: its stop token ids and EOS.
    min_tokens_banned: list[int] = field(default_factory=list)
    # Constrained decoding: the matcher of its grammar (tandem/constrained), set when the
    # grammar has compiled; it has accepted every processed output token.
    grammar: Any = None
    # Its custom logit processor and params (--enable-custom-logit-processor), deserialized
    # by this rank's scheduler when the request arrived; kept for its whole life.
    custom_logit_processor: RequestProcessor | None = None
    # Speculative decoding (tandem/speculative): its draft state and verify counts; None without.
    spec: Any = None
    # Its LoRA adapter: the name asked for and the load id it resolved to (None: the base model).
    lora_name: str | None = None
    lora_uid: int | None = None

    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < self.prompt_len

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def seq_len(self) -> int:
        """len(seq_ids), without building the list (used in the scheduler's hot loop)."""
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def seq_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def finished(self) -> bool:
        return self.finished_reason is not None

    def cache_key(self, n: int) -> list:
        """seq_ids[:n] as the prefix cache's key: under an adapter each id is paired with the
        adapter's load id, so prefixes are shared only between requests of one adapter."""
        ids = self.seq_ids[:n]
        return ids if self.lora_uid is None else [(self.lora_uid, t) for t in ids]

    @property
    def launched_output_len(self) -> int:
        """Output tokens once every launched forward's result is in (seeds and
        min_new_tokens count these, so they match whether or not results are pending)."""
        return len(self.output_ids) + self.pending_tokens

    def launched_output_ids(self) -> list[int]:
        """output_ids followed by a placeholder for each pending token (see FutureMap)."""
        if not self.pending_tokens:
            return self.output_ids
        assert self.pending_tokens == 1, "at most one forward of a request is pending"
        return self.output_ids + [FutureMap.placeholder(self.req_pool_idx)]

    @classmethod
    def from_message(cls, msg: TokenizedGenerateReqInput) -> Req:
        return cls(
            rid=msg.rid,
            origin_input_ids=list(msg.input_ids),
            sampling_params=msg.sampling_params,
            stream=msg.stream,
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num,
            token_ids_logprob=msg.token_ids_logprob,
            priority=msg.priority,
            lora_name=msg.lora_name,
        )

    def set_output_limits(self, max_seq_len: int, eos_token_ids: set[int]) -> None:
        """Cap the output so that this request alone always fits `max_seq_len` tokens (the
        context and the KV pool: the tokenizer manager has refused prompts that cannot fit),
        and list the ids masked until min_new_tokens are out: its stop ids and EOS (not EOS
        when it is ignored or a grammar decides where the output ends)."""
        sp = self.sampling_params
        sp.max_new_tokens = min(sp.max_new_tokens, max_seq_len - self.prompt_len)
        sp.min_new_tokens = min(sp.min_new_tokens, sp.max_new_tokens)
        if sp.min_new_tokens > 0:
            eos = set() if sp.ignore_eos or sp.grammar_key() is not None else eos_token_ids
            self.min_tokens_banned = sorted(set(sp.stop_token_ids) | eos)

    # ---- applying a forward's result (the scheduler's process_batch_result) ----------
    def accept_token(self, token_id: int) -> None:
        """Append a sampled output token; its grammar (if any) advances by it."""
        self.output_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept_token(token_id)

    def record_input_logprobs(self, logprobs) -> None:
        """The prompt's logprobs from logprob_start_len on (one prefill's `InputLogprobs`)."""
        ids = self.origin_input_ids[self.logprob_start_len :]
        self.input_token_logprobs = list(zip(logprobs.token_logprobs, ids))
        self.input_top_logprobs = logprobs.top_logprobs
        self.input_token_ids_logprobs = logprobs.token_ids_logprobs

    def record_output_logprobs(self, result, i: int, token_id: int | None) -> None:
        """The logprobs of the position after this request's last token, row `i` of a
        `HostBatchResult`; `token_id` is the token sampled there (None for a prefill-only
        request, which gets the top and chosen-id logprobs but no token, as in SGLang)."""
        if token_id is not None:
            self.output_token_logprobs.append((result.next_token_logprobs[i], token_id))
        self.output_top_logprobs.append(result.next_top_logprobs[i])
        if self.token_ids_logprob is not None:
            self.output_token_ids_logprobs.append(result.next_token_ids_logprobs[i])

    def abort_reason(self) -> dict[str, Any] | None:
        """The abort finish when an abort came while this request was in a batch
        (`to_abort`), else None."""
        return None if self.to_abort is None else finish_reason.abort(self.to_abort, self.to_abort_status)

    def detokenize_params(self) -> DetokenizeParams:
        sp = self.sampling_params
        return DetokenizeParams(
            skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
            stop=list(sp.stop),
            no_stop_trim=sp.no_stop_trim,
            stream=self.stream,
            prompt_tail=self.origin_input_ids[-INIT_INCREMENTAL_DETOKENIZATION_OFFSET:],
            stop_regex=list(sp.stop_regex),
        )


@dataclass
class ScheduleBatch:
    """The requests of one forward and the token layout that forward uses."""

    reqs: list[Req]
    forward_mode: ForwardMode
    # EXTEND: tokens each request computes in this forward (its whole remaining
    # sequence unless chunked).
    extend_lens: list[int] | None = None
    # KV slots of the new tokens, flattened.
    out_cache_loc: torch.Tensor | None = None
    # Mixed batches (--enable-mixed-chunk): reqs[num_prefill:] are running requests that
    # decode their next token inside this EXTEND forward (extend_len 1). None: all prefill.
    num_prefill: int | None = None
    # Speculative verification (a DECODE batch; tandem/speculative): each request computes
    # its newest token followed by its draft tokens, and the forward returns the logits of
    # every one; `draft_probs` [num_tokens, vocab] are a draft model's distributions (None:
    # n-gram drafts, point masses).
    draft_ids: list[list[int]] | None = None
    draft_probs: torch.Tensor | None = None

    def is_prefill(self, i: int) -> bool:
        """Whether reqs[i] is prefilling (EXTEND, not a running request mixed in)."""
        return self.forward_mode.is_extend() and (self.num_prefill is None or i < self.num_prefill)

    def mix_in_decodes(self, running: list[Req], slots: torch.Tensor) -> None:
        """Make this prefill batch also decode `running` (one token each, in `slots`)."""
        assert self.forward_mode.is_extend() and self.num_prefill is None
        self.num_prefill = len(self.reqs)
        self.reqs = self.reqs + list(running)
        self.extend_lens = self.extend_lens + [1] * len(running)
        self.out_cache_loc = torch.cat([self.out_cache_loc, slots])

    def is_empty(self) -> bool:
        return not self.reqs

    def batch_size(self) -> int:
        return len(self.reqs)

    def launch(self, vocab_size: int, device: str) -> ModelWorkerBatch:
        """The worker's snapshot of this batch; then every request's lengths advance as if
        the forward had run: kv_len by its new tokens, and a request whose forward samples
        its next token gets one pending token (until `process_batch_result`)."""
        mwb = ModelWorkerBatch(
            forward_batch=self.to_forward_batch(device),
            sampling_info=self.sampling_info(vocab_size, device),
            return_logprob=[r.return_logprob for r in self.reqs],
            top_logprobs_nums=[r.top_logprobs_num for r in self.reqs],
            token_ids_logprob=[r.token_ids_logprob for r in self.reqs],
            draft_ids=self.draft_ids,
            draft_probs=self.draft_probs,
        )
        # Requests with a custom logit processor: their output ids before this forward.
        custom = [
            (i, r, r.pending_tokens, list(r.launched_output_ids()))
            for i, r in enumerate(self.reqs)
            if r.custom_logit_processor is not None
        ]
        for req, n in zip(self.reqs, mwb.forward_batch.extend_lens_cpu):
            req.kv_len += n
            if req.kv_len >= req.seq_len:  # not a chunk of a longer prompt
                req.pending_tokens += 1
        if custom:  # only rows that sample a kept token run the processor
            mwb.sampling_info.custom = CustomLogitBatch.build(
                [
                    (
                        i,
                        r.rid,
                        r.custom_logit_processor,
                        ProcessorReq(r.rid, r.origin_input_ids, ids, r.sampling_params),
                    )
                    for i, r, pending, ids in custom
                    if r.pending_tokens > pending and r.sampling_params.max_new_tokens > 0
                ]
            )
        return mwb

    def to_forward_batch(self, device: str) -> ForwardBatch:
        """Tensors for the model. A prefilling request computes seq_ids[kv_len:kv_len +
        extend_len]; a decoding one its newest output token (a placeholder if pending)."""
        input_ids: list[int] = []
        positions: list[int] = []
        prefix_lens, extend_lens, seq_lens = [], [], []
        placeholders = False
        for i, req in enumerate(self.reqs):
            if self.is_prefill(i):
                new = req.seq_ids[req.kv_len : req.kv_len + self.extend_lens[i]]
            elif req.pending_tokens:  # NOTE: not launched_output_ids(): it copies output_ids
                new = [FutureMap.placeholder(req.req_pool_idx)]
                placeholders = True
            else:
                new = req.output_ids[-1:] + (self.draft_ids[i] if self.draft_ids is not None else [])
            prefix_lens.append(req.kv_len)
            extend_lens.append(len(new))
            seq_lens.append(req.kv_len + len(new))
            input_ids.extend(new)
            positions.extend(range(req.kv_len, req.kv_len + len(new)))
        verify = self.draft_ids is not None
        extend = self.forward_mode.is_extend() or verify
        # NOTE: two tensors of two rows each, not four (a decode step's Python runs with cold
        # caches after the forward's weight stream: each tensor made costs ~20 us there)
        tokens = torch.tensor([input_ids, positions], dtype=torch.int64, device=device)
        rows = torch.tensor([[r.req_pool_idx for r in self.reqs], seq_lens], dtype=torch.int64, device=device)
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND if verify else self.forward_mode,
            batch_size=len(self.reqs),
            input_ids=tokens[0],
            positions=tokens[1],
            out_cache_loc=self.out_cache_loc,
            req_pool_indices=rows[0],
            seq_lens=rows[1],
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=extend_lens,
            input_logprob_starts=[
                r.logprob_start_len if self.is_prefill(i) and r.wants_input_logprobs() and not verify else -1
                for i, r in enumerate(self.reqs)
            ]
            if extend
            else None,
            top_logprobs_nums=[r.top_logprobs_num for r in self.reqs] if extend else None,
            token_ids_logprobs=[r.token_ids_logprob for r in self.reqs] if extend else None,
            num_prefill=self.num_prefill,
            all_logits=verify,
            placeholders=placeholders,
            lora_uids=[r.lora_uid for r in self.reqs] if any(r.lora_uid is not None for r in self.reqs) else None,
        )

    def sampling_info(self, vocab_size: int, device: str) -> SamplingBatchInfo:
        penalties = None
        if any(needs_penalties(r.sampling_params) for r in self.reqs):  # hot loop: usually none
            penalties = PenaltyBatch.build(
                [
                    PenaltyInput(r.sampling_params, r.origin_input_ids, r.launched_output_ids(), r.min_tokens_banned)
                    for r in self.reqs
                ],
                device,
            )
        return SamplingBatchInfo(
            [r.sampling_params for r in self.reqs],
            [r.launched_output_len for r in self.reqs],
            vocab_size,
            device,
            penalties,
        )


@dataclass
class ModelWorkerBatch:
    """What the worker needs for one forward and its sampling, taken when the batch is
    launched: the worker never reads a live `Req`. Token ids (inputs, penalty tokens) may
    be FutureMap placeholders for tokens an earlier forward samples."""

    forward_batch: ForwardBatch
    sampling_info: SamplingBatchInfo
    # Per request: whether output logprobs are wanted, how many top ones, which token ids.
    return_logprob: list[bool]
    top_logprobs_nums: list[int]
    token_ids_logprob: list[list[int] | None]
    # Constrained requests' allowed tokens (tandem/constrained/vocab_mask.py); None: none.
    vocab_mask: Any = None
    # Speculative verification: each request's draft tokens, and a draft model's
    # distributions (see ScheduleBatch); None: a plain forward.
    draft_ids: list[list[int]] | None = None
    draft_probs: torch.Tensor | None = None
