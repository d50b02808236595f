"""`CudaGraphRunner`: decode forwards replayed from CUDA graphs (SGLang's runner, smaller).

A decode step of a small batch is bound by kernel launches, not by the GPU: the model's
few hundred kernels cost more to launch from Python than to run. So the decode forward
is captured once per batch-size bucket (1, 2, 4, 8, then every 8 up to
`--cuda-graph-max-bs`, or `--cuda-graph-bs`) over static input buffers, and each step
copies its inputs into those buffers and replays the graph of the smallest bucket that
holds the batch. Padding rows read one key of request row 0 and write their K and V to
the padding slot 0; their logits are dropped. The graphs share one memory pool and are
captured largest first; each copies its logits into one static [max_bs, vocab] buffer,
so that no graph keeps its own output alive in the pool. The attention backend keeps its per-batch metadata in static
buffers (`AttentionBackend.init_cuda_graph_state` and the capture/replay hooks).

Only decode batches without logprob work run as graphs (the logits processor's decode
path is shape-static); extend and larger batches run eagerly. A weight update swaps in
new parameter tensors, so the runner captures again afterwards (`capture`).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch

from tandem.forward_batch import ForwardBatch, ForwardMode
from tandem.layers.attention.base import AttentionBackend
from tandem.layers.logits_processor import LogitsProcessorOutput

logger = logging.getLogger(__name__)

# Largest default bucket, as SGLang's default --cuda-graph-max-bs on large GPUs.
DEFAULT_MAX_BS = 256


def capture_batch_sizes(max_bs: int, explicit: list[int] | None = None) -> list[int]:
    """The buckets: `explicit` (capped at max_bs), else 1, 2, 4, 8, 16, 24, ... up to max_bs
    (max_bs itself included), ascending and unique. As in SGLang, explicit sizes above
    max_bs give way to max_bs itself, so the list is never empty and the largest batch
    that can run has a graph (`--cuda-graph-bs 32 64` with `--max-running-requests 4`: [4])."""
    if explicit:
        sizes = [bs for bs in explicit if bs <= max_bs]
        if max(explicit) > max_bs:
            sizes.append(max_bs)
    else:
        sizes = [bs for bs in (1, 2, 4) if bs < max_bs] + list(range(8, max_bs, 8)) + [max_bs]
    return sorted(set(sizes))


class CudaGraphRunner:
    """Captures `forward(fb)` (the model's decode forward, no metadata set-up) per bucket.

    `forward` is called with a ForwardBatch over the static buffers after the attention
    backend's capture hook has run; it must launch only device work (no host syncs)."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch], LogitsProcessorOutput],
        attn_backend: AttentionBackend,
        batch_sizes: list[int],
        vocab_size: int,
        device: str,
    ):
        if not batch_sizes:
            raise ValueError("CUDA graphs: no batch sizes to capture (--cuda-graph-bs)")
        self.forward_fn = forward
        self.attn_backend = attn_backend
        self.batch_sizes = batch_sizes
        self.max_bs = batch_sizes[-1]
        self.device = device
        attn_backend.init_cuda_graph_state(self.max_bs)
        int64 = {"dtype": torch.int64, "device": device}
        self.input_ids = torch.zeros(self.max_bs, **int64)
        self.positions = torch.zeros(self.max_bs, **int64)
        self.out_cache_loc = torch.zeros(self.max_bs, **int64)  # padding rows write slot 0
        self.req_pool_indices = torch.zeros(self.max_bs, **int64)
        self.seq_lens = torch.full((self.max_bs,), attn_backend.get_cuda_graph_seq_len_fill_value(), **int64)
        self.logits = torch.zeros((self.max_bs, vocab_size), dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # anything with replay(): tests replay eagerly
        self.capture()

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.forward_mode.is_decode() and fb.batch_size <= self.max_bs

    def _static_batch(self, bs: int) -> ForwardBatch:
        fill = self.attn_backend.get_cuda_graph_seq_len_fill_value()
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=[fill] * bs,
            prefix_lens_cpu=[fill - 1] * bs,
            extend_lens_cpu=[1] * bs,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """(Re)capture every bucket, largest first, in one shared memory pool."""
        self.graphs.clear()
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # the static buffers are written there
        for bs in reversed(self.batch_sizes):
            body = self.graph_body(bs)
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: lazy kernel compilation and allocations happen outside the graph
                    body()
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                body()
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.batch_sizes)

    def graph_body(self, bs: int) -> Callable[[], None]:
        """What the graph of bucket `bs` runs: the model's decode forward over the static
        buffers, its logits copied into the static output (the backend's capture hook has
        run when this returns)."""
        fb = self._static_batch(bs)
        self.attn_backend.init_forward_metadata_capture_cuda_graph(bs, fb.req_pool_indices, fb.seq_lens)

        def body() -> None:
            self.logits[:bs].copy_(self.forward_fn(fb).next_token_logits)

        return body

    def replay(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        """The decode logits of `fb` (batch_size <= max_bs) from the smallest bucket: a view
        of the static buffer, valid until the next replay (sample from it first, as the
        worker does)."""
        bs = fb.batch_size
        padded = self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]
        if padded > bs:  # padding rows: row 0, one key, slot 0
            self.req_pool_indices[bs:padded].zero_()
            self.seq_lens[bs:padded].fill_(self.attn_backend.get_cuda_graph_seq_len_fill_value())
            self.out_cache_loc[bs:padded].zero_()
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices)
        self.seq_lens[:bs].copy_(fb.seq_lens)
        self.attn_backend.init_forward_metadata_replay_cuda_graph(
            padded, self.req_pool_indices[:padded], self.seq_lens[:padded]
        )
        self.graphs[padded].replay()
        return LogitsProcessorOutput(self.logits[:bs], [None] * bs)
