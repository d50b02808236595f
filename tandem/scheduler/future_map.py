"""`FutureMap`: the token buffer through which a forward hands its sampled ids to the next.

SGLang's future map: the scheduler forms batch N+1 while batch N still computes, so it
cannot know the ids batch N samples. Each request owns one slot, its ReqToTokenPool row;
after sampling, the worker writes each request's id into its slot, and the scheduler
refers to a token it does not have yet by the placeholder `-(row + 1)`. The worker
resolves placeholders (in input ids and penalty token lists) just before it uses them,
on the compute side, so no host ever waits for them.

Correct because forwards run one after another in launch order (one forward thread on
CPU, one stream on CUDA): a slot is read only by a forward launched after the one that
writes it, and a row handed to a new request is written by its prefill before any
decode of it reads the slot.
"""

from __future__ import annotations

import torch


class FutureMap:
    def __init__(self, num_rows: int, device: str):
        self.token_ids = torch.zeros(num_rows, dtype=torch.int64, device=device)

    @staticmethod
    def placeholder(row: int) -> int:
        """The id standing for the token that the pending forward of `row` samples."""
        return -(row + 1)

    def resolve(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` with every placeholder replaced by the token its slot holds."""
        if ids.numel() == 0:
            return ids
        slots = (-ids - 1).clamp(min=0)
        return torch.where(ids < 0, self.token_ids[slots], ids)

    def store(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Record the ids just sampled for the requests in `rows`."""
        self.token_ids.index_copy_(0, rows, token_ids)
