"""The scheduler's output builder: one `BatchTokenIDOutput` per step, from the requests
that have something due (finished ones; streaming ones on their first token or after
--stream-interval new tokens)."""

from __future__ import annotations

from collections.abc import Callable

from tandem.messages import BatchTokenIDOutput, ReqOutput
from tandem.scheduler.schedule_batch import Req


def build_batch_output(
    reqs: list[Req], stream_interval: int, weight_version: str, on_error: Callable[[Req, Exception], None]
) -> BatchTokenIDOutput | None:
    """Everything due of `reqs`, or None when nothing is, stamped with the served
    `weight_version`. A request whose record cannot be built is reported to `on_error`
    (which ends it) and sent as an error finish."""
    out = BatchTokenIDOutput()
    for req in reqs:
        new_len = len(req.output_ids) - req.sent_len
        due = req.finished() or (req.stream and new_len > 0 and (req.sent_len == 0 or new_len >= stream_interval))
        if not due:
            continue
        try:
            record = output_record(req)
        except Exception as e:  # noqa: BLE001 - the second wall
            on_error(req, e)
            record = error_record(req)
        record.weight_version = weight_version
        out.outputs.append(record)
        req.sent_len = len(req.output_ids)
        req.sent_detokenize_params = True
    return out if out.outputs else None


def output_record(req: Req) -> ReqOutput:
    """What is new for `req` since its last record."""
    first = not req.sent_detokenize_params
    record = ReqOutput(
        rid=req.rid,
        new_token_ids=req.output_ids[req.sent_len :],
        finished_reason=req.finished_reason,
        prompt_tokens=req.prompt_len,
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        retractions=req.retractions,
        detokenize_params=req.detokenize_params() if first else None,
    )
    if req.spec is not None:
        record.spec_verify_ct = req.spec.verify_ct
        record.spec_draft_token_num, record.spec_accept_token_num = req.spec.draft_tokens, req.spec.accepted_tokens
    if req.return_logprob:
        record.output_token_logprobs = req.output_token_logprobs[req.sent_len :]
        record.output_top_logprobs = req.output_top_logprobs[req.sent_len :]
        record.output_token_ids_logprobs = req.output_token_ids_logprobs[req.sent_len :]
        if first:
            record.input_token_logprobs = req.input_token_logprobs
            record.input_top_logprobs = req.input_top_logprobs
            record.input_token_ids_logprobs = req.input_token_ids_logprobs
    return record


def error_record(req: Req) -> ReqOutput:
    """The last record of a request ended by an error: its finish, no new ids (the
    detokenizer passes an unknown id without DetokenizeParams through as "")."""
    return ReqOutput(
        rid=req.rid,
        new_token_ids=[],
        finished_reason=req.finished_reason,
        prompt_tokens=req.prompt_len,
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        retractions=req.retractions,
    )
