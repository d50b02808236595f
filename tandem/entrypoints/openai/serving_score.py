"""POST /v1/score (SGLang's decoder-only scoring): for each item, the probability of each
label token at the position right after query + item.

Each item is one prefill-only request (`max_new_tokens` 0) asking for the label ids'
logprobs through `token_ids_logprob`; the scores are read from
`meta_info.output_token_ids_logprobs[0]`, as SGLang's TokenizerManager does. Validation
messages are SGLang's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tandem.entrypoints.disconnect import ClientDisconnected, await_or_disconnect
from tandem.entrypoints.native_protocol import GenerateReqInput
from tandem.entrypoints.openai.common import raise_if_refused
from tandem.entrypoints.openai.errors import OpenAIError, from_value_error
from tandem.entrypoints.openai.protocol import ScoringRequest, ScoringResponse, UsageInfo
from tandem.entrypoints.responses import json_response
from tandem.entrypoints.streams import last_outputs


@dataclass
class ScoreResult:
    scores: list[list[float]]
    prompt_tokens: int = 0
    token_logprobs: list[list[float]] | None = None


def _label_lists(label_token_ids: Any, num_items: int, vocab_size: int) -> list[list[int]]:
    """One candidate list per item (a flat list is shared), checked as SGLang checks it."""
    if not isinstance(label_token_ids, list) or not label_token_ids:
        raise ValueError("label_token_ids must be a nonempty list")
    if isinstance(label_token_ids[0], list):
        if len(label_token_ids) != num_items:
            raise ValueError("label_token_ids must have one list per item")
        lists = label_token_ids
    else:
        lists = [label_token_ids] * num_items
    for labels in lists:
        if not isinstance(labels, list) or not labels:
            raise ValueError("each item must have a nonempty candidate list")
        if any(type(t) is not int or t < 0 for t in labels):
            raise ValueError("label_token_ids must contain nonnegative integers")
        if len(set(labels)) != len(labels):
            raise ValueError("label_token_ids must not contain duplicate tokens")
        for t in labels:
            if t >= vocab_size:
                raise ValueError(f"Token ID {t} is out of vocabulary (vocab size: {vocab_size})")
    return lists


def build_score_input(
    query: str | list[int] | None, items: str | list[str] | list[list[int]], labels: list[list[int]], item_first: bool
) -> GenerateReqInput:
    """One prefill-only request per item: query + item (or item + query), text or ids."""
    items = [items] if isinstance(items, str) else items
    token_items = isinstance(items[0], list)
    if query is None:
        query = [] if token_items else ""
    if isinstance(query, str) and not token_items:
        texts = [f"{item}{query}" if item_first else f"{query}{item}" for item in items]
        prompt: dict[str, Any] = {"text": texts}
    elif isinstance(query, list) and token_items:
        prompt = {"input_ids": [item + query if item_first else query + item for item in items]}
    else:
        raise ValueError("Invalid combination of query/items types for score_request.")
    return GenerateReqInput(
        **prompt,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=-1,
        token_ids_logprob=labels,
    )


def to_scores(logprobs: list[float], apply_softmax: bool, temperature: float) -> list[float]:
    """Label logprobs -> probabilities (exp), or a softmax over the labels at `temperature`."""
    if not apply_softmax:
        return [math.exp(x) if x != float("-inf") else 0.0 for x in logprobs]
    top = max(logprobs)
    weights = [math.exp((x - top) / temperature) for x in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


async def score(tm, req: ScoringRequest, request: Request | None = None) -> ScoreResult:
    """Score `req`'s items; raises ValueError with SGLang's message for a bad request."""
    if not math.isfinite(req.temperature) or req.temperature <= 0:
        raise ValueError("temperature must be finite and greater than zero")
    if req.temperature != 1.0 and not req.apply_softmax:
        raise ValueError("temperature requires apply_softmax=True")
    if req.return_pooled_hidden_states:
        raise ValueError(
            "return_pooled_hidden_states is not supported for CausalLM models. It requires a model "
            "with a task-specific head (e.g. SequenceClassification or RewardModel)."
        )
    if req.label_token_ids is None:
        raise ValueError("label_token_ids is required for generation (CausalLM) models.")
    if req.items is None:
        raise ValueError("items must be provided")
    if not req.items:
        return ScoreResult(scores=[], token_logprobs=[] if req.return_token_logprobs else None)
    num_items = 1 if isinstance(req.items, str) else len(req.items)
    labels = _label_lists(req.label_token_ids, num_items, tm.vocab_size)
    streams = await tm.generate_request(build_score_input(req.query, req.items, labels, req.item_first))
    outputs = await (last_outputs(streams) if request is None else await_or_disconnect(request, last_outputs(streams)))
    raise_if_refused(outputs)
    result = ScoreResult(scores=[], token_logprobs=[] if req.return_token_logprobs else None)
    for out, item_labels in zip(outputs, labels):
        meta = out["meta_info"]
        if (meta.get("finish_reason") or {}).get("type") == "abort":
            raise OpenAIError(meta["finish_reason"].get("message", "aborted"), 500)
        result.prompt_tokens += meta["prompt_tokens"]
        by_id = {tid: lp for lp, tid, *_ in meta["output_token_ids_logprobs"][0]}
        logprobs = [by_id[t] for t in item_labels]
        result.scores.append(to_scores(logprobs, req.apply_softmax, req.temperature))
        if result.token_logprobs is not None:
            result.token_logprobs.append(logprobs)
    return result


async def handle_score(tm, request: Request, req: ScoringRequest) -> Response:
    """The /v1/score route: ScoringResponse, or an OpenAI-shaped 400 with SGLang's message."""
    bad = req.unsupported_fields()
    if bad:
        raise OpenAIError(f"{bad[0]}: not supported yet", 400, param=bad[0])
    try:
        result = await score(tm, req, request)
    except ClientDisconnected:
        return Response(status_code=499)
    except ValueError as e:
        raise from_value_error(e) from e
    resp = ScoringResponse(
        scores=result.scores,
        token_logprobs=result.token_logprobs,
        model=req.model,
        usage=UsageInfo.of(result.prompt_tokens, 0),
    )
    return json_response(resp.model_dump())
