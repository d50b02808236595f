"""`ForwardBatch`: the tensors one model forward needs, built from a scheduled batch.

Lengths follow one vocabulary across the code base:
  prefix_len  tokens of a request whose KV is already in the pool before this forward
  extend_len  tokens this forward computes for the request (1 in decode)
  seq_len     prefix_len + extend_len: the request's KV length after this forward
Token-level tensors (`input_ids`, `positions`, `out_cache_loc`) are flattened over the
batch, request after request, with no padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

import torch


class ForwardMode(Enum):
    EXTEND = auto()  # prefill: several new tokens per request on top of a cached prefix
    DECODE = auto()  # one new token per request

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    out_cache_loc: torch.Tensor  # [num_tokens] KV slot of each new token
    req_pool_indices: torch.Tensor  # [bs] rows of the ReqToTokenPool
    seq_lens: torch.Tensor  # [bs]
    # Host copies, so attention can slice without device syncs.
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    # Per request, EXTEND only: absolute position from which prompt logprobs are
    # returned (-1: none), how many top logprobs to return per position, and which
    # token ids' logprobs to return per position (None: none).
    input_logprob_starts: list[int] | None = None
    top_logprobs_nums: list[int] | None = None
    token_ids_logprobs: list[list[int] | None] | None = None
    # Mixed batches (--enable-mixed-chunk), EXTEND only: requests 0..num_prefill-1 prefill,
    # the rest are running requests decoding one token each (extend_len 1). None: not mixed.
    num_prefill: int | None = None
    # Per request, the load id of its LoRA adapter (None: the base model); None: no request uses one.
    lora_uids: list[int | None] | None = None
    # Speculative verification (tandem/speculative), EXTEND only: logits for every new
    # token, not only each request's last.
    all_logits: bool = False
    # Whether input_ids may hold FutureMap placeholders (tokens an earlier forward samples);
    # False: every id is a token, nothing to resolve.
    placeholders: bool = True

    @classmethod
    def for_rows(
        cls,
        mode: ForwardMode,
        input_ids: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        slots: list[list[int]],
        device: str = "cpu",
    ) -> ForwardBatch:
        """A batch of requests in ReqToTokenPool rows 0..bs-1, where `slots[i][pos]` is
        the KV slot of request i's token `pos` (already written to its row): for tests and
        benchmarks that drive a ModelRunner without a scheduler."""
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        return cls(
            forward_mode=mode,
            batch_size=len(seq_lens),
            input_ids=torch.tensor(input_ids, device=device),
            positions=torch.tensor(
                [p for pre, n in zip(prefix_lens, extend_lens) for p in range(pre, pre + n)], device=device
            ),
            out_cache_loc=torch.tensor(
                [s for pre, n, row in zip(prefix_lens, extend_lens, slots) for s in row[pre : pre + n]], device=device
            ),
            req_pool_indices=torch.arange(len(seq_lens), device=device),
            seq_lens=torch.tensor(seq_lens, device=device),
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=extend_lens,
        )

    def is_mixed(self) -> bool:
        return self.num_prefill is not None

    def mixed_parts(self) -> tuple[ForwardBatch, ForwardBatch]:
        """A mixed batch as its prefill part (EXTEND) and its decode part (DECODE)."""
        assert self.is_mixed()
        split = self.num_prefill
        return (
            self.sub_batch(0, split, ForwardMode.EXTEND),
            self.sub_batch(split, self.batch_size, ForwardMode.DECODE),
        )

    def sub_batch(self, start: int, end: int, mode: ForwardMode) -> ForwardBatch:
        """Requests start..end-1 as a batch of their own in `mode` (token tensors are views)."""
        lo = sum(self.extend_lens_cpu[:start])
        hi = lo + sum(self.extend_lens_cpu[start:end])
        extend = mode.is_extend()

        def pick(values: list | None) -> list | None:
            return values[start:end] if extend and values is not None else None

        return ForwardBatch(
            forward_mode=mode,
            batch_size=end - start,
            input_ids=self.input_ids[lo:hi],
            positions=self.positions[lo:hi],
            out_cache_loc=self.out_cache_loc[lo:hi],
            req_pool_indices=self.req_pool_indices[start:end],
            seq_lens=self.seq_lens[start:end],
            seq_lens_cpu=self.seq_lens_cpu[start:end],
            prefix_lens_cpu=self.prefix_lens_cpu[start:end],
            extend_lens_cpu=self.extend_lens_cpu[start:end],
            input_logprob_starts=pick(self.input_logprob_starts),
            top_logprobs_nums=pick(self.top_logprobs_nums),
            token_ids_logprobs=pick(self.token_ids_logprobs),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def last_token_indices(self) -> torch.Tensor:
        """Index in the flattened token axis of each request's last new token."""
        ends = torch.tensor(self.extend_lens_cpu, dtype=torch.int64).cumsum(0) - 1
        return ends.to(self.input_ids.device)
