"""Attention in plain PyTorch over the paged KV pool: runs on any device.

Requests are ragged: each is handled with its own slice of queries and its own KV
length, so no request is padded to the longest one in the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.layers.attention.base import AttentionBackend
from tandem.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from tandem.model_executor.forward_batch import ForwardBatch


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool):
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv_pool = token_to_kv_pool

    def forward(self, q, layer_id, forward_batch, scaling, num_heads, num_kv_heads, head_dim):
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
