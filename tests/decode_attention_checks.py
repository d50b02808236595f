"""The C++ CPU decode (and prefill: `extend_attention`) attention's checks against a float64
softmax attention, shared by tests/unit/test_cpu_decode_kernel.py and
test_extend_attention_kernel.py and, run as `python tests/decode_attention_checks.py
MARCH`, by a build of both kernels for another CPU (`-march=MARCH`, compiled alone and loaded in
this process: its generic vector paths, where this machine's build takes AVX-512 ones), which
prints "ok" once every case passes."""

from __future__ import annotations

import os
import sys

import torch

if __name__ == "__main__":  # the variant's ops are this process's, not this machine's build
    os.environ["TANDEM_DISABLE_CPU_KERNELS"] = "1"

from tandem.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool  # noqa: E402

DTYPES = [(torch.float32, 2e-6), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)]
SHAPES = [(12, 4, 64), (8, 8, 128), (16, 4, 128), (6, 2, 80), (32, 4, 16), (4, 2, 32)]  # heads, KV heads, head_dim
LENGTHS = {  # seq_lens and the threads they run on (None: the default)
    "7-requests": ([1, 15, 16, 17, 40, 3, 100], None),
    # fewer tasks than twice the threads: each task's keys split in parts, merged after
    "1-request-2-threads": ([300], 2),
    "3-requests-2-threads": ([130, 64, 7], 2),
    "1-request-3-threads": ([1000], 3),
}


def make_pool(seq_lens, num_heads, kv_heads, head_dim, dtype, seed=0):
    """A pool whose unowned slots hold NaN, requests on scattered slots; per request its
    row and its keys/values as float64."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    kv = TokenToKVPool(2 * total + 8, 1, kv_heads, head_dim, dtype, "cpu")
    for buf in kv.k_buffer + kv.v_buffer:
        buf[1:].fill_(float("nan"))
    rows = ReqToTokenPool(len(seq_lens) + 2, 4 * max(seq_lens) + 16, "cpu")
    rows.alloc()  # row 0 unused: request rows are not their batch index
    free = kv.alloc(2 * total)
    owned = free[torch.randperm(len(free), generator=gen)[:total]]  # scattered, not in order
    per_req, start = [], 0
    for n in seq_lens:
        row, slots = rows.alloc(), owned[start : start + n]
        start += n
        rows.write(row, 0, slots)
        k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        kv.set_kv(0, slots, k, v)
        per_req.append((row, k.double(), v.double()))
    return kv, rows, per_req


def reference(q, per_req, scale):
    """q [bs, H, D]; softmax attention of each request's query over all its keys, float64."""
    outs = []
    for i, (_, k, v) in enumerate(per_req):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        w = (torch.einsum("hd,lhd->hl", q[i].double(), k) * scale).softmax(-1)
        outs.append(torch.einsum("hl,lhd->hd", w, v).reshape(-1))
    return torch.stack(outs)


def check_decode_attention(ops, dtype, tol, num_heads, kv_heads, head_dim, seq_lens):
    kv, rows, per_req = make_pool(seq_lens, num_heads, kv_heads, head_dim, dtype)
    wide = torch.randn(len(seq_lens), num_heads * head_dim + 24).to(dtype)
    q = wide[:, : num_heads * head_dim].view(len(seq_lens), num_heads, head_dim)  # rows strided, as in a fused QKV
    scale = head_dim**-0.5
    out = ops.decode_attention(
        q,
        kv.k_buffer[0],
        kv.v_buffer[0],
        rows.req_to_token,
        torch.tensor([r[0] for r in per_req]),
        torch.tensor(seq_lens),
        scale,
    )
    assert out.dtype == dtype and out.shape == (len(seq_lens), num_heads * head_dim)
    assert not out.isnan().any(), "an unowned slot was read"
    torch.testing.assert_close(out.double(), reference(q, per_req, scale), atol=tol, rtol=tol)


def extend_reference(q, per_req, prefix_lens, scale, window=0, softcap=0.0):
    """q [tokens, H, D] (request after request); each query at position prefix + i over its
    request's keys 0..prefix + i (the last `window` of them), float64."""
    outs, start = [], 0
    for (_, k, v), prefix in zip(per_req, prefix_lens):
        n = k.shape[0] - prefix
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("thd,lhd->htl", q[start : start + n].double(), k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(prefix, prefix + n).view(n, 1)
        key = torch.arange(k.shape[0]).view(1, -1)
        seen = (key <= pos) & ((key > pos - window) if window > 0 else True)
        w = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        outs.append(torch.einsum("htl,lhd->thd", w, v).reshape(n, -1))
        start += n
    return torch.cat(outs)


def run_extend(ops, q, kv, per_req, prefix_lens, scale, window=0, softcap=0.0, rows=None):
    seq_lens = [r[1].shape[0] for r in per_req]
    return ops.extend_attention(
        q,
        kv.k_buffer[0],
        kv.v_buffer[0],
        rows.req_to_token,
        torch.tensor([r[0] for r in per_req]),
        torch.tensor(prefix_lens),
        torch.tensor([s - p for s, p in zip(seq_lens, prefix_lens)]),
        scale,
        window,
        softcap,
    )


def check_extend_attention(ops, dtype, tol, num_heads, kv_heads, head_dim, window=0, softcap=0.0):
    """The prefill kernel (`extend_attention`) against extend_reference: requests with and
    without cached prefixes, 1 to 100 new tokens, q's rows strided as in a fused QKV."""
    # (prefix, extend) per request: none / a cached prefix, 1 to 100 new tokens
    lens = [(0, 1), (0, 17), (40, 3), (15, 70), (0, 100), (33, 16)]
    seq_lens = [p + e for p, e in lens]
    kv, rows, per_req = make_pool(seq_lens, num_heads, kv_heads, head_dim, dtype)
    tokens = sum(e for _, e in lens)
    wide = torch.randn(tokens, num_heads * head_dim + 24).to(dtype)
    q = wide[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)  # rows strided, as in a fused QKV
    scale = head_dim**-0.5
    prefix_lens = [p for p, _ in lens]
    out = run_extend(ops, q, kv, per_req, prefix_lens, scale, window, softcap, rows)
    assert out.dtype == dtype and out.shape == (tokens, num_heads * head_dim)
    assert not out.isnan().any(), "an unowned slot was read"
    expected = extend_reference(q, per_req, prefix_lens, scale, window, softcap)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


# The narrower pools beside each activation dtype (--kv-cache-dtype; widened_pool).
NARROW_POOLS = [
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.float32, torch.float8_e5m2),
    (torch.float32, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e5m2),
    (torch.bfloat16, torch.float8_e4m3fn),
]


