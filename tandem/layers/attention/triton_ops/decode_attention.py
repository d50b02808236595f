"""Decode attention in Triton over the paged KV pool, read in place through `req_to_token`.

One query token per request. Split-K (flash-decoding): stage 1 runs one program per
(request, block of at most 16 query heads of one KV head's group, KV split) and writes each split's
normalised partial output and log-sum-exp; stage 2 merges a request's splits. The split
length depends only on the request's own length (`seq_len / NUM_KV_SPLITS`, at least
MIN_SPLIT_LEN keys), so short requests use one split, long ones up to NUM_KV_SPLITS, and
no per-batch host value is needed: the kernels run unchanged under CUDA graphs.

A sliding window (`WINDOW` > 0, a compile-time constant per layer kind) splits only the
request's last WINDOW keys; a logit soft-cap (`LOGIT_CAP` > 0) caps the scaled scores,
`LOGIT_CAP * tanh(s / LOGIT_CAP)`, before the softmax (`attend_block`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_KV_SPLITS = 8
MIN_SPLIT_LEN = 64
BLOCK_N = 32
BLOCK_H = 16  # query heads per program (tl.dot wants 16 rows); padded rows are masked


def dot_precision(dtype: torch.dtype) -> str:
    """float32 models multiply in full precision (Triton's default for float32 is TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _split_bounds(seq_len, split_id, NUM_KV_SPLITS: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr, WINDOW: tl.constexpr):
    """Keys [start, end) of split `split_id`: the request's keys, or its last WINDOW ones."""
    kv_start = tl.maximum(seq_len - WINDOW, 0) if WINDOW > 0 else 0
    per_split = tl.maximum(tl.cdiv(seq_len - kv_start, NUM_KV_SPLITS), MIN_SPLIT_LEN)
    start = kv_start + per_split * split_id
    return start, tl.minimum(start + per_split, seq_len)


@triton.jit
def attend_block(
    q,
    K_Buffer,
    V_Buffer,
    Row_slots,
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
    DOT_PRECISION: tl.constexpr,
    LOGIT_CAP: tl.constexpr = 0.0,
):
    """Fold one block of keys (positions `offs_n`, valid where `mask_n`, seen by each query
    row where `visible`) into the online softmax (`acc`, `e_sum`, `e_max`): K and V are
    read from the pool through the request's page-table row `Row_slots`. `LOGIT_CAP` > 0
    soft-caps the scaled scores (tanh as 2 * sigmoid(2x) - 1). A row that sees no key of
    the block (a sliding window's) keeps its state."""
    slots = tl.load(Row_slots + offs_n, mask=mask_n, other=0)
    k = tl.load(
        K_Buffer + slots[None, :] * stride_kb + kv_head * stride_kh + offs_d[:, None],
        mask=mask_n[None, :] & mask_d[:, None],
        other=0.0,
    )
    qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION).to(tl.float32) * sm_scale
    if LOGIT_CAP > 0:
        qk = LOGIT_CAP * (2.0 * tl.sigmoid(qk * (2.0 / LOGIT_CAP)) - 1.0)
    qk = tl.where(visible, qk, float("-inf"))
    v = tl.load(
        V_Buffer + slots[:, None] * stride_vb + kv_head * stride_vh + offs_d[None, :],
        mask=mask_n[:, None] & mask_d[None, :],
        other=0.0,
    )
    new_max = tl.maximum(tl.max(qk, 1), e_max)
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing seen yet: no NaN
    rescale = tl.exp(e_max - safe_max)
    p = tl.exp(qk - safe_max[:, None])
    acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
    return acc, e_sum * rescale + tl.sum(p, 1), new_max


