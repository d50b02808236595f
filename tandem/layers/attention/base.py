"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tandem.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Computes attention for one layer over the KV pool.

    Contract: the caller has already written this forward's K and V into the pool at
    `forward_batch.out_cache_loc`; the backend reads each request's KV through its
    ReqToTokenPool row (`seq_lens[i]` slots) and returns [num_tokens, num_heads * head_dim].
    """

    @abstractmethod
    def forward(self, q: torch.Tensor, layer_id: int, forward_batch: ForwardBatch,
                scaling: float, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        ...