def check_kv_dtype_pool(ops, kv_dtype, num_heads, kv_heads, head_dim, seq_lens, q_dtype=torch.float32):
    """Queries of q_dtype on a narrower pool (--kv-cache-dtype: NARROW_POOLS): decode and prefill
    attention equal the same kernels on the pool widened to q_dtype, which holds its values
    exactly (each row is widened exactly as it is read): bit for bit with float32 queries; with
    bfloat16 ones within bfloat16's rounding (a bfloat16 pool may take other loops, VDPBF16PS). kv_write
    rounds rows of q_dtype as PyTorch's cast."""
    kv, rows, per_req = make_pool(seq_lens, num_heads, kv_heads, head_dim, kv_dtype)
    wide = TokenToKVPool(kv.size, 1, kv_heads, head_dim, q_dtype, "cpu")
    wide.k_buffer[0].copy_(kv.k_buffer[0])
    wide.v_buffer[0].copy_(kv.v_buffer[0])

    def same(got, want):
        assert got.dtype == q_dtype
        if q_dtype == torch.float32:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, equal_nan=False)

    bs, scale = len(seq_lens), head_dim**-0.5
    q = torch.randn(bs, num_heads, head_dim).to(q_dtype)
    args = (rows.req_to_token, torch.tensor([r[0] for r in per_req]), torch.tensor(seq_lens), scale)
    same(
        ops.decode_attention(q, kv.k_buffer[0], kv.v_buffer[0], *args),
        ops.decode_attention(q, wide.k_buffer[0], wide.v_buffer[0], *args),
    )
    prefix_lens = [n // 3 for n in seq_lens]
    tokens = sum(n - p for n, p in zip(seq_lens, prefix_lens))
    qe = torch.randn(tokens, num_heads, head_dim).to(q_dtype)
    same(
        run_extend(ops, qe, kv, per_req, prefix_lens, scale, rows=rows),
        run_extend(ops, qe, wide, per_req, prefix_lens, scale, rows=rows),
    )
    slots = torch.tensor([3, 1, 7])
    k_new = (torch.randn(3, kv_heads, head_dim) * 100).to(q_dtype)
    v_new = torch.randn(3, kv_heads, head_dim).to(q_dtype)
    if kv_dtype == torch.float8_e4m3fn:
        k_new[0, 0, :2] = torch.tensor([500.0, -1e4])  # past e4m3fn's largest (448): its NaN, as the cast
    ops.kv_write(kv.k_buffer[0], kv.v_buffer[0], slots, k_new, v_new)

    def bits(t):  # compared as bit patterns: NaN equals NaN
        return t.view(torch.uint8 if t.element_size() == 1 else torch.int16)

    assert torch.equal(bits(kv.k_buffer[0][slots]), bits(k_new.to(kv_dtype)))
    assert torch.equal(bits(kv.v_buffer[0][slots]), bits(v_new.to(kv_dtype)))


if __name__ == "__main__":
    from tandem.kernels import cpu

    sources = (cpu.CSRC / "decode_attention_cpu.cpp", cpu.CSRC / "extend_attention_cpu.cpp")
    torch.ops.load_library(str(cpu.build(sources=sources, march=sys.argv[1])))
    for dtype, tol in DTYPES:
        for heads in SHAPES:
            for seq_lens, threads in LENGTHS.values():
                torch.set_num_threads(threads or 2)
                check_decode_attention(torch.ops.tandem_cpu, dtype, tol, *heads, seq_lens)
        for window, softcap in ((0, 0.0), (21, 0.0), (0, 30.0)):
            check_extend_attention(torch.ops.tandem_cpu, dtype, tol, 9, 3, 64, window, softcap)
    for q_dtype, kv_dtype in NARROW_POOLS:
        for heads in SHAPES:
            check_kv_dtype_pool(torch.ops.tandem_cpu, kv_dtype, *heads, LENGTHS["7-requests"][0], q_dtype)
    print("ok")
