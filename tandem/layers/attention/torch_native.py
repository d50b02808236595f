"""Attention in plain PyTorch over the paged KV pool: runs on any device.

Requests are ragged and never padded to the longest one in the batch:
- EXTEND: each request attends with its own slice of queries over its own KV length
  (prefill is dominated by matmuls, so a loop over requests costs little).
- DECODE: one query per request, a handful of kernels per layer whatever the batch size.
  When lengths are similar, each request's keys are gathered into a [bs, max_len] block
  with a length mask and one SDPA call runs (fastest on CPU). When they are very uneven,
  the keys of all requests go on one flat axis tagged with their request and the softmax
  is taken per segment (scatter/index_add), so no key is read twice or padded.
  Gathers use index_select: on CPU it is several times faster than advanced indexing.
  With `--enable-torch-compile` the blocked path instead runs `paged_decode` compiled by
  Inductor, which reads K and V through the slot table in place (no gathered copy); it is
  compiled when the backend is built (server start), not on the first request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.layers.attention.base import AttentionBackend
from tandem.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from tandem.forward_batch import ForwardBatch


def paged_decode(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, table: torch.Tensor,
                 valid: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One-token attention per request over its KV slots, written for Inductor to fuse.

    q [bs, kv_heads, group, D]; k/v_buffer [slots, kv_heads, D], one layer of the pool;
    table/valid [bs, max_len] (`_kv_table`); scale a 0-dim float32 tensor (a Python float
    would be compiled in as a constant). Returns [bs, kv_heads * group * D] in q's dtype,
    computed in float32. Eager, this gathers; compiled, the indexing becomes loads inside
    one loop, so the pool is read in place."""
    bs, kv_heads, group, head_dim = q.shape
    k = k_buffer[table].float()  # [bs, L, kv_heads, D]
    v = v_buffer[table].float()
    scores = (q.float().unsqueeze(1) * k.unsqueeze(3)).sum(-1) * scale  # [bs, L, kv_heads, group]
    scores = scores.masked_fill(~valid.view(bs, -1, 1, 1), float("-inf"))
    out = (scores.softmax(dim=1).unsqueeze(-1) * v.unsqueeze(3)).sum(1)  # [bs, kv_heads, group, D]
    return out.to(q.dtype).reshape(bs, kv_heads * group * head_dim)


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool,
                 enable_torch_compile: bool = False, num_heads: int = 1):
        """`enable_torch_compile`: blocked decode runs `paged_decode` through `torch.compile`,
        compiled here (before the first request) for this rank's `num_heads` query heads."""
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv_pool = token_to_kv_pool
        self.forward_metadata: tuple[torch.Tensor, torch.Tensor] | None = None
        self.compiled_decode = torch.compile(paged_decode) if enable_torch_compile else None
        if self.compiled_decode is not None:
            self._compile_decode(num_heads)

    @torch.inference_mode()
    def _compile_decode(self, num_heads: int) -> None:
        """Compile `paged_decode` for every shape it will meet, under inference mode as the
        model's forward runs (a graph assumes its grad mode). The batch and key-length axes
        are marked dynamic, other sizes are the model's. A dynamic size still specializes
        on 1, so batch 1 and batch >= 2 are one graph each (decode lengths are >= 2); the
        sizes 2 and 3 differ so that no equality between the axes is assumed. The inputs
        read only slot 0, the zeroed padding slot."""
        k_buffer = self.kv_pool.k_buffer[0]
        _, kv_heads, head_dim = k_buffer.shape
        for bs in (1, 2):
            q = torch.zeros(bs, kv_heads, num_heads // kv_heads, head_dim, dtype=k_buffer.dtype,
                            device=k_buffer.device)
            table = torch.zeros(bs, 3, dtype=self.req_to_token.dtype, device=k_buffer.device)
            valid = table == 0
            for tensor in (table, valid):
                torch._dynamo.mark_dynamic(tensor, 1)
            if bs > 1:
                for tensor in (q, table, valid):
                    torch._dynamo.mark_dynamic(tensor, 0)
            self.compiled_decode(q, k_buffer, self.kv_pool.v_buffer[0], table, valid,
                                 torch.tensor(head_dim ** -0.5))

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Decode: each request's KV table, shared by every layer (see `_kv_table`)."""
        self.forward_metadata = self._kv_table(forward_batch) if forward_batch.forward_mode.is_decode() else None

    def forward_decode(self, q, layer_id, fb: ForwardBatch, scaling, num_heads, num_kv_heads, head_dim):
        if self._padded_waste_ok(fb):
            return self._decode_blocked(q, layer_id, fb, scaling, num_heads, num_kv_heads, head_dim)
        return self._decode_segmented(q, layer_id, fb, scaling, num_heads, num_kv_heads, head_dim)

    @staticmethod
    def _padded_waste_ok(fb: ForwardBatch) -> bool:
        """Blocked decode reads max_len keys per request; worth it unless that more than
        doubles the keys read (very uneven lengths), where the segmented path wins."""
        return fb.batch_size * max(fb.seq_lens_cpu) <= 2 * sum(fb.seq_lens_cpu)

    def _decode_blocked(self, q, layer_id, fb: ForwardBatch, scaling, num_heads, num_kv_heads, head_dim):
        """Keys gathered as a [bs, max_len] block with a length mask, one SDPA call.

        Only the key axis of attention is blocked; the model never computes padded tokens.
        The query heads sharing a KV head are SDPA's query axis ([bs, kv_heads, group, D])
        rather than `enable_gqa` over one-token queries: each KV head is read once, and
        PyTorch's CPU flash kernel in bfloat16 runs 5-10x faster than on one-token queries
        (docs/benchmarks.md, "Where a decode step goes")."""
        bs = fb.batch_size
        table, valid = self.forward_metadata
        qg = q.view(bs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if self.compiled_decode is not None:
            return self.compiled_decode(qg, self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id],
                                        table, valid, torch.tensor(scaling))
        max_len = table.shape[1]
        flat = table.reshape(-1)
        k = torch.index_select(self.kv_pool.k_buffer[layer_id], 0, flat)
        v = torch.index_select(self.kv_pool.v_buffer[layer_id], 0, flat)
        k = k.view(bs, max_len, num_kv_heads, head_dim).transpose(1, 2)
        v = v.view(bs, max_len, num_kv_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=valid.view(bs, 1, 1, max_len), scale=scaling)
        return out.reshape(bs, num_heads * head_dim)

    def _kv_table(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """[bs, max_len] KV slots of each request (slot 0 past its end) and the validity mask.

        Computed once per forward by `init_forward_metadata`."""
        max_len = max(fb.seq_lens_cpu)
        valid = torch.arange(max_len, device=fb.seq_lens.device).unsqueeze(0) < fb.seq_lens.unsqueeze(1)
        table = self.req_to_token[fb.req_pool_indices, :max_len].masked_fill(~valid, 0)
        return table, valid

    def _decode_segmented(self, q, layer_id, fb: ForwardBatch, scaling, num_heads, num_kv_heads, head_dim):
        """Keys of all requests on one flat axis, softmax per request segment (no padding)."""
        bs, group = fb.batch_size, num_heads // num_kv_heads
        table, valid = self.forward_metadata
        slots = table[valid]
        seg = torch.arange(bs, device=q.device).repeat_interleave(fb.seq_lens)
        k = torch.index_select(self.kv_pool.k_buffer[layer_id], 0, slots).float()  # [T, KVH, D]
        v = torch.index_select(self.kv_pool.v_buffer[layer_id], 0, slots).float()
        qg = q.view(bs, num_kv_heads, group, head_dim).float()
        scores = torch.einsum("tkd,tkgd->tkg", k, torch.index_select(qg, 0, seg)) * scaling  # [T, KVH, G]
        shape = (bs, num_kv_heads, group)
        peak = torch.full(shape, float("-inf"), device=q.device).scatter_reduce_(
            0, seg.view(-1, 1, 1).expand_as(scores), scores, "amax")
        weights = torch.exp(scores - torch.index_select(peak, 0, seg))
        denom = torch.zeros(shape, device=q.device).index_add_(0, seg, weights)
        out = torch.zeros((*shape, head_dim), device=q.device).index_add_(
            0, seg, weights.unsqueeze(-1) * v.unsqueeze(2))
        return (out / denom.unsqueeze(-1)).to(q.dtype).reshape(bs, num_heads * head_dim)

    def forward_extend(self, q, layer_id, forward_batch, scaling, num_heads, num_kv_heads, head_dim):
        q = q.view(-1, num_heads, head_dim)
        out = torch.empty_like(q)
        k_cache = self.kv_pool.k_buffer[layer_id]
        v_cache = self.kv_pool.v_buffer[layer_id]
        rows = forward_batch.req_pool_indices.tolist()
        start = 0
        for i, row in enumerate(rows):
            seq_len = forward_batch.seq_lens_cpu[i]
            extend_len = forward_batch.extend_lens_cpu[i]
            slots = self.req_to_token[row, :seq_len]
            # [heads, tokens, dim] layout for SDPA.
            qi = q[start : start + extend_len].transpose(0, 1)
            ki = k_cache[slots].transpose(0, 1)
            vi = v_cache[slots].transpose(0, 1)
            if num_kv_heads != num_heads:
                rep = num_heads // num_kv_heads
                ki = ki.repeat_interleave(rep, dim=0)
                vi = vi.repeat_interleave(rep, dim=0)
            mask = None
            if extend_len > 1:
                # Query j (absolute position prefix_len + j) sees keys 0..prefix_len + j.
                prefix_len = seq_len - extend_len
                qpos = torch.arange(extend_len, device=q.device).unsqueeze(1) + prefix_len
                kpos = torch.arange(seq_len, device=q.device).unsqueeze(0)
                mask = kpos <= qpos
            oi = F.scaled_dot_product_attention(qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0),
                                                attn_mask=mask, scale=scaling)
            out[start : start + extend_len] = oi.squeeze(0).transpose(0, 1)
            start += extend_len
        return out.reshape(-1, num_heads * head_dim)
