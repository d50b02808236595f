"""Tandem's C++ CPU prefill attention (tandem/kernels/csrc/extend_attention_cpu.cpp) against a
float64 masked softmax attention: dtypes, head sizes (compile-time and run-time paths), grouped
and plain heads, cached prefixes, ragged extends around its 16-key blocks and 64-row tasks,
sliding windows and soft-caps, slots scattered in the pool; each row's result independent of
how its prompt was chunked and of the requests beside it; and the torch-native backend's
extend runs it on CPU."""

from __future__ import annotations

import pytest
import torch

from tandem.forward_batch import ForwardMode
from tandem.layers.attention.torch_native import TorchNativeAttnBackend
from tests.unit.test_cpu_decode_kernel import make_pool, needs_kernel, one_request_args, ops
from tests.unit.test_torch_native_attention import batch


def reference(q, per_req, prefix_lens, scale, window=0, softcap=0.0):
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


def run_kernel(q, kv, per_req, prefix_lens, scale, window=0, softcap=0.0, rows=None):
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


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("num_heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (6, 2, 80), (32, 4, 32)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (21, 0.0), (0, 30.0)], ids=["causal", "window", "softcap"])
def test_extend_attention_matches_float64(dtype, tol, num_heads, kv_heads, head_dim, window, softcap):
    # (prefix, extend) per request: none / a cached prefix, 1 to 100 new tokens
    lens = [(0, 1), (0, 17), (40, 3), (15, 70), (0, 100), (33, 16)]
    seq_lens = [p + e for p, e in lens]
    kv, rows, per_req = make_pool(seq_lens, num_heads, kv_heads, head_dim, dtype)
    tokens = sum(e for _, e in lens)
    wide = torch.randn(tokens, num_heads * head_dim + 24).to(dtype)
    q = wide[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)  # rows strided, as in a fused QKV
    scale = head_dim**-0.5
    prefix_lens = [p for p, _ in lens]
    out = run_kernel(q, kv, per_req, prefix_lens, scale, window, softcap, rows)
    assert out.dtype == dtype and out.shape == (tokens, num_heads * head_dim)
    assert not out.isnan().any(), "an unowned slot was read"
    expected = reference(q, per_req, prefix_lens, scale, window, softcap)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("window", [0, 19])
def test_rows_do_not_depend_on_chunks_or_neighbours(window):
    """A prompt prefilled in one extend, in two chunks (the second over a cached prefix),
    or beside other requests gives bit-identical rows: chunked prefill, the radix cache and
    batching leave the outputs alone."""
    dtype, num_heads, kv_heads, head_dim = torch.bfloat16, 9, 3, 64
    kv, rows, per_req = make_pool([150, 37], num_heads, kv_heads, head_dim, dtype)
    q = torch.randn(187, num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    whole = run_kernel(q, kv, per_req, [0, 0], scale, window, rows=rows)
    alone = run_kernel(q[:150], kv, per_req[:1], [0], scale, window, rows=rows)
    later = run_kernel(q[61:150], kv, per_req[:1], [61], scale, window, rows=rows)  # the second chunk
    assert torch.equal(whole[:150], alone)
    assert torch.equal(alone[61:], later)


@needs_kernel
def test_extend_attention_refuses_bad_input():
    q = torch.randn(4, 4, 64)
    args = one_request_args()
    with pytest.raises(RuntimeError, match="sum to q's tokens"):
        ops.extend_attention(q, *args, torch.tensor([0]), torch.tensor([3]), 0.125)
    with pytest.raises(RuntimeError, match="int64"):
        ops.extend_attention(q, *args, torch.tensor([0]), torch.tensor([4], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.extend_attention(q.bfloat16(), *args, torch.tensor([0]), torch.tensor([4]), 0.125)
    with pytest.raises(RuntimeError, match="multiple of the KV heads"):
        ops.extend_attention(torch.randn(4, 3, 64), *args, torch.tensor([0]), torch.tensor([4]), 0.125)
    with pytest.raises(RuntimeError, match="exceeds its req_to_token row"):
        ops.extend_attention(q, *args, torch.tensor([10**6]), torch.tensor([4]), 0.125)


@needs_kernel
def test_backend_extends_with_the_kernel():
    """On CPU the backend's extend runs the kernel (no SDPA plan built); outputs equal the
    float64 reference, with cached prefixes."""
    dtype, tol, num_heads, kv_heads, head_dim = torch.bfloat16, 2e-2, 12, 4, 64
    lens = [(0, 7), (12, 30), (5, 19)]
    seq_lens = [p + e for p, e in lens]
    kv, rows, per_req = make_pool(seq_lens, num_heads, kv_heads, head_dim, dtype)
    backend = TorchNativeAttnBackend(rows, kv, num_heads=num_heads)
    assert backend.extend_kernel is not None
    tokens = sum(e for _, e in lens)
    q = torch.randn(tokens, num_heads, head_dim).to(dtype)
    fb = batch(ForwardMode.EXTEND, per_req, seq_lens, [e for _, e in lens])
    backend.init_forward_metadata(fb)
    assert backend.extend_plan is None
    out = backend.forward(q.reshape(tokens, -1), 0, fb, head_dim**-0.5, num_heads, kv_heads, head_dim)
    expected = reference(q, per_req, [p for p, _ in lens], head_dim**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
