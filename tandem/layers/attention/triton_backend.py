"""Attention with Triton kernels (`triton_ops/`) over the paged KV pool: the CUDA default.

The kernels read K and V in place through `req_to_token` (no gather). Per batch,
`init_forward_metadata` prepares what every layer shares: the split-K scratch of decode,
the query offsets of extend. Decode runs under CUDA graphs: its metadata then lives in
static buffers that the graph runner refills before each replay. Sliding windows and logit
soft-caps are the kernels' compile-time constants (one variant per layer kind). On CPU the kernels run
under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests check them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.forward_batch import ForwardBatch
from tandem.layers.attention.base import AttentionBackend
from tandem.layers.attention.triton_ops.decode_attention import NUM_KV_SPLITS, decode_attention_fwd
from tandem.layers.attention.triton_ops.extend_attention import extend_attention_fwd
from tandem.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool


@dataclass
class DecodeMetadata:
    req_pool_indices: torch.Tensor  # [bs]
    seq_lens: torch.Tensor  # [bs]
    att_out: torch.Tensor  # [bs, H, NUM_KV_SPLITS, D] float32 split-K partial outputs
    att_lse: torch.Tensor  # [bs, H, NUM_KV_SPLITS] float32 their log-sum-exps


@dataclass
class ExtendMetadata:
    req_pool_indices: torch.Tensor  # [bs]
    seq_lens: torch.Tensor  # [bs] prefix + new tokens
    extend_lens: torch.Tensor  # [bs] new tokens
    qo_start: torch.Tensor  # [bs] offset of each request's first query in the token axis
    max_extend_len: int


class TritonAttnBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(
        self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool, num_heads: int, head_dim: int
    ):
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv_pool = token_to_kv_pool
        self.num_heads, self.head_dim = num_heads, head_dim
        self.forward_metadata: DecodeMetadata | ExtendMetadata | None = None
        self.cuda_graph_scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    def _scratch(self, bs: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        att_out = torch.empty((bs, self.num_heads, NUM_KV_SPLITS, self.head_dim), dtype=torch.float32, device=device)
        att_lse = torch.empty((bs, self.num_heads, NUM_KV_SPLITS), dtype=torch.float32, device=device)
        return att_out, att_lse

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        if fb.forward_mode.is_decode():
            self.forward_metadata = DecodeMetadata(
                fb.req_pool_indices, fb.seq_lens, *self._scratch(fb.batch_size, fb.seq_lens.device)
            )
            return
        extend_lens = torch.tensor(fb.extend_lens_cpu, dtype=torch.int64)
        qo_start = extend_lens.cumsum(0) - extend_lens
        device = fb.seq_lens.device
        self.forward_metadata = ExtendMetadata(
            fb.req_pool_indices, fb.seq_lens, extend_lens.to(device), qo_start.to(device), max(fb.extend_lens_cpu)
        )

    def forward_decode(
        self, q, layer_id, forward_batch, scaling, num_heads, num_kv_heads, head_dim, sliding_window=0, logit_cap=0.0
    ):
        md = self.forward_metadata
        q = q.view(-1, num_heads, head_dim)
        o = torch.empty_like(q)
        decode_attention_fwd(
            q,
            self.kv_pool.k_buffer[layer_id],
            self.kv_pool.v_buffer[layer_id],
            o,
            self.req_to_token,
            md.req_pool_indices,
            md.seq_lens,
            md.att_out,
            md.att_lse,
            scaling,
            sliding_window,
            logit_cap,
        )
        return o.view(-1, num_heads * head_dim)

    def forward_extend(
        self, q, layer_id, forward_batch, scaling, num_heads, num_kv_heads, head_dim, sliding_window=0, logit_cap=0.0
    ):
        md = self.forward_metadata
        q = q.view(-1, num_heads, head_dim)
        o = torch.empty_like(q)
        extend_attention_fwd(
            q,
            self.kv_pool.k_buffer[layer_id],
            self.kv_pool.v_buffer[layer_id],
            o,
            self.req_to_token,
            md.req_pool_indices,
            md.seq_lens,
            md.extend_lens,
            md.qo_start,
            md.max_extend_len,
            scaling,
            sliding_window,
            logit_cap,
        )
        return o.view(-1, num_heads * head_dim)

    def init_cuda_graph_state(self, max_bs: int) -> None:
        self.cuda_graph_scratch = self._scratch(max_bs, self.req_to_token.device)

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens):
        att_out, att_lse = self.cuda_graph_scratch
        self.forward_metadata = DecodeMetadata(req_pool_indices, seq_lens, att_out[:bs], att_lse[:bs])

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens):
        # The graph reads the static buffers the runner has just refilled: only the
        # Python-side metadata (for an eager forward that may follow) is restored here.
        self.init_forward_metadata_capture_cuda_graph(bs, req_pool_indices, seq_lens)
