"""Every message that crosses a process boundary, in one module.

Direction of each message:
  TokenizerManager -> Scheduler:        TokenizedGenerateReqInput, AbortReq, GetServerStateReq,
                                        FlushCacheReq, ProfileReq, UpdateWeightsReq
                                        subclasses, GetWeightsByNameReqInput
  Scheduler -> TokenizerManager:        ServerStateOutput, FlushCacheOutput, ProfileReqOutput,
                                        UpdateWeightFromDiskReqOutput, GetWeightsByNameReqOutput;
                                        BatchTokenIDOutput under
                                        --skip-tokenizer-init (no detokenizer runs)
  Scheduler -> DetokenizerManager:      BatchTokenIDOutput (one per scheduler step)
  DetokenizerManager -> TokenizerManager: BatchStrOutput (one per BatchTokenIDOutput)
  Subprocess -> parent at start-up:     ReadyMessage
  Replica -> data-parallel controller:  DpReplicaReply, DpFinishedReqs (--dp-size > 1; the
                                        controller forwards the tokenizer manager's messages)
  Tokenizer worker -> other workers:    AbortLabelReq (--tokenizer-worker-num N > 1)
Outputs are batched: one message per step carries every request that produced tokens
or finished in that step. Serialization is in `tandem.utils.zmq_io`.

Identity: every `rid` in these messages is the request's internal id, issued by the
TokenizerManager and never reused (one per sample of an n > 1 request). The client's
`rid` is only a label that the TokenizerManager keeps and echoes in meta_info["id"], so
a late output or abort of a finished request can never reach a newer one. The internal
id starts with the number of the tokenizer worker that issued it (`{worker}.{random}-{n}`,
managers/multi_tokenizer.py), and so do control requests' `request_id`s: under
--tokenizer-worker-num N > 1 each output and reply goes to that worker alone.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from tandem.sampling.sampling_params import SamplingParams, is_neutral


@dataclass
class TokenizedGenerateReqInput:
    """One request, tokenized and validated, on its way to the scheduler."""

    rid: str  # the internal id (see the module docstring)
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    input_text: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    # Token ids whose logprobs are returned at every position (None: not asked for).
    token_ids_logprob: list[int] | None = None


@dataclass
class AbortReq:
    """Ask the scheduler to stop a request (queued or running) by its internal id; an
    unknown id (a request that has ended) is ignored. `abort_all` stops all."""

    rid: str | None = None
    abort_all: bool = False
    message: str = "aborted"


@dataclass
class AbortLabelReq:
    """Under --tokenizer-worker-num N > 1, from the worker whose /abort_request got a
    client rid to every other worker: abort what you run under this label."""

    label: str


@dataclass
class ControlReq:
    """A control call from a tokenizer manager to the scheduler (not a generate request).

    The scheduler answers each with one `ControlOutput` of the same `request_id` (its
    handler table, `Scheduler.control_handlers`); the id starts with the asking tokenizer
    worker's number, so the reply reaches that worker (managers/multi_tokenizer.py)."""

    request_id: str


@dataclass
class ControlOutput:
    """The scheduler's reply to a `ControlReq`, matched to its caller by `request_id`."""

    request_id: str

    @classmethod
    def merge(cls, replies: list["ControlOutput"]) -> "ControlOutput":
        """One reply from every data-parallel replica's (in DP-rank order), for the data
        parallel controller: the first that failed (`success` false), else replica 0's."""
        return next((r for r in replies if getattr(r, "success", True) is False), replies[0])


@dataclass
class FlushCacheReq(ControlReq):
    """Empty the prefix cache; refused while requests run or wait."""


@dataclass
class FlushCacheOutput(ControlOutput):
    success: bool
    message: str = ""


@dataclass
class ProfileReq(ControlReq):
    """Start or stop the torch profiler in the scheduler (SGLang's /start_profile, /stop_profile).

    On stop (or after `num_steps` forward steps) the trace is written to
    `{output_dir}/{profile_prefix-}{profile_id}-TP-0.trace.json.gz`.
    """

    action: str  # "start" or "stop"
    output_dir: str | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: str | None = None
    profile_prefix: str | None = None


