"""Turns logits into next tokens: greedy, or temperature / top-k / top-p / min-p sampling.

Every row is sampled at once, with no loop over rows: each row's token is where one uniform
falls in its cumulative distribution (`categorical`). A request without a seed takes its
uniform from the sampler's generator; a request with `sampling_seed` from a counter-based
hash of (seed, number of tokens generated so far) computed as tensor operations, so its
tokens do not depend on what else shares the batch, nor on the device. Top-k and top-p sort a row's
largest probabilities only (`TOP_CANDIDATES`) where those settle them. Penalties
(`tandem.sampling.penalties`) adjust a copy of the logits first, then the requests'
custom logit processors (`tandem.sampling.custom_logit_processor`) change their rows of
it; the caller's logits (from which logprobs are reported) are never modified.
"""

from __future__ import annotations

import copy
import functools

import torch

from tandem.kernels import cpu as cpu_kernels
from tandem.sampling.custom_logit_processor import CustomLogitBatch
from tandem.sampling.penalties import PenaltyBatch
from tandem.sampling.sampling_params import SamplingParams


class SamplingBatchInfo:
    """A batch's sampling parameters: per request its SamplingParams and the tokens it has
    generated so far. The tensors the sampler reads are made on first use: an all-greedy
    batch reads none (seven small tensors a decode step that its Python, run with caches
    cold after the forward's weight stream, paid ~90 us for at batch 1)."""

    def __init__(
        self,
        params: list[SamplingParams],
        output_lens: list[int],
        vocab_size: int,
        device: str,
        penalties: PenaltyBatch | None = None,
    ):
        self.params, self.generated, self.vocab_size, self.device = params, list(output_lens), vocab_size, device
        self.is_greedy = [p.is_greedy for p in params]
        self.penalties = penalties
        # The rows with a custom logit processor (--enable-custom-logit-processor); None: none.
        self.custom: CustomLogitBatch | None = None

    def with_penalties(self, penalties: PenaltyBatch | None) -> SamplingBatchInfo:
        """This batch (its tensors made so far too) with other penalties."""
        out = copy.copy(self)
        out.penalties = penalties
        return out

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    @functools.cached_property
    def temperatures(self) -> torch.Tensor:  # [bs, 1]
        return self._tensor([[max(p.temperature, 1e-6)] for p in self.params], torch.float32).view(-1, 1)

    @functools.cached_property
    def top_ps(self) -> torch.Tensor:  # [bs]
        return self._tensor([p.top_p for p in self.params], torch.float32)

    @functools.cached_property
    def top_ks(self) -> torch.Tensor:  # [bs] (vocab size where disabled)
        return self._tensor([p.top_k if p.top_k > 0 else self.vocab_size for p in self.params], torch.int64)

    @functools.cached_property
    def min_ps(self) -> torch.Tensor:  # [bs]
        return self._tensor([p.min_p for p in self.params], torch.float32)

    @functools.cached_property
    def seeds(self) -> torch.Tensor:  # [bs, 2] int64: low and high 32 bits of each sampling_seed (0 without one)
        seeds = [p.sampling_seed or 0 for p in self.params]
        return self._tensor([[s & _MASK32, (s >> 32) & _MASK32] for s in seeds], torch.int64).view(-1, 2)

    @functools.cached_property
    def has_seed(self) -> torch.Tensor:  # [bs] bool
        return self._tensor([p.sampling_seed is not None for p in self.params], torch.bool)

    @functools.cached_property
    def output_lens(self) -> torch.Tensor:  # [bs] int64 tokens generated so far, mixed into seeded uniforms
        return self._tensor(self.generated, torch.int64)

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
        seeded = bool(info.has_seed.any())
        u = None if seeded and bool(info.has_seed.all()) else generator_uniforms(probs, self.generator)
        if seeded:
            hashed = seeded_uniforms(info.seeds, info.output_lens)
            u = hashed if u is None else torch.where(info.has_seed.unsqueeze(1), hashed, u)
        sampled = categorical(probs, u)
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


