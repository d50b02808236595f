"""The C++ CPU decode attention's checks against a float64 softmax attention, shared by
tests/unit/test_cpu_decode_kernel.py and, run as `python tests/decode_attention_checks.py
MARCH`, by a build of the kernel for another CPU (`-march=MARCH`, compiled alone and loaded in
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
SHAPES = [(12, 4, 64), (8, 8, 128), (6, 2, 80), (32, 4, 16), (4, 2, 32)]  # heads, KV heads, head_dim
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


if __name__ == "__main__":
    from tandem.kernels import cpu

    torch.ops.load_library(str(cpu.build(sources=(cpu.CSRC / "decode_attention_cpu.cpp",), march=sys.argv[1])))
    for dtype, tol in DTYPES:
        for heads in SHAPES:
            for seq_lens, threads in LENGTHS.values():
                torch.set_num_threads(threads or 2)
                check_decode_attention(torch.ops.tandem_cpu, dtype, tol, *heads, seq_lens)
    print("ok")