@dataclass
class ProfileReqOutput(ControlOutput):
    success: bool
    message: str = ""


@dataclass
class GetServerStateReq(ControlReq):
    """Ask the scheduler for its live counts; answered with ServerStateOutput."""


@dataclass
class UpdateWeightsReq(ControlReq):
    """A weight update (from disk or from tensors). The scheduler stops admitting, lets
    the running requests finish (or aborts them all with `abort_all_requests`), loads
    into new tensors on every TP rank, swaps them in only if every rank succeeded,
    flushes the prefix cache (unless `flush_cache` is false: SGLang's flag for a series
    of partial updates) and sets the weight version (`weight_version`, else a counter).
    Answered with an `UpdateWeightFromDiskReqOutput`."""

    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


@dataclass
class UpdateWeightFromDiskReqInput(UpdateWeightsReq):
    """Load new weights of the same architecture from `model_path` (SGLang's body)."""

    model_path: str = ""
    load_format: str | None = None


@dataclass
class HostTensor:
    """A tensor on its way to the scheduler, as its bytes in a numpy array, its dtype and
    its shape: pickled ~10x faster than a torch tensor (whose pickling goes through
    torch.save; measured on 378 MB: 0.2 s vs 2.5 s to pickle and unpickle)."""

    data: Any  # a flat numpy uint8 array
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> HostTensor:
        t = tensor.detach().to("cpu").contiguous()
        return cls(t.reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape))

    def to_tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.data).view(getattr(torch, self.dtype)).reshape(self.shape)


@dataclass
class UpdateWeightsFromTensorReqInput(UpdateWeightsReq):
    """Replace the named checkpoint tensors (SGLang's Engine.update_weights_from_tensor).
    The whole tensors travel pickled (host memory, one machine); every TP rank gets them
    all by the scheduler's broadcast and takes its own shard."""

    named_tensors: list[tuple[str, HostTensor]] = field(default_factory=list)
    load_format: str | None = None  # None or "direct" (the same here)


@dataclass
class UpdateWeightFromDiskReqOutput(ControlOutput):
    """The reply to either weight update (`UpdateWeightsReq`)."""

    success: bool
    message: str
    num_paused_requests: int = 0
    weight_version: str = "default"


@dataclass
class GetWeightsByNameReqInput(ControlReq):
    """The first `truncate_size` rows of the checkpoint tensor `name` (a flat tensor: its
    first values) of the weights being served (see ModelRunner.get_weights_by_name)."""

    name: str = ""
    truncate_size: int = 100


@dataclass
class GetWeightsByNameReqOutput(ControlOutput):
    parameter: list | None  # None: no such weight (see message)
    message: str = ""


@dataclass
class ServerStateOutput(ControlOutput):
    """Live scheduler counts, for /server_info and memory checks.

    Memory invariant (DESIGN.md §5), when idle:
    free_kv_slots + evictable_cached_slots == max_total_num_tokens.
    """

    max_total_num_tokens: int
    free_kv_slots: int
    evictable_cached_slots: int
    protected_cached_slots: int
    num_running_reqs: int
    num_waiting_reqs: int
    free_req_rows: int
    # Rolling fraction of time the forward sat idle waiting for the scheduler (#10).
    forward_idle_fraction: float = 0.0
    # The version of the weights being served (SGLang's name): "default", then set by
    # each /update_weights_from_disk.
    weight_version: str = "default"
    # Requests this scheduler has finished (any reason) since it started.
    num_finished_reqs: int = 0
    # Output tokens per second over the last few seconds (SGLang's gen_throughput).
    gen_throughput: float = 0.0
    # --dp-size > 1: each replica's own state, in DP-rank order (the fields above are
    # then their sums; the idle fraction their mean; the weight version replica 0's).
    dp_rank_states: list["ServerStateOutput"] | None = None

    @classmethod
    def merge(cls, replies: list["ServerStateOutput"]) -> "ServerStateOutput":
        first = replies[0]
        summed = {f.name: sum(getattr(r, f.name) for r in replies)
                  for f in dataclasses.fields(cls) if f.type == "int"}
        return dataclasses.replace(
            first, **summed, dp_rank_states=list(replies),
            forward_idle_fraction=sum(r.forward_idle_fraction for r in replies) / len(replies),
            gen_throughput=round(sum(r.gen_throughput for r in replies), 2))