def generator_uniforms(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One uniform in [0, 1) a row of `probs` ([rows, 1]), from `generator`."""
    return torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=probs.dtype)


def categorical(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token id per row of `probs` (non-negative, each row's sum > 0): where the row's
    uniform u ([rows, 1], in [0, 1)) falls in its cumulative distribution. (An exponential
    race, argmax of p / E, needs a draw per token: at a 49K vocabulary the noise took
    longer than the forward of a 135M model.)"""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Below the row's total (u * total can round up to it), so that the first cumulative sum
    # above it belongs to a token of positive probability.
    point = torch.minimum(u.to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)


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


def seeded_uniforms(seeds: torch.Tensor, output_lens: torch.Tensor) -> torch.Tensor:
    """A uniform [bs, 1] strictly inside (0, 1) that is a pure function of (seed,
    output_len): a counter-based hash of the two, its top 23 bits."""
    key = _mix32(seeds[:, 0] ^ _mix32(seeds[:, 1] ^ _mix32(output_lens & _MASK32)))
    return bits_to_uniform(_mix32(key ^ _GOLDEN32)).unsqueeze(1)


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """32 hashed bits -> a float32 uniform strictly inside (0, 1): the top 23 bits k give
    (k + 0.5) * 2**-23, exact in float32 (24 significant bits), from 2**-24 to 1 - 2**-24."""
    return ((bits >> 9).float() + 0.5) * 2.0**-23


# Top-k / top-p look at a row's largest probabilities, this many first, then more (at least
# its top_k), sorting the whole vocabulary only where those leave the decision open (a top-p
# row whose candidates hold no more than top_p of its mass): a 49K vocabulary's sort took
# 4.2 ms a row on 2 Zen 3 cores, its 256 largest 0.14 ms, its 4096 largest 0.8 ms.
TOP_CANDIDATES = (256, 4096)


def _filter_probs(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor
) -> torch.Tensor:
    """Zero out tokens outside top-k, outside the top-p nucleus, or below min_p * max. A row
    with top_k >= vocab, top_p >= 1 and min_p <= 0 is left as it is."""
    vocab = probs.shape[-1]
    ranked = (top_ks < vocab) | (top_ps < 1)  # rows whose kept tokens depend on their rank
    if bool(ranked.any()):
        probs = torch.where(ranked.unsqueeze(1), _filter_ranked(probs, top_ks, top_ps, ranked), probs)
    if bool((min_ps > 0).any()):  # the largest probability is never dropped above: the same max
        probs = probs.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_ps.unsqueeze(1), 0.0)
    return probs


def _filter_ranked(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, ranked: torch.Tensor
) -> torch.Tensor:
    """Top-k and top-p of the `ranked` rows (the others' values are not meaningful)."""
    vocab = probs.shape[-1]
    limited = top_ks < vocab
    at_least = int(top_ks[limited].max()) if bool(limited.any()) else 0
    for count in TOP_CANDIDATES:
        k = min(vocab, max(count, at_least))
        top, order = probs.topk(k, dim=-1)  # descending
        mass = top.cumsum(dim=-1)
        # Every token past the candidates is dropped when top-k drops it, or when the
        # candidates already hold more than top_p (its mass before it exceeds top_p).
        if k == vocab or bool((limited | (mass[:, -1] > top_ps))[ranked].all()):
            break
    else:
        top, order = probs.sort(dim=-1, descending=True)
        mass = top.cumsum(dim=-1)
    ranks = torch.arange(top.shape[-1], device=probs.device).unsqueeze(0)
    drop = ranks >= top_ks.unsqueeze(1)
    # Keep a token if the mass strictly before it is within top_p (the first is always kept).
    mass_before = mass - top
    drop |= (mass_before > top_ps.unsqueeze(1)) & (top_ps < 1).unsqueeze(1)
    return torch.zeros_like(probs).scatter_(-1, order, top.masked_fill(drop, 0.0))
