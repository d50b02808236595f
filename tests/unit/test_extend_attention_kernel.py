"""Tandem's C++ CPU prefill attention (tandem/kernels/csrc/extend_attention_cpu.cpp) against a
float64 masked softmax attention: dtypes, head sizes (compile-time and run-time paths), grouped
and plain heads, cached prefixes, ragged extends around its 16-key blocks and 64-row tasks,
sliding windows and soft-caps, slots scattered in the pool; each row's result independent of
how its prompt was chunked and of the requests beside it; and the torch-native backend's
extend runs it on CPU."""

from __future__ import annotations

import pytest
import torch
from decode_attention_checks import check_extend_attention, extend_reference, run_extend

from tandem.forward_batch import ForwardMode
from tandem.layers.attention.torch_native import TorchNativeAttnBackend
from tests.unit.test_cpu_decode_kernel import make_pool, needs_kernel, one_request_args, ops
from tests.unit.test_torch_native_attention import batch


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("num_heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (6, 2, 80), (32, 4, 32)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (21, 0.0), (0, 30.0)], ids=["causal", "window", "softcap"])
def test_extend_attention_matches_float64(dtype, tol, num_heads, kv_heads, head_dim, window, softcap):
    check_extend_attention(ops, dtype, tol, num_heads, kv_heads, head_dim, window, softcap)


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
    whole = run_extend(ops, q, kv, per_req, [0, 0], scale, window, rows=rows)
    alone = run_extend(ops, q[:150], kv, per_req[:1], [0], scale, window, rows=rows)
    later = run_extend(ops, q[61:150], kv, per_req[:1], [61], scale, window, rows=rows)  # the second chunk
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
    expected = extend_reference(q, per_req, [p for p, _ in lens], head_dim**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