@dataclass
class DetokenizeParams:
    """What the detokenizer needs to know about one request; sent with its first output.

    `prompt_tail` holds the last few prompt ids: the detokenizer decodes the output with
    them as left context, so that prompt text + output text is the text of prompt +
    output ids (a SentencePiece decoder drops the space of a fragment's first piece).
    """

    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    stop: list[str]
    no_stop_trim: bool
    stream: bool
    prompt_tail: list[int] = field(default_factory=list)


@dataclass(slots=True)
class ReqOutput:
    """What one request produced in one scheduler step (one record per request, DESIGN.md §3).

    `new_token_ids` holds only the ids produced since the previous record for that rid.
    `finished_reason` is None while the request runs, else SGLang's dict:
    {"type": "stop", "matched": ...}, {"type": "length", "length": N} or
    {"type": "abort", "message": ...} (with "status_code" when the request was refused,
    or 500 when handling it raised: `error_finish_reason`). `detokenize_params` rides
    with a request's first record; `text_delta` is filled by the detokenizer.

    The logprob fields are None for a request that did not ask for logprobs; otherwise
    they hold (logprob, token_id) pairs of the new output tokens, their top alternatives,
    and (in the request's first record only) the prompt's logprobs from
    logprob_start_len on. The token-ids fields hold, per position, the (logprob,
    token_id) pairs of the request's `token_ids_logprob` (None where it asked for none;
    an input position with nothing to score, the prompt's first token, is None).
    """

    rid: str
    new_token_ids: list[int]
    finished_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    retractions: int = 0
    detokenize_params: DetokenizeParams | None = None
    text_delta: str = ""
    output_token_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]]] | None = None
    output_token_ids_logprobs: list[list[tuple[float, int]]] | None = None
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None
    # The version of the weights that produced it (meta_info["weight_version"]).
    weight_version: str = "default"


_REQ_OUTPUT_VALUES = operator.attrgetter(*(f.name for f in dataclasses.fields(ReqOutput)))


def _batch_from_rows(cls: type, rows: list[tuple]) -> Any:
    return cls([ReqOutput(*row) for row in rows])


class _ReqOutputBatch:
    """Pickled as one tuple per record (C-level attribute reads): 3x faster to encode
    and half the bytes of pickling each record as an object (64 records: ~35 + 30 us)."""

    outputs: list[ReqOutput]

    def __reduce__(self):
        return _batch_from_rows, (type(self), [_REQ_OUTPUT_VALUES(r) for r in self.outputs])


@dataclass
class BatchTokenIDOutput(_ReqOutputBatch):
    """Every request that advanced or finished in one scheduler step, one record each."""

    outputs: list[ReqOutput] = field(default_factory=list)


def error_finish_reason(where: str, exc: BaseException) -> dict[str, Any]:
    """The finish reason of a request whose handling raised (DESIGN.md §9, the second wall):
    that request ends with this abort and the server keeps serving."""
    return {"type": "abort", "status_code": INTERNAL_ERROR_STATUS,
            "message": f"internal error while {where}: {type(exc).__name__}: {exc}"}


# finish_reason["status_code"] of a request ended by `error_finish_reason`.
INTERNAL_ERROR_STATUS = 500


@dataclass
class BatchStrOutput(_ReqOutputBatch):
    """The detokenizer's answer to one BatchTokenIDOutput: the same records, in the same
    order, with `text_delta` set: the text that became final since the previous record
    for that rid (never a broken UTF-8 character; a possible stop-string prefix is held
    back while the request runs)."""

    outputs: list[ReqOutput] = field(default_factory=list)


@dataclass
class DpReplicaReply:
    """--dp-size > 1: a replica's reply to a control call, to the data-parallel controller,
    which answers the caller once every replica has replied (`ControlOutput.merge`)."""

    dp_rank: int
    reply: ControlOutput


