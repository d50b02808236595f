"""The interface every attention backend implements (SGLang's `AttentionBackend`)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tandem.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Computes attention for every layer over the KV pool.

    Per batch: `init_forward_metadata(forward_batch)` runs once before the model's forward
    and keeps what every layer shares (KV tables, offsets, split sizes) on the backend.
    Per layer: `forward` dispatches to `forward_extend` or `forward_decode`. Contract: the
    caller has already written this forward's K and V into the pool at
    `forward_batch.out_cache_loc`; the backend reads each request's KV through its
    ReqToTokenPool row (`seq_lens[i]` slots) and returns [num_tokens, num_heads * head_dim].

    CUDA graphs (decode only): a backend whose `supports_cuda_graph` is True keeps its
    metadata in static buffers sized by `init_cuda_graph_state(max_bs)`; the graph runner
    calls `init_forward_metadata_capture_cuda_graph` before capturing a batch size and
    `init_forward_metadata_replay_cuda_graph` before each replay, which must only write
    into those buffers (no new tensors, no host syncs).
    """

    supports_cuda_graph: bool = False

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Compute the per-batch state every layer of this forward shares."""

    def forward(
        self,
        q: torch.Tensor,
        layer_id: int,
        forward_batch: ForwardBatch,
        scaling: float,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int = 0,
        logit_cap: float = 0.0,
    ) -> torch.Tensor:
        """`sliding_window` > 0: the query at position p attends to the keys at positions
        (p - sliding_window, p] only (transformers' sliding window: Mistral, Gemma 2/3's
        sliding layers); the keys before stay in the pool, masked. `logit_cap` > 0: the
        scaled scores are soft-capped, `logit_cap * tanh(scores / logit_cap)`, before the
        softmax (Gemma 2's `attn_logit_softcapping`)."""
        args = (q, layer_id, forward_batch, scaling, num_heads, num_kv_heads, head_dim)
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(*args, sliding_window=sliding_window, logit_cap=logit_cap)
        return self.forward_extend(*args, sliding_window=sliding_window, logit_cap=logit_cap)

    def cpu_decode_tables(self, forward_batch: ForwardBatch) -> tuple[torch.Tensor, ...] | None:
        """(req_to_token, req_pool_indices, seq_lens) when this forward is a plain decode that
        Tandem's C++ CPU decode kernel runs (a model may then run whole layers in C++:
        `tandem_cpu.decode_layer`), else None."""
        return None

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        layer_id: int,
        forward_batch: ForwardBatch,
        scaling: float,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int = 0,
        logit_cap: float = 0.0,
    ) -> torch.Tensor:
        """One query token per request, over its `seq_lens[i]` keys."""

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        layer_id: int,
        forward_batch: ForwardBatch,
        scaling: float,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int = 0,
        logit_cap: float = 0.0,
    ) -> torch.Tensor:
        """`extend_lens[i]` query tokens per request: the cached prefix plus the causal new part."""

    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate the static metadata buffers of graphs up to `max_bs` requests."""
        raise NotImplementedError(f"{type(self).__name__} does not run under CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        """Point the metadata at the static buffers of batch size `bs` (before capture)."""
        raise NotImplementedError(f"{type(self).__name__} does not run under CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        """Refresh the static buffers of batch size `bs` (padded) for one replay."""
        raise NotImplementedError(f"{type(self).__name__} does not run under CUDA graphs")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """The seq_len given to the padding rows of a graph's batch."""
        return 1
