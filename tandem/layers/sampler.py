"""Turns logits into next tokens: greedy, or temperature / top-k / top-p / min-p sampling.

Sampling uses the exponential-race form of categorical sampling (argmax of p / E with
E ~ Exp(1)), computed for the whole batch at once, with no loop over rows. The noise of
requests without a seed comes from the sampler's generator. A request with
`sampling_seed` takes its noise from a counter-based hash of (seed, number of tokens
generated so far, token id) computed as tensor operations, so its tokens do not depend
on what else shares the batch, nor on the device. Penalties
(`tandem.sampling.penalties`) adjust a copy of the logits first, then the requests'
custom logit processors (`tandem.sampling.custom_logit_processor`) change their rows of
it; the caller's logits (from which logprobs are reported) are never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels import cpu as cpu_kernels
from tandem.sampling.custom_logit_processor import CustomLogitBatch
from tandem.sampling.penalties import PenaltyBatch
from tandem.sampling.sampling_params import SamplingParams


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [bs, 1]
    top_ps: torch.Tensor  # [bs]
    top_ks: torch.Tensor  # [bs] (vocab size where disabled)
    min_ps: torch.Tensor  # [bs]
    is_greedy: list[bool]
    seeds: torch.Tensor  # [bs, 2] int64: low and high 32 bits of each sampling_seed (0 without one)
    has_seed: torch.Tensor  # [bs] bool
    output_lens: torch.Tensor  # [bs] int64 tokens generated so far, mixed into seeded noise
    penalties: PenaltyBatch | None = None
    # The rows with a custom logit processor (--enable-custom-logit-processor); None: none.
    custom: CustomLogitBatch | None = None

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        output_lens: list[int],
        vocab_size: int,
        device: str,
        penalties: PenaltyBatch | None = None,
    ) -> SamplingBatchInfo:
        return cls(
            temperatures=torch.tensor([[max(p.temperature, 1e-6)] for p in params], dtype=torch.float32, device=device),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor(
                [p.top_k if p.top_k > 0 else vocab_size for p in params], dtype=torch.int64, device=device
            ),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            is_greedy=[p.is_greedy for p in params],
            seeds=torch.tensor(
                [[(p.sampling_seed or 0) & _MASK32, ((p.sampling_seed or 0) >> 32) & _MASK32] for p in params],
                dtype=torch.int64,
                device=device,
            ).view(-1, 2),
            has_seed=torch.tensor([p.sampling_seed is not None for p in params], dtype=torch.bool, device=device),
            output_lens=torch.tensor(output_lens, dtype=torch.int64, device=device),
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
        if info.custom is not None:
            logits = info.custom.apply(logits)
        greedy_ids = greedy(logits)
        if info.all_greedy:
            return greedy_ids
        probs = sampling_probs(logits, info)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        noise = torch.where(
            info.has_seed.unsqueeze(1), seeded_exponential(info.seeds, info.output_lens, probs.shape[-1]), noise
        )
        sampled = torch.argmax(probs / noise, dim=-1)
        is_greedy = torch.tensor(info.is_greedy, device=logits.device)
        return torch.where(is_greedy, greedy_ids, sampled)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima; the first NaN): Tandem's CPU kernel for
    float32 rows on CPU (one row of a 49K vocabulary: ~17 us with the op call, against 53-75 us
    of torch.argmax on 2 Zen 3 cores), else torch.argmax; the same ids."""
    if logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[-1] > 0 and logits.stride(-1) == 1:
        ops = cpu_kernels.ops_for(logits)
        if ops is not None:
            return ops.argmax_rows(logits)
    return torch.argmax(logits, dim=-1)


def sampling_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """The distribution each row samples from: softmax at its temperature, then top-k,
    top-p and min-p (speculative rejection sampling compares these)."""
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    return _filter_probs(probs, info.top_ks, info.top_ps, info.min_ps)


_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 32-bit values in int64, without overflowing int64."""
    low = (x & 0xFFFF) * c
    high = ((x >> 16) * c) & 0xFFFF
    return (low + (high << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def seeded_bits(seeds: torch.Tensor, output_lens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """32 hashed bits [bs, vocab] (int64) per (seed, output_len, token id)."""
    key = _mix32(seeds[:, 0] ^ _mix32(seeds[:, 1] ^ _mix32(output_lens & _MASK32)))
    counter = _mul32(torch.arange(vocab_size, device=seeds.device), _GOLDEN32)
    return _mix32(_mix32((key.unsqueeze(1) + counter) & _MASK32) ^ key.unsqueeze(1))


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """32 hashed bits -> a float32 uniform strictly inside (0, 1): the top 23 bits k give
    (k + 0.5) * 2**-23, exact in float32 (24 significant bits), from 2**-24 to 1 - 2**-24.
    (With 24 bits, (2**24 - 1 + 0.5) * 2**-24 rounds to 1.0 in float32: noise -log(1) = 0
    let a token with p > 0 win outright (p / 0 = inf) and a filtered one become NaN
    (0 / 0), which argmax picks.)"""
    return ((bits >> 9).float() + 0.5) * 2.0**-23


def seeded_exponential(seeds: torch.Tensor, output_lens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [bs, vocab] that is a pure function of (seed, output_len, token id):
    a counter-based hash turned into a uniform in (0, 1) with 23 bits, then -log; every
    value is finite and > 0."""
    return -torch.log(bits_to_uniform(seeded_bits(seeds, output_lens, vocab_size)))


def _filter_probs(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor
) -> torch.Tensor:
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
