"""`VocabMask`: one batch's allowed tokens, a bitmask row per request, handed from the
scheduler to the worker inside the `ModelWorkerBatch`.

Delayed sampling (SGLang's, for the overlap loop): batch N+1 is launched before batch
N's result is processed, so its grammars have not yet seen the tokens N samples. The
scheduler fills the mask once it has processed N, while N+1's forward computes; the
worker's sampling step waits for `set_ready` and then applies it. Without a result
pending the mask is filled before the forward is launched.
"""

from __future__ import annotations

import threading

import torch
import xgrammar


class VocabMask:
    def __init__(self, batch_size: int, vocab_size: int):
        self.bitmask = xgrammar.allocate_token_bitmask(batch_size, vocab_size)  # every token allowed
        # Rows that carry a grammar (the others stay all-allowed); set with the fill.
        self.rows: list[int] = []
        self._ready = threading.Event()

    def set_ready(self) -> None:
        self._ready.set()

    def is_ready(self) -> bool:
        return self._ready.is_set()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` [bs, vocab] with the disallowed tokens at -inf (waits for the
        fill). The caller's logits, from which logprobs are taken, are left as they are."""
        self._ready.wait()
        if not self.rows:
            return logits
        masked = logits.clone()
        xgrammar.apply_token_bitmask_inplace(
            masked, self.bitmask.to(logits.device, non_blocking=True), indices=self.rows
        )
        return masked


def batch_vocab_mask(backend, reqs: list, fill: bool) -> VocabMask | None:
    """The vocab mask of a batch of `reqs` (Req) when any is constrained, else None;
    filled now if `fill`, else later by `fill_when_due` (delayed sampling)."""
    if all(r.grammar is None for r in reqs):
        return None
    mask = VocabMask(len(reqs), backend.vocab_size)
    if fill:
        backend.fill_vocab_mask(mask, [r.grammar for r in reqs])
    return mask


def fill_when_due(backend, mask: VocabMask | None, reqs: list) -> None:
    """Fill a mask left unfilled at launch, once: every result before its batch must have
    been processed (the grammars have seen every token). A request that finished meanwhile
    allows every token: its token is dropped."""
    if mask is not None and not mask.is_ready():
        backend.fill_vocab_mask(mask, [None if r.finished() else r.grammar for r in reqs])
