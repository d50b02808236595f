"""The scheduler's side of speculative decoding: verify batches and acceptance counts.

In place of a decode step of the running requests, `verify_batch` proposes each one's
drafts (NGRAM: from its own tokens; STANDALONE: by the draft model), allocates KV slots
for [newest token + drafts] and returns a verify batch (a DECODE batch with `draft_ids`,
run as one EXTEND forward that returns every position's logits). After its result, each
request keeps its accepted tokens and the slots of its rejected drafts are freed at once
(`ReqKVManager.release_rejected`).

A request whose verify step accepted fewer than MIN_PROFITABLE_ACCEPTED drafts waits 1,
3, 7, 15, then 31 decode steps (while its steps keep falling short) before it drafts
again: on text that does not repeat itself a verify forward, dearer than a decode step
on CPU, is rarely spent for nothing.

It returns None, and the step is a plain decode, when no request has a draft, when the
batch holds a request that does not speculate (penalties or min_new_tokens, a grammar, a
custom logit processor: their logits depend on each preceding token) or when the drafts'
slots do not fit in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.forward_batch import ForwardMode
from tandem.mem_cache.req_kv import ReqKVManager
from tandem.sampling.penalties import needs_penalties
from tandem.scheduler.schedule_batch import Req, ScheduleBatch
from tandem.server_args import ServerArgs
from tandem.speculative.args import resolve_speculative_args
from tandem.speculative.ngram import NgramProposer

# A verify step that accepts fewer drafts than this costs more than the decode steps it
# saves (on CPU a verify forward of 4 tokens costs ~2.4 decode steps of the default
# model: docs/perf-log/speculative.md); a request whose steps keep falling short drafts
# at most every 2**5 steps.
MIN_PROFITABLE_ACCEPTED = 2
MAX_BACKOFF_EXPONENT = 5


@dataclass
class SpecReqState:
    """A request's speculative counts (SGLang's meta_info fields) and its draft model's
    KV length (STANDALONE; valid for `draft_key`, its row and retraction count)."""

    verify_ct: int = 0
    draft_tokens: int = 0  # drafts proposed (spec_draft_token_num)
    accepted_tokens: int = 0  # drafts accepted (spec_accept_token_num)
    draft_kv_len: int = 0
    draft_key: tuple[int, int] | None = None
    # Back-off: verify steps in a row whose drafts were all rejected, and the decode
    # steps left before it drafts again.
    misses: int = 0
    cooldown: int = 0


def can_speculate(req: Req) -> bool:
    sp = req.sampling_params
    return (
        req.grammar is None
        and req.custom_logit_processor is None
        and not needs_penalties(sp)
        and req.pending_tokens == 0
        and sp.max_new_tokens > 0
    )


class SpeculativeDecoder:
    def __init__(self, server_args: ServerArgs, target_runner=None):
        resolve_speculative_args(server_args)  # done at start-up already, unless built in-process
        self.algorithm = server_args.speculative_algorithm
        self.num_drafts = server_args.speculative_num_draft_tokens - 1
        self.draft_model = None
        if self.algorithm == "NGRAM":
            self.ngram = NgramProposer(
                server_args.speculative_ngram_min_match_window_size, server_args.speculative_ngram_max_match_window_size
            )
        else:
            from tandem.speculative.draft_model import DraftModel

            self.draft_model = DraftModel(server_args, target_runner)
        # Server totals for /metrics: request decode steps, drafts proposed and accepted.
        self.verify_steps = self.proposed = self.accepted = 0

    def verify_batch(self, running: list[Req], kv: ReqKVManager) -> ScheduleBatch | None:
        """A verify batch of `running`, or None (then a plain decode step runs)."""
        if not all(can_speculate(r) for r in running):
            return None
        # A request's drafts and bonus token stay within its max_new_tokens.
        limits = [
            0 if r.spec.cooldown else min(self.num_drafts, r.sampling_params.max_new_tokens - len(r.output_ids) - 1)
            for r in running
        ]
        if self.draft_model is None:
            drafts = [self.ngram.propose(r.seq_ids, n) for r, n in zip(running, limits)]
        else:
            drafts = [[0] * max(n, 0) for n in limits]  # the draft model fills them in below
        if not any(drafts):
            return None
        slots = kv.try_alloc_extend(running, [1 + len(d) for d in drafts])
        if slots is None:
            return None
        probs = None
        if self.draft_model is not None:
            drafts, probs = self.draft_model.propose(running, [len(d) for d in drafts])
        return ScheduleBatch(
            reqs=list(running),
            forward_mode=ForwardMode.DECODE,
            out_cache_loc=slots,
            draft_ids=drafts,
            draft_probs=probs,
        )

    def record_step(self, req: Req, drafted: int, accepted: int) -> None:
        """One decode step of `req` (a verify step, or a plain decode: no drafts) is processed."""
        state = req.spec
        state.verify_ct += 1
        state.draft_tokens += drafted
        state.accepted_tokens += accepted
        if drafted == 0:
            state.cooldown = max(0, state.cooldown - 1)
        elif accepted < MIN_PROFITABLE_ACCEPTED:  # not worth its forward: wait 1, 3, ... 31 steps
            state.misses += 1
            state.cooldown = 2 ** min(state.misses, MAX_BACKOFF_EXPONENT) - 1
        else:
            state.misses = 0
        self.verify_steps += 1
        self.proposed += drafted
        self.accepted += accepted

    def totals(self) -> dict[str, int]:
        """The server's counts (ServerStateOutput's spec_* fields, /metrics)."""
        return {
            "spec_verify_steps": self.verify_steps,
            "spec_draft_tokens": self.proposed,
            "spec_accepted_tokens": self.accepted,
        }
