"""Verification of draft tokens against the target model's logits of one forward.

Each request computes [its newest token, d_1 .. d_k] in one forward; the logits at row j
give the target's distribution for the token after d_j (row 0: after the newest token).
Row j samples exactly as a non-speculative decode step would for that output position:
the request's sampling params, with output_len + j (so a `sampling_seed` draws the same
noise). A draft d_{j+1} is accepted when that sample equals it: for greedy requests the
longest prefix equal to the target's argmax, for sampled ones the point-mass draft's
rejection sampling (accepted with probability p(d); on rejection the sample is from p
with d removed, renormalised), in distribution and, with a seed, token for token the
output without speculation. The first rejected row's sample (or, all accepted, the last
row's: the bonus token) ends the run.

With a draft model's distributions q (STANDALONE), sampled requests without a seed use
full rejection sampling instead: d accepted with probability min(1, p(d) / q(d)), else a
token from the residual max(p - q, 0) renormalised; outputs are distributed as p. Greedy
and seeded requests keep the exact match above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.layers.sampler import Sampler, SamplingBatchInfo, categorical, generator_uniforms, sampling_probs


@dataclass
class Verified:
    """One verify forward's outcome: `token_ids` [n] the output tokens of every request,
    request after request (its accepted drafts, then the bonus or correction token);
    `rows` [n] the logits row each was sampled from; `accept_lens` per request: drafts accepted."""

    token_ids: torch.Tensor
    rows: torch.Tensor
    accept_lens: list[int]


def expand_sampling_info(info: SamplingBatchInfo, counts: list[int]) -> SamplingBatchInfo:
    """`info` with request i's row repeated counts[i] times; its j-th copy samples output
    position output_len + j."""
    return SamplingBatchInfo(
        [p for p, c in zip(info.params, counts) for _ in range(c)],
        [n + j for n, c in zip(info.generated, counts) for j in range(c)],
        info.vocab_size,
        info.device,
    )


def verify_drafts(
    logits: torch.Tensor,
    info: SamplingBatchInfo,
    sampler: Sampler,
    draft_ids: list[list[int]],
    draft_probs: torch.Tensor | None = None,
) -> Verified:
    """`logits` [sum(1 + k_i), vocab] of a verify forward (no penalties, grammars or
    custom processors: those requests do not speculate); `draft_probs` rows align with
    them (zeros on each request's last row)."""
    counts = [1 + len(d) for d in draft_ids]
    expanded = expand_sampling_info(info, counts)
    sampled = sampler(logits, expanded)
    following = torch.tensor([t for d in draft_ids for t in d + [-1]], dtype=torch.int64, device=logits.device)
    accept = sampled == following
    chosen = sampled
    if draft_probs is not None:
        rejection = ~torch.tensor(expanded.is_greedy, device=logits.device) & ~expanded.has_seed & (following >= 0)
        if bool(rejection.any()):
            accept_rs, residual_rs = _rejection_sample(logits, expanded, sampler, following, draft_probs)
            accept = torch.where(rejection, accept_rs, accept)
            chosen = torch.where(rejection, residual_rs, sampled)
    accept_host, chosen_host = accept.tolist(), chosen.tolist()
    token_ids, rows, accept_lens = [], [], []
    start = 0
    for drafts in draft_ids:
        n = 0
        while n < len(drafts) and accept_host[start + n]:
            n += 1
        token_ids += drafts[:n] + [chosen_host[start + n]]
        rows += range(start, start + n + 1)
        accept_lens.append(n)
        start += len(drafts) + 1
    device = logits.device
    return Verified(torch.tensor(token_ids, device=device), torch.tensor(rows, device=device), accept_lens)


def _rejection_sample(
    logits: torch.Tensor,
    info: SamplingBatchInfo,
    sampler: Sampler,
    following: torch.Tensor,
    draft_probs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: whether its draft is accepted (u < p(d) / q(d)), and a token from the
    residual max(p - q, 0) renormalised (p itself where that is empty)."""
    p = sampling_probs(logits, info)
    d = following.clamp(min=0).unsqueeze(1)
    p_d, q_d = p.gather(1, d).squeeze(1), draft_probs.gather(1, d).squeeze(1)
    u = torch.rand(p_d.shape, generator=sampler.generator, device=p.device)
    accept = u * q_d < p_d
    residual = (p - draft_probs).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)
    return accept, categorical(residual, generator_uniforms(residual, sampler.generator))
