"""From final hidden states to what the scheduler needs: next-token logits, and the
log-probabilities of prompt tokens for requests that asked for input logprobs.

Logprobs are of the distribution the model produced (before temperature and other
sampling transforms), as SGLang reports them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tandem.forward_batch import ForwardBatch


@dataclass
class InputLogprobs:
    """Per request: logprob of each prompt token from `start` on (None for position 0),
    its top alternatives, and the (logprob, token_id) pairs of the request's
    `token_ids_logprob` (None when it asked for none; the entry of position 0 is None)."""

    token_logprobs: list[float | None]
    top_logprobs: list[list[tuple[float, int]]]
    token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor  # [bs, vocab] float32 ([num_tokens, vocab] under `fb.all_logits`)
    # One entry per request; None where input logprobs were not asked for.
    input_logprobs: list[InputLogprobs | None] = field(default_factory=list)


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    """[n, vocab] -> for each row, the k most likely (logprob, token_id), best first."""
    if k <= 0:
        return [[] for _ in range(logprobs.shape[0])]
    values, ids = logprobs.topk(k, dim=-1)
    return [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]


def token_ids_logprobs(logprobs: torch.Tensor, token_ids: list[int]) -> list[list[tuple[float, int]]]:
    """[n, vocab] -> for each row, the (logprob, token_id) of every id in `token_ids`, in order."""
    values = logprobs[:, torch.tensor(token_ids, dtype=torch.int64, device=logprobs.device)].tolist()
    return [list(zip(row, token_ids)) for row in values]


class LogitsProcessor:
    """`final_logit_softcapping` (Gemma 2): every logit it returns, and every one its
    logprobs are computed from, is `cap * tanh(logit / cap)` (in float32), as transformers
    caps the LM head's output before sampling."""

    def __init__(self, final_logit_softcapping: float | None = None):
        self.softcap = float(final_logit_softcapping or 0.0)

    def __call__(
        self, hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor], fb: ForwardBatch
    ) -> LogitsProcessorOutput:
        """`lm_head` maps hidden states [n, hidden] to logits [n, vocab]."""
        if self.softcap > 0:
            lm_head = self._capped(lm_head, self.softcap)
        if fb.forward_mode.is_decode() or fb.all_logits:
            return LogitsProcessorOutput(lm_head(hidden).float(), [None] * fb.batch_size)
        last = hidden[fb.last_token_indices()]
        out = LogitsProcessorOutput(lm_head(last).float())
        starts = fb.input_logprob_starts or [-1] * fb.batch_size
        offset = 0
        for i, start in enumerate(starts):
            extend_len, prefix_len = fb.extend_lens_cpu[i], fb.prefix_lens_cpu[i]
            if start < 0:
                out.input_logprobs.append(None)
            else:
                out.input_logprobs.append(
                    self._input_logprobs(
                        hidden[offset : offset + extend_len],
                        lm_head,
                        fb.input_ids[offset : offset + extend_len],
                        prefix_len,
                        start,
                        fb.top_logprobs_nums[i] if fb.top_logprobs_nums else 0,
                        fb.token_ids_logprobs[i] if fb.token_ids_logprobs else None,
                    )
                )
            offset += extend_len
        return out

    @staticmethod
    def _capped(lm_head: Callable[[torch.Tensor], torch.Tensor], cap: float) -> Callable[[torch.Tensor], torch.Tensor]:
        def capped(hidden: torch.Tensor) -> torch.Tensor:
            return torch.tanh(lm_head(hidden).float() / cap).mul_(cap)

        return capped

    @staticmethod
    def _input_logprobs(
        hidden: torch.Tensor,
        lm_head: Callable[[torch.Tensor], torch.Tensor],
        ids: torch.Tensor,
        prefix_len: int,
        start: int,
        top_k: int,
        token_ids: list[int] | None = None,
    ) -> InputLogprobs:
        """Prompt token j (absolute) is scored by the logits at position j - 1.

        `hidden`/`ids` cover absolute positions prefix_len .. prefix_len + len - 1;
        the scheduler guarantees start >= prefix_len (it never reuses a cached
        prefix past the logprob start).
        """
        first = max(start, prefix_len + 1)  # first token with a scoring position in this chunk
        end = prefix_len + ids.numel()
        token_logprobs: list[float | None] = [None] if start == 0 else []
        tops: list[list[tuple[float, int]]] = [[]] if start == 0 else []
        chosen: list[list[tuple[float, int]] | None] | None = None
        if token_ids is not None:
            chosen = [None] if start == 0 else []
        if first < end:
            logits = lm_head(hidden[first - 1 - prefix_len : end - 1 - prefix_len]).float()
            logprobs = torch.log_softmax(logits, dim=-1)
            targets = ids[first - prefix_len : end - prefix_len]
            token_logprobs += logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            tops += top_logprobs(logprobs, top_k)
            if chosen is not None:
                chosen += token_ids_logprobs(logprobs, token_ids)
        return InputLogprobs(token_logprobs, tops, chosen)
