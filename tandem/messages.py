"""Every message that crosses a process boundary, in one module.

Direction of each message:
  TokenizerManager -> Scheduler:        TokenizedGenerateReqInput, AbortReq, GetServerStateReq,
                                        FlushCacheReq, ProfileReq, UpdateWeightsReq
                                        subclasses, GetWeightsByNameReqInput,
                                        LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput
  Scheduler -> TokenizerManager:        ServerStateOutput, FlushCacheOutput, ProfileReqOutput,
                                        UpdateWeightFromDiskReqOutput, GetWeightsByNameReqOutput,
                                        LoRAUpdateOutput;
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
tandem/tokenizer/multi_tokenizer.py), and so do control requests' `request_id`s: under
--tokenizer-worker-num N > 1 each output and reply goes to that worker alone.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch is imported where a HostTensor is made or read, not by every reader of messages
    import torch


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
    # SGLang's request priority (--enable-priority-scheduling; None: the lowest).
    priority: int | None = None
    # SGLang's serialized custom logit processor (CustomLogitProcessor.to_str()); each
    # rank's scheduler deserializes it (--enable-custom-logit-processor).
    custom_logit_processor: str | None = None
    # The name of its LoRA adapter (None: the base model); the scheduler resolves it.
    lora_name: str | None = None


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
    handler table, `SchedulerControl.handlers`); the id starts with the asking tokenizer
    worker's number, so the reply reaches that worker (tandem/tokenizer/multi_tokenizer.py)."""

    request_id: str


@dataclass
class ControlOutput:
    """The scheduler's reply to a `ControlReq`, matched to its caller by `request_id`."""

    request_id: str

    @classmethod
    def merge(cls, replies: list[ControlOutput]) -> ControlOutput:
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
        import torch

        t = tensor.detach().to("cpu").contiguous()
        return cls(t.reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape))

    def to_tensor(self) -> torch.Tensor:
        import torch

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
class LoadLoRAAdapterReqInput(ControlReq):
    """Load the PEFT adapter at `lora_path` under `lora_name` while serving (SGLang's body)."""

    lora_name: str = ""
    lora_path: str = ""


@dataclass
class UnloadLoRAAdapterReqInput(ControlReq):
    """Unload adapter `lora_name`; refused while a queued or running request uses it."""

    lora_name: str = ""


@dataclass
class LoRAUpdateOutput(ControlOutput):
    """The reply to a LoRA load or unload (SGLang's fields); `in_use`: the refused unload's
    requests (their rids), answered with 409."""

    success: bool
    error_message: str = ""
    loaded_adapters: dict[str, str] = field(default_factory=dict)
    in_use: list[str] = field(default_factory=list)


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

    Memory invariant (docs/architecture.md, "KV memory and the radix cache"), when idle:
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
    # --speculative-algorithm: request decode steps, drafts proposed and accepted since start.
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # --dp-size > 1: each replica's own state, in DP-rank order (the fields above are
    # then their sums; the idle fraction their mean; the weight version replica 0's).
    dp_rank_states: list[ServerStateOutput] | None = None

    @classmethod
    def merge(cls, replies: list[ServerStateOutput]) -> ServerStateOutput:
        first = replies[0]
        summed = {f.name: sum(getattr(r, f.name) for r in replies) for f in dataclasses.fields(cls) if f.type == "int"}
        return dataclasses.replace(
            first,
            **summed,
            dp_rank_states=list(replies),
            forward_idle_fraction=sum(r.forward_idle_fraction for r in replies) / len(replies),
            gen_throughput=round(sum(r.gen_throughput for r in replies), 2),
        )


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
    stop_regex: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ReqOutput:
    """What one request produced in one scheduler step (one record per request;
    docs/architecture.md, "Processes and pipes").

    `new_token_ids` holds only the ids produced since the previous record for that rid.
    `finished_reason` is None while the request runs, else SGLang's dict:
    {"type": "stop", "matched": ...}, {"type": "length", "length": N} or
    {"type": "abort", "message": ...} (with "status_code" when the request was refused,
    or 500 when handling it raised); see `tandem.finish_reason`. `detokenize_params` rides
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
    # --speculative-algorithm: its verify steps, drafts proposed and accepted so far
    # (meta_info's spec_* fields); None without speculation.
    spec_verify_ct: int | None = None
    spec_draft_token_num: int = 0
    spec_accept_token_num: int = 0


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