@dataclass
class DpFinishedReqs:
    """--dp-size > 1: the requests a replica finished in one step (internal ids), to the
    data-parallel controller, which counts each replica's requests in flight."""

    dp_rank: int
    rids: list[str]


@dataclass
class ReadyMessage:
    """Sent once by each subprocess when it is ready to serve (or failed to start)."""

    process: str
    ok: bool = True
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


# Longest client rid: it is echoed in every output (each streamed chunk included).
MAX_RID_LENGTH = 512


@dataclass
class GenerateReqInput:
    """A native `/generate` request (or `Engine.generate` call), before tokenization.

    Exactly one of `text` and `input_ids` is given; each may be one prompt or a batch
    (a list of strings / a list of id lists). `sampling_params`, `rid` and the three
    logprob fields may be one value for all prompts or a list with one per prompt;
    `token_ids_logprob` one list of ids for all prompts or a list of such lists.
    """

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    # Input positions from which input logprobs are returned (-1: none, only outputs).
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    # With return_logprob: token ids whose logprobs are returned at every position
    # (SGLang's field; meta_info's input_/output_token_ids_logprobs). Empty means none.
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False

    @classmethod
    def from_json(cls, data: Any) -> "GenerateReqInput":
        """Parse a JSON body; raises ValueError naming the offending field.

        As in SGLang, unknown top-level fields are ignored and null means the default.
        A field of SGLang's request whose feature Tandem lacks (UNSUPPORTED_GENERATE_FIELDS)
        is a ValueError naming the feature unless it holds its neutral value.
        """
        if not isinstance(data, dict):
            raise ValueError("request body: must be a JSON object")
        for name, feature in UNSUPPORTED_GENERATE_FIELDS.items():
            value = data.get(name)
            values = value if isinstance(value, list) and name in _PER_PROMPT_FLAGS else [value]
            if not all(is_neutral(v, _NEUTRAL_GENERATE_VALUES.get(name)) for v in values):
                raise ValueError(f"{name}: {feature} is not supported yet")
        known = {f for f in cls.__dataclass_fields__}
        obj = cls(**{k: v for k, v in data.items() if k in known and v is not None})
        obj.validate_shape()
        return obj

    def validate_shape(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("text/input_ids: exactly one of them must be given")
        if self.text is not None:
            if isinstance(self.text, list):
                if not self.text or not all(isinstance(t, str) for t in self.text):
                    raise ValueError("text: must be a string or a non-empty list of strings")
            elif not isinstance(self.text, str):
                raise ValueError("text: must be a string or a list of strings")
        else:
            ids = self.input_ids
            if not isinstance(ids, list) or not ids:
                raise ValueError("input_ids: must be a non-empty list of token ids or of lists")
            rows = ids if isinstance(ids[0], list) else [ids]
            for row in rows:
                if not isinstance(row, list) or not row or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in row
                ):
                    raise ValueError("input_ids: every prompt must be a non-empty list of integers")
        for name in ("stream", "return_text_in_logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a boolean")
        for value in _as_list(self.return_logprob):
            if not isinstance(value, bool):
                raise ValueError("return_logprob: must be a boolean")
        for name, lo in (("logprob_start_len", -1), ("top_logprobs_num", 0)):
            for value in _as_list(getattr(self, name)):
                if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                    raise ValueError(f"{name}: must be an integer >= {lo}")
        n = self.batch_size
        self._validate_token_ids_logprob(n)
        for name in ("sampling_params", "rid", *_PER_PROMPT_LOGPROB_FIELDS):
            value = getattr(self, name)
            if isinstance(value, list):
                if not self.is_batch or len(value) != n:
                    raise ValueError(f"{name}: a list must have one entry per prompt ({n})")
        if self.sampling_params is not None:
            for sp in self.sampling_params if isinstance(self.sampling_params, list) else [self.sampling_params]:
                if not isinstance(sp, dict):
                    raise ValueError("sampling_params: must be an object")
        if self.rid is not None:
            for rid in self.rid if isinstance(self.rid, list) else [self.rid]:
                if not isinstance(rid, str) or not rid:
                    raise ValueError("rid: must be a non-empty string")
                if len(rid) > MAX_RID_LENGTH:
                    raise ValueError(f"rid: must be at most {MAX_RID_LENGTH} characters, got {len(rid)}")

    def _validate_token_ids_logprob(self, n: int) -> None:
        """A list of ids, or (a batch) one list per prompt; an empty list means none."""
        value = self.token_ids_logprob
        if not value:
            self.token_ids_logprob = None
            return
        nested = isinstance(value, list) and isinstance(value[0], list)
        rows = value if nested else [value]
        if not isinstance(value, list) or not all(
            isinstance(row, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in row)
            for row in rows
        ):
            raise ValueError("token_ids_logprob: must be a list of token ids, or one such list per prompt")
        if nested and (not self.is_batch or len(value) != n):
            raise ValueError(f"token_ids_logprob: a list of lists must have one list per prompt ({n})")

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return isinstance(self.input_ids[0], list)

    @property
    def batch_size(self) -> int:
        if not self.is_batch:
            return 1
        return len(self.text) if self.text is not None else len(self.input_ids)

    def item(self, i: int) -> "GenerateReqInput":
        """The i-th prompt of a batch as a single request."""
        def pick(value):
            return value[i] if isinstance(value, list) else value

        return dataclasses.replace(
            self,
            text=self.text[i] if self.text is not None else None,
            input_ids=self.input_ids[i] if self.input_ids is not None else None,
            sampling_params=pick(self.sampling_params),
            rid=pick(self.rid),
            token_ids_logprob=self.token_ids_for(i),
            **{name: pick(getattr(self, name)) for name in _PER_PROMPT_LOGPROB_FIELDS},
        )

    def token_ids_for(self, i: int) -> list[int] | None:
        """The `token_ids_logprob` of prompt i (a flat list applies to every prompt)."""
        value = self.token_ids_logprob
        if value and isinstance(value[0], list):
            return value[i] or None
        return value or None


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


