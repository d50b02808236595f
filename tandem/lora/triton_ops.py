"""The LoRA delta of a `LoraBatch` in Triton: the segmented matmuls of tandem/lora/batch.py
as two kernels (SGLang's and punica's shrink and expand), reading the tokens of each
segment in place through its index row, so nothing is gathered or padded in memory.

  shrink  h[seg, i, :] = x[index[seg, i]] @ a[slot[seg]]^T           (float32)
  expand  out[index[seg, i]] += h[seg, i] @ b[slot[seg]]       (b: B transposed)

One program per (segment, block of its tokens, block of output columns); rows past the
segment's count are masked, and every token is in at most one segment, so the expand's
read-add-write of `out` needs no atomics. `LoraBatch.add_delta` runs these on CUDA; on
CPU only Triton's interpreter runs them (TRITON_INTERPRET=1), which is how the tests
check them against the PyTorch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tokens per program (tl.dot wants at least 16 rows)
BLOCK_N = 64  # output columns per program
BLOCK_K = 32  # reduction step


def dot_precision(dtype: torch.dtype) -> str:
    """float32 models multiply in full precision (Triton's default for float32 is TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _segment_rows(Index, Count, seg, m_block, stride_index, BLOCK_M: tl.constexpr):
    """The token rows of block `m_block` of segment `seg`, and which of them are real."""
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < tl.load(Count + seg)
    return tl.load(Index + seg * stride_index + offs_m, mask=mask_m, other=0), offs_m, mask_m


@triton.jit
def _shrink_kernel(
    X,
    A,
    H,
    Slots,
    Index,
    Count,
    in_features,
    width,
    stride_x,
    stride_as,
    stride_ar,
    stride_hs,
    stride_hm,
    stride_index,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seg, m_block, n_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tokens, offs_m, mask_m = _segment_rows(Index, Count, seg, m_block, stride_index, BLOCK_M)
    slot = tl.load(Slots + seg)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < width
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, in_features, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < in_features
        x = tl.load(X + tokens[:, None] * stride_x + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(
            A + slot * stride_as + offs_n[None, :] * stride_ar + offs_k[:, None],
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc += tl.dot(x, a.to(x.dtype), input_precision=DOT_PRECISION)
    h = H + seg * stride_hs + offs_m[:, None] * stride_hm + offs_n[None, :]
    tl.store(h, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _expand_kernel(
    H,
    B,
    Out,
    Slots,
    Index,
    Count,
    out_features,
    width,
    stride_hs,
    stride_hm,
    stride_bs,
    stride_bw,
    stride_out,
    stride_index,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seg, m_block, n_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tokens, offs_m, mask_m = _segment_rows(Index, Count, seg, m_block, stride_index, BLOCK_M)
    slot = tl.load(Slots + seg)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < out_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, width, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < width
        h = tl.load(
            H + seg * stride_hs + offs_m[:, None] * stride_hm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        b = tl.load(
            B + slot * stride_bs + offs_k[:, None] * stride_bw + offs_n[None, :],
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc += tl.dot(h, b.to(tl.float32), input_precision=DOT_PRECISION)
    out = Out + tokens[:, None] * stride_out + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(out, (tl.load(out, mask=mask, other=0.0).to(tl.float32) + acc).to(Out.dtype.element_ty), mask=mask)


def add_lora_delta(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    token_index: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    """`out` += each segment's tokens' `x @ a[slot]^T @ b[slot]` (in place); `a` [S, W, in],
    `b` [S, W, out], `token_index` [n, longest], `counts` [n] (the tokens of each segment)."""
    x, n, longest = x.contiguous(), token_index.shape[0], token_index.shape[1]
    width, in_features, out_features = a.shape[1], a.shape[2], b.shape[2]
    h = torch.empty(n, longest, width, dtype=torch.float32, device=x.device)
    precision = dot_precision(x.dtype)
    m_blocks = triton.cdiv(longest, BLOCK_M)
    _shrink_kernel[(n, m_blocks, triton.cdiv(width, BLOCK_N))](
        x,
        a,
        h,
        slots,
        token_index,
        counts,
        in_features,
        width,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        h.stride(0),
        h.stride(1),
        token_index.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION=precision,
    )
    _expand_kernel[(n, m_blocks, triton.cdiv(out_features, BLOCK_N))](
        h,
        b,
        out,
        slots,
        token_index,
        counts,
        out_features,
        width,
        h.stride(0),
        h.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        token_index.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION=precision,
    )
    return out