@triton.jit
def _decode_stage1(
    Q,
    K_Buffer,
    V_Buffer,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Att_Out,
    Att_Lse,
    sm_scale,
    stride_r2t,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEADS_PER_BLOCK: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    LOGIT_CAP: tl.constexpr,
):
    bid, hblock, split_id = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # Head blocks never straddle two KV heads: each KV head's GROUP query heads get
    # cdiv(GROUP, HEADS_PER_BLOCK) blocks of their own, the last one cut at the group's
    # end (group 24: heads 0-15, 16-23 | 24-39, 40-47), so a block's KV head is its
    # group's, also when GROUP is above BLOCK_H and not a multiple of it.
    blocks_per_group = tl.cdiv(GROUP, HEADS_PER_BLOCK)
    kv_head = hblock // blocks_per_group
    in_group = (hblock % blocks_per_group) * HEADS_PER_BLOCK + tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + in_group
    mask_h = (tl.arange(0, BLOCK_H) < HEADS_PER_BLOCK) & (in_group < GROUP) & (heads < NUM_HEADS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    seq_len = tl.load(Seq_lens + bid)
    row = tl.load(Req_pool_indices + bid)
    start, end = _split_bounds(seq_len, split_id, NUM_KV_SPLITS, MIN_SPLIT_LEN, WINDOW)
    if end > start:
        q = tl.load(
            Q + bid * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None] & mask_d[None, :],
            other=0.0,
        )
        e_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
        e_sum = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            acc, e_sum, e_max = attend_block(
                q,
                K_Buffer,
                V_Buffer,
                Req_to_token + row * stride_r2t,
                offs_n,
                mask_n,
                mask_n[None, :],
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
        out = Att_Out + bid * stride_ob + heads[:, None] * stride_oh + split_id * stride_os + offs_d[None, :]
        tl.store(out, acc / e_sum[:, None], mask=mask_h[:, None] & mask_d[None, :])
        tl.store(Att_Lse + bid * stride_lb + heads * stride_lh + split_id, e_max + tl.log(e_sum), mask=mask_h)


@triton.jit
def _decode_stage2(
    Att_Out,
    Att_Lse,
    O,
    Seq_lens,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_b,
    stride_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
    WINDOW: tl.constexpr,
):
    bid, head = tl.program_id(0), tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    seq_len = tl.load(Seq_lens + bid)
    e_max = float("-inf")
    e_sum = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for split_id in range(0, NUM_KV_SPLITS):
        start, end = _split_bounds(seq_len, split_id, NUM_KV_SPLITS, MIN_SPLIT_LEN, WINDOW)
        if end > start:
            part = tl.load(
                Att_Out + bid * stride_ob + head * stride_oh + split_id * stride_os + offs_d, mask=mask_d, other=0.0
            )
            lse = tl.load(Att_Lse + bid * stride_lb + head * stride_lh + split_id)
            new_max = tl.maximum(lse, e_max)
            old_scale = tl.exp(e_max - new_max)
            weight = tl.exp(lse - new_max)
            acc = acc * old_scale + weight * part
            e_sum = e_sum * old_scale + weight
            e_max = new_max
    tl.store(O + bid * stride_b + head * stride_h + offs_d, (acc / e_sum).to(O.dtype.element_ty), mask=mask_d)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    att_out: torch.Tensor,
    att_lse: torch.Tensor,
    sm_scale: float,
    sliding_window: int = 0,
    logit_cap: float = 0.0,
) -> None:
    """q, o [bs, H, D]; k/v_buffer [slots, KVH, D]; att_out [>=bs, H, NUM_KV_SPLITS, D] and
    att_lse [>=bs, H, NUM_KV_SPLITS] float32 scratch. Every seq_len must be >= 1.
    `sliding_window` > 0: each query sees its request's last `sliding_window` keys;
    `logit_cap` > 0: the scores are soft-capped."""
    bs, num_heads, head_dim = q.shape
    group = num_heads // k_buffer.shape[1]
    block_d = max(triton.next_power_of_2(head_dim), 16)
    heads_per_block = min(BLOCK_H, group)
    head_blocks = k_buffer.shape[1] * triton.cdiv(group, heads_per_block)
    _decode_stage1[(bs, head_blocks, NUM_KV_SPLITS)](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        att_out,
        att_lse,
        sm_scale,
        req_to_token.stride(0),
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        att_out.stride(0),
        att_out.stride(1),
        att_out.stride(2),
        att_lse.stride(0),
        att_lse.stride(1),
        GROUP=group,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=BLOCK_N,
        BLOCK_H=BLOCK_H,
        HEADS_PER_BLOCK=heads_per_block,
        NUM_KV_SPLITS=NUM_KV_SPLITS,
        MIN_SPLIT_LEN=MIN_SPLIT_LEN,
        DOT_PRECISION=dot_precision(q.dtype),
        WINDOW=int(sliding_window),
        LOGIT_CAP=float(logit_cap),
    )
    _decode_stage2[(bs, num_heads)](
        att_out,
        att_lse,
        o,
        seq_lens,
        att_out.stride(0),
        att_out.stride(1),
        att_out.stride(2),
        att_lse.stride(0),
        att_lse.stride(1),
        o.stride(0),
        o.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_KV_SPLITS=NUM_KV_SPLITS,
        MIN_SPLIT_LEN=MIN_SPLIT_LEN,
        WINDOW=int(sliding_window),
    )