# Logprob fields that, as in SGLang, may hold one value per prompt of a batch.
_PER_PROMPT_LOGPROB_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num")
# Fields of SGLang's GenerateReqInput whose feature Tandem lacks -> the feature, for the
# 400 message. Null, false, an empty value or 0 is accepted and ignored. Other fields
# SGLang knows (labels and hints such as session_id, priority, custom_labels, log_metrics)
# and unknown fields are ignored, as SGLang ignores unknown fields.
UNSUPPORTED_GENERATE_FIELDS = MappingProxyType({
    "input_embeds": "input embedding",
    "image_data": "image input",
    "video_data": "video input",
    "audio_data": "audio input",
    "return_hidden_states": "returning hidden states",
    "return_routed_experts": "returning routed experts",
    "return_entropy": "returning entropy",
    "return_sampling_mask": "returning the sampling mask",
    "return_flat_raw_top_logprobs": "flat top-logprob output",
    "return_flat_raw_output_top_logprobs": "flat top-logprob output",
    "return_prompt_token_ids": "returning prompt token ids",
    "lora_path": "LoRA",
    "lora_id": "LoRA",
    "custom_logit_processor": "a custom logit processor",
    "session_params": "session",
    "bootstrap_host": "prefill-decode disaggregation",
    "bootstrap_room": "prefill-decode disaggregation",
    "data_parallel_rank": "data parallelism",
    "routed_dp_rank": "data parallelism",
    "positional_embed_overrides": "embedding override",
    "cache_salt": "cache salt",
    "max_thinking_tokens": "a thinking budget",
    "require_reasoning": "reasoning control",
    "background": "background mode",
})
# Neutral values besides null, false and empty ones: one data-parallel rank, rank 0.
_NEUTRAL_GENERATE_VALUES = MappingProxyType({"data_parallel_rank": 0, "routed_dp_rank": 0})
# Unsupported fields that may hold one flag per prompt (each must be neutral).
_PER_PROMPT_FLAGS = frozenset({"lora_path", "lora_id", "custom_logit_processor", "return_hidden_states",
                               "return_sampling_mask", "bootstrap_host", "bootstrap_room"})
