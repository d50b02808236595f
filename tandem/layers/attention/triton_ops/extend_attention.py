"""Extend (prefill) attention in Triton over the paged KV pool, read in place through
`req_to_token`.

Each request attends with its `extend_len` new queries over its `seq_len` keys: the
cached prefix (radix-cache hits, earlier chunks of a chunked prefill) without a mask,
then the new part causally. The caller has written the new tokens' K and V into the pool
already, so prefix and new part are read the same way. One program per
(request, query head, block of BLOCK_M queries); blocks past a request's extend_len exit.
A sliding window (`WINDOW` > 0) also masks the keys at or before `qpos - WINDOW` and
starts the key loop at the block's first visible key; `LOGIT_CAP` > 0 soft-caps the scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.layers.attention.triton_ops.decode_attention import attend_block, dot_precision

BLOCK_M = 32
BLOCK_N = 32


@triton.jit
def _extend_fwd(
    Q,
    K_Buffer,
    V_Buffer,
    O,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Extend_lens,
    Qo_start,
    sm_scale,
    stride_r2t,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
):
    bid, head, mblock = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    extend_len = tl.load(Extend_lens + bid)
    if mblock * BLOCK_M < extend_len:
        seq_len = tl.load(Seq_lens + bid)
        prefix_len = seq_len - extend_len
        row = tl.load(Req_pool_indices + bid)
        q_start = tl.load(Qo_start + bid)
        kv_head = head // GROUP
        offs_m = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < extend_len
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(
            Q + (q_start + offs_m[:, None]) * stride_qt + head * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )
        qpos = prefix_len + offs_m
        e_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        e_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Keys past this block's last query are masked for all of its rows: stop there.
        end = tl.minimum(seq_len, prefix_len + (mblock + 1) * BLOCK_M)
        # Keys before the block's first query's window are masked for all of its rows.
        lo = tl.maximum(prefix_len + mblock * BLOCK_M - WINDOW + 1, 0) if WINDOW > 0 else 0
        for n0 in range(lo, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            visible = mask_n[None, :] & (offs_n[None, :] <= qpos[:, None])
            if WINDOW > 0:
                visible = visible & (offs_n[None, :] > qpos[:, None] - WINDOW)
            # A row that sees no key of a block keeps its state (attend_block); every row
            # sees its own key, so it ends with a finite sum.
            acc, e_sum, e_max = attend_block(
                q,
                K_Buffer,
                V_Buffer,
                Req_to_token + row * stride_r2t,
                offs_n,
                mask_n,
                visible,
                kv_head,
                offs_d,
                mask_d,
                stride_kb,
                stride_kh,
                stride_vb,
                stride_vh,
                sm_scale,
                acc,
                e_sum,
                e_max,
                DOT_PRECISION,
                LOGIT_CAP,
            )
        out = O + (q_start + offs_m[:, None]) * stride_ot + head * stride_oh + offs_d[None, :]
        e_sum = tl.where(e_sum > 0, e_sum, 1.0)  # padded rows past a window may see no key
        tl.store(out, (acc / e_sum[:, None]).to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_start: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    sliding_window: int = 0,
    logit_cap: float = 0.0,
) -> None:
    """q, o [num_tokens, H, D] (requests one after another from `qo_start[i]`);
    k/v_buffer [slots, KVH, D]; per request: seq_lens (prefix + new) and extend_lens."""
    bs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_buffer.shape[1]
    block_d = max(triton.next_power_of_2(head_dim), 16)
    _extend_fwd[(bs, num_heads, triton.cdiv(max_extend_len, BLOCK_M))](
        q,
        k_buffer,
        v_buffer,
        o,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_lens,
        qo_start,
        sm_scale,
        req_to_token.stride(0),
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        o.stride(0),
        o.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        DOT_PRECISION=dot_precision(q.dtype),
        WINDOW=int(sliding_window),
        LOGIT_CAP=float(logit_cap),
    )
