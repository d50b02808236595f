"""Logit adjustments that depend on the tokens a request has seen (SGLang's penalizers).

Applied to a copy of the logits before sampling (greedy included), in this order:
  repetition_penalty  every token of the prompt and the output so far: a positive logit
                      is divided by the penalty, a negative one multiplied
                      (transformers' `RepetitionPenaltyLogitsProcessor`);
  frequency_penalty   minus penalty x the number of times the token is in the output;
  presence_penalty    minus penalty once if the token is in the output (OpenAI's formula);
  min_new_tokens      the request's stop token ids and EOS get -inf until it has generated
                      that many tokens.
Reported logprobs stay those of the model's own distribution (the caller keeps the
unadjusted logits). State is rebuilt from the token lists at every step, so retraction,
chunked prefill and n > 1 need no bookkeeping here. An output token whose forward has not
returned yet (the overlap loop) is a FutureMap placeholder, resolved by the worker
(`resolved`) before the adjustments are applied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.sampling.sampling_params import SamplingParams


@dataclass
class PenaltyInput:
    """What one request of the batch contributes."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # every sampled token, pending ones as placeholders
    # Ids masked while len(output_ids) < params.min_new_tokens (stop token ids, EOS).
    min_tokens_banned: list[int]


def needs_penalties(params: SamplingParams) -> bool:
    return (
        params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
        or params.repetition_penalty != 1.0
        or params.min_new_tokens > 0
    )


@dataclass
class PenaltyBatch:
    frequency: torch.Tensor  # [bs, 1]
    presence: torch.Tensor  # [bs, 1]
    repetition: torch.Tensor  # [bs, 1]
    output_rows: torch.Tensor  # (row, token) of every output token of requests with
    output_tokens: torch.Tensor  # a frequency or presence penalty
    seen_rows: torch.Tensor  # (row, token) of every prompt and output token of requests
    seen_tokens: torch.Tensor  # with a repetition penalty
    banned_rows: torch.Tensor  # (row, token) masked by min_new_tokens this step
    banned_tokens: torch.Tensor

    @classmethod
    def build(cls, inputs: list[PenaltyInput], device: str) -> PenaltyBatch | None:
        """The batch's adjustments, or None when no request has any."""
        if not any(needs_penalties(x.params) for x in inputs):
            return None
        out_rows: list[int] = []
        out_tokens: list[int] = []
        seen_rows: list[int] = []
        seen_tokens: list[int] = []
        ban_rows: list[int] = []
        ban_tokens: list[int] = []
        for row, x in enumerate(inputs):
            p = x.params
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                out_rows += [row] * len(x.output_ids)
                out_tokens += x.output_ids
            if p.repetition_penalty != 1.0:
                seen = set(x.prompt_ids)
                seen.update(x.output_ids)
                seen_rows += [row] * len(seen)
                seen_tokens += sorted(seen)
            if len(x.output_ids) < p.min_new_tokens:
                ban_rows += [row] * len(x.min_tokens_banned)
                ban_tokens += x.min_tokens_banned

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

        def ids(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            frequency=column([x.params.frequency_penalty for x in inputs]),
            presence=column([x.params.presence_penalty for x in inputs]),
            repetition=column([x.params.repetition_penalty for x in inputs]),
            output_rows=ids(out_rows),
            output_tokens=ids(out_tokens),
            seen_rows=ids(seen_rows),
            seen_tokens=ids(seen_tokens),
            banned_rows=ids(ban_rows),
            banned_tokens=ids(ban_tokens),
        )

    def resolved(self, resolve: Callable[[torch.Tensor], torch.Tensor]) -> PenaltyBatch:
        """This batch with its token ids passed through `resolve` (FutureMap.resolve)."""
        return dataclasses.replace(
            self, output_tokens=resolve(self.output_tokens), seen_tokens=resolve(self.seen_tokens)
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """[bs, vocab] float32 logits -> adjusted logits (a new tensor)."""
        logits = logits.clone()
        if self.seen_rows.numel():
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[self.seen_rows, self.seen_tokens] = True
            penalized = torch.where(logits < 0, logits * self.repetition, logits / self.repetition)
            logits = torch.where(seen, penalized, logits)
        if self.output_rows.numel():
            counts = torch.zeros_like(logits)
            counts.index_put_(
                (self.output_rows, self.output_tokens),
                torch.ones_like(self.output_rows, dtype=logits.dtype),
                accumulate=True,
            )
            logits -= self.frequency * counts + self.presence * (counts > 0).to(logits.dtype)
        if self.banned_rows.numel():
            logits[self.banned_rows, self.banned_tokens] = float("-inf")
        return logits
