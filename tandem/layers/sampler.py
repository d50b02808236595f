"""Turns logits into next tokens: greedy, or temperature / top-k / top-p / min-p sampling.

Sampling uses the exponential-race form of categorical sampling (argmax of p / E with
E ~ Exp(1)), which lets each request draw its noise from its own generator. A request
with `sampling_seed` gets a generator seeded from (seed, number of tokens generated so
far), so its tokens do not depend on what else shares the batch. Penalties
(`tandem.sampling.penalties`) adjust a copy of the logits first; the caller's logits
(from which logprobs are reported) are never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.sampling.penalties import PenaltyBatch
from tandem.sampling.sampling_params import SamplingParams


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [bs, 1]
    top_ps: torch.Tensor  # [bs]
    top_ks: torch.Tensor  # [bs] (vocab size where disabled)
    min_ps: torch.Tensor  # [bs]
    is_greedy: list[bool]
    seeds: list[int | None]
    output_lens: list[int]  # tokens generated so far, mixed into seeded generators
    penalties: PenaltyBatch | None = None

    @classmethod
    def from_params(cls, params: list[SamplingParams], output_lens: list[int], vocab_size: int,
                    device: str, penalties: PenaltyBatch | None = None) -> "SamplingBatchInfo":
        return cls(
            temperatures=torch.tensor([[max(p.temperature, 1e-6)] for p in params], dtype=torch.float32, device=device),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], dtype=torch.int64, device=device),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            is_greedy=[p.is_greedy for p in params],
            seeds=[p.sampling_seed for p in params],
            output_lens=list(output_lens),
            penalties=penalties,
        )

    @property
    def all_greedy(self) -> bool:
        return all(self.is_greedy)


class Sampler:
    def __init__(self, seed: int, device: str):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """logits [bs, vocab] float32 -> next token ids [bs] int64."""
        if info.penalties is not None:
            logits = info.penalties.apply(logits)
        greedy_ids = torch.argmax(logits, dim=-1)
        if info.all_greedy:
            return greedy_ids
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        probs = _filter_probs(probs, info.top_ks, info.top_ps, info.min_ps)
        noise = torch.empty_like(probs)
        for i, seed in enumerate(info.seeds):
            if info.is_greedy[i]:
                noise[i].fill_(1.0)
            elif seed is None:
                noise[i].exponential_(generator=self.generator)
            else:
                g = torch.Generator(device=probs.device)
                g.manual_seed((seed * 1_000_003 + info.output_lens[i]) % (2**63))
                noise[i].exponential_(generator=g)
        sampled = torch.argmax(probs / noise, dim=-1)
        is_greedy = torch.tensor(info.is_greedy, device=logits.device)
        return torch.where(is_greedy, greedy_ids, sampled)


def _filter_probs(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                  min_ps: torch.Tensor) -> torch.Tensor:
    """Zero out tokens outside top-k, outside the top-p nucleus, or below min_p * max."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    drop = ranks >= top_ks.unsqueeze(1)
    # Keep a token if the mass strictly before it is below top_p (the first is always kept).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before > top_ps.unsqueeze(1)
    drop |= sorted_probs < (sorted_probs[:, :1] * min_ps.unsqueeze(1))
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
