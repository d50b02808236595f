"""The torch-native attention backend against a plain per-request softmax attention:
extend, blocked decode, segmented decode and mixed batches agree, and unused pool slots
never leak in."""

from __future__ import annotations

import shutil

import pytest
import torch

from tandem.forward_batch import ForwardBatch, ForwardMode
from tandem.layers.attention.extend_plan import MAX_PADDED_WASTE
from tandem.layers.attention.torch_native import TorchNativeAttnBackend
from tandem.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool

H, KVH, D = 4, 2, 8


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """q [n, H, D] at positions prefix_len.., k/v [L, kv_heads, D]: causal attention, GQA or MHA."""
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    v = v.repeat_interleave(H // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
    qpos = torch.arange(q.shape[0]).unsqueeze(1) + prefix_len
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], H * D)


def setup(
    seq_lens: list[int],
    dtype: torch.dtype = torch.float32,
    enable_torch_compile: bool = False,
    kv_heads: int = KVH,
    sdpa_extend: bool = False,
):
    """A backend over a pool holding `seq_lens` requests; `sdpa_extend`: its extend runs the
    PyTorch path (SDPA groups) where Tandem's C++ extend kernel would."""
    torch.manual_seed(0)
    kv = TokenToKVPool(200, 1, kv_heads, D, dtype, "cpu")
    assert all(buf[0].eq(0).all() for buf in kv.k_buffer + kv.v_buffer), "slot 0 is the zeroed padding slot"
    for buf in kv.k_buffer + kv.v_buffer:
        buf[1:].fill_(float("nan"))  # slots no request owns must never be read
    rows = ReqToTokenPool(len(seq_lens), 64, "cpu")
    per_req = []
    for n in seq_lens:
        row = rows.alloc()
        slots = kv.alloc(n)
        rows.write(row, 0, slots)
        k, v = torch.randn(n, kv_heads, D).to(dtype).float(), torch.randn(n, kv_heads, D).to(dtype).float()
        kv.set_kv(0, slots, k.to(dtype), v.to(dtype))
        per_req.append((row, slots, k, v))
    backend = TorchNativeAttnBackend(rows, kv, enable_torch_compile, H)
    if sdpa_extend:
        backend.extend_kernel = None
    return backend, per_req


def batch(mode: ForwardMode, per_req, seq_lens: list[int], extend_lens: list[int]) -> ForwardBatch:
    n = sum(extend_lens)
    return ForwardBatch(
        forward_mode=mode,
        batch_size=len(seq_lens),
        input_ids=torch.zeros(n, dtype=torch.int64),
        positions=torch.zeros(n, dtype=torch.int64),
        out_cache_loc=torch.zeros(n, dtype=torch.int64),
        req_pool_indices=torch.tensor([r[0] for r in per_req]),
        seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=[s - e for s, e in zip(seq_lens, extend_lens)],
        extend_lens_cpu=extend_lens,
    )


@pytest.mark.parametrize("seq_lens", [[5, 9, 7], [3, 40, 2, 2]])  # similar lengths -> blocked; uneven -> segmented
def test_decode_matches_reference(seq_lens):
    backend, per_req = setup(seq_lens)
    q = torch.randn(len(seq_lens), H, D)
    fb = batch(ForwardMode.DECODE, per_req, seq_lens, [1] * len(seq_lens))
    backend.init_forward_metadata(fb)
    out = backend.forward(q.reshape(len(seq_lens), -1), 0, fb, D**-0.5, H, KVH, D)
    expected = torch.cat(
        [reference(q[i : i + 1], k, v, n - 1) for i, (n, (_, _, k, v)) in enumerate(zip(seq_lens, per_req))]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Both decode paths agree with each other.
    fb2 = batch(ForwardMode.DECODE, per_req, seq_lens, [1] * len(seq_lens))
    backend.init_forward_metadata(fb2)
    a = backend._decode_blocked(q.reshape(len(seq_lens), -1), 0, fb2, D**-0.5, H, KVH, D)
    b = backend._decode_segmented(q.reshape(len(seq_lens), -1), 0, fb2, D**-0.5, H, KVH, D)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seq_lens", [[5, 9, 7], [3, 40, 2, 2]])
def test_bfloat16_decode_matches_float32_reference(seq_lens):
    """A bfloat16 pool: both decode paths return bfloat16 within its rounding of the float32
    attention over the same (bfloat16) keys and values."""
    backend, per_req = setup(seq_lens, torch.bfloat16)
    q = torch.randn(len(seq_lens), H, D).to(torch.bfloat16)
    fb = batch(ForwardMode.DECODE, per_req, seq_lens, [1] * len(seq_lens))
    backend.init_forward_metadata(fb)
    out = backend.forward(q.reshape(len(seq_lens), -1), 0, fb, D**-0.5, H, KVH, D)
    expected = torch.cat(
        [reference(q[i : i + 1].float(), k, v, n - 1) for i, (n, (_, _, k, v)) in enumerate(zip(seq_lens, per_req))]
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


def test_extend_with_prefix_matches_reference():
    seq_lens, extend_lens = [6, 10], [6, 4]  # the second request has a 6-token cached prefix
    backend, per_req = setup(seq_lens)
    q = torch.randn(sum(extend_lens), H, D)
    fb = batch(ForwardMode.EXTEND, per_req, seq_lens, extend_lens)
    backend.init_forward_metadata(fb)
    out = backend.forward(q.reshape(sum(extend_lens), -1), 0, fb, D**-0.5, H, KVH, D)
    expected = torch.cat(
        [reference(q[:6], per_req[0][2], per_req[0][3], 0), reference(q[6:], per_req[1][2], per_req[1][3], 6)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def _cpp_compiler() -> str | None:
    """Inductor's C++ compiler on this machine, if any (compiled CPU kernels need one)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return shutil.which(get_cpp_compiler())
    except Exception:  # torch raises various errors when no compiler is found
        return None


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_compiled_decode_matches_eager_without_compiling_on_a_request(dtype, tol):
    """--enable-torch-compile: the compiled in-place decode equals the eager gather + SDPA on
    a ragged batch, and it was compiled when the backend was built (no compile on the request)."""
    if _cpp_compiler() is None:  # checked here, not at collection (it imports Triton)
        pytest.skip("--enable-torch-compile needs Inductor's C++ compiler (g++ or clang++), not found here")
    from torch._dynamo.utils import counters

    seq_lens = [5, 9, 7, 6]  # ragged, lengths similar enough for the blocked path
    compiled, per_req = setup(seq_lens, dtype, enable_torch_compile=True)
    eager, _ = setup(seq_lens, dtype)
    outs = []
    compiles_before = counters["stats"]["unique_graphs"]
    with torch.inference_mode():  # as the model runs: q and the slot table are inference tensors
        q = torch.randn(len(seq_lens), H * D).to(dtype)
        for backend in (compiled, eager):
            fb = batch(ForwardMode.DECODE, per_req, seq_lens, [1] * len(seq_lens))
            assert backend._padded_waste_ok(fb)
            backend.init_forward_metadata(fb)
            outs.append(backend.forward(q, 0, fb, D**-0.5, H, KVH, D))
    assert counters["stats"]["unique_graphs"] == compiles_before, "decode compiled on a request"
    assert outs[0].dtype == dtype
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("decode_lens", [[9, 7, 8], [3, 40, 2]])  # decode part: blocked; segmented
def test_mixed_batch_splits_into_extend_and_decode(dtype, tol, decode_lens, monkeypatch):
    """--enable-mixed-chunk: two prefill rows (one over a cached prefix) followed by running
    requests decoding one token each. The prefill rows go through `forward_extend`, the decode
    rows through `forward_decode` as a decode batch of their own, and the output equals the
    per-request extend path over the whole batch (the unsplit batch) and the reference."""
    seq_lens = [6, 10] + decode_lens
    extend_lens = [6, 4] + [1] * len(decode_lens)
    backend, per_req = setup(seq_lens, dtype)
    q = torch.randn(sum(extend_lens), H * D).to(dtype)
    calls = []

    def spy(name: str) -> None:
        method = getattr(backend, name)

        def call(q, layer_id, fb, *rest, **window_cap):
            calls.append((name, fb.forward_mode, fb.batch_size, q.shape[0]))
            return method(q, layer_id, fb, *rest, **window_cap)

        monkeypatch.setattr(backend, name, call)

    spy("forward_extend")
    spy("forward_decode")
    mixed = batch(ForwardMode.EXTEND, per_req, seq_lens, extend_lens)
    mixed.num_prefill = 2
    backend.init_forward_metadata(mixed)
    out = backend.forward(q, 0, mixed, D**-0.5, H, KVH, D)
    assert calls == [
        ("forward_extend", ForwardMode.EXTEND, 2, 10),
        ("forward_decode", ForwardMode.DECODE, len(decode_lens), len(decode_lens)),
    ]
    plain = batch(ForwardMode.EXTEND, per_req, seq_lens, extend_lens)
    backend.init_forward_metadata(plain)
    assert backend.mixed_parts is None
    expected_plain = backend.forward(q, 0, plain, D**-0.5, H, KVH, D)
    assert out.dtype == dtype and out.shape == expected_plain.shape
    torch.testing.assert_close(out.float(), expected_plain.float(), atol=tol, rtol=tol)
    qf = q.float().view(-1, H, D)
    starts = [0, 6, 10] + [10 + i for i in range(1, len(decode_lens))]
    expected = torch.cat(
        [reference(qf[s : s + e], k, v, n - e) for s, e, n, (_, _, k, v) in zip(starts, extend_lens, seq_lens, per_req)]
    )
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


# (prefix_len, extend_len) per request, in batch order.
UNIFORM = [(0, 12)] * 4  # one causal group, laid out as the batch: no gathers of q or out
RAGGED = [(0, 7), (0, 5), (0, 1), (0, 40), (0, 6)]  # causal groups with padded queries and keys
PREFIXED = [(0, 7), (6, 4), (30, 2), (0, 5), (20, 1), (3, 9)]  # masked groups, some without a prefix


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("kv_heads", [KVH, H], ids=["gqa", "mha"])
@pytest.mark.parametrize("reqs", [UNIFORM, RAGGED, PREFIXED], ids=["uniform", "ragged", "prefixed"])
@pytest.mark.parametrize("sdpa_extend", [True, False], ids=["sdpa", "cpu-kernel"])
def test_extend_matches_reference(reqs, kv_heads, dtype, tol, sdpa_extend):
    """Extend, with and without cached prefixes, batched into padded SDPA groups (or by the
    C++ kernel where it is built): every token's output equals per-request causal attention
    over its own keys (the unowned pool slots hold NaN, so a padded or misplaced read
    shows), in the pool's dtype."""
    seq_lens = [p + n for p, n in reqs]
    extend_lens = [n for _, n in reqs]
    backend, per_req = setup(seq_lens, dtype, kv_heads=kv_heads, sdpa_extend=sdpa_extend)
    q = torch.randn(sum(extend_lens), H, D).to(dtype)
    fb = batch(ForwardMode.EXTEND, per_req, seq_lens, extend_lens)
    backend.init_forward_metadata(fb)
    out = backend.forward(q.reshape(sum(extend_lens), -1), 0, fb, D**-0.5, H, kv_heads, D)
    starts = [sum(extend_lens[:i]) for i in range(len(reqs))]
    expected = torch.cat(
        [reference(q[s : s + n].float(), k, v, p) for s, (p, n), (_, _, k, v) in zip(starts, reqs, per_req)]
    )
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("reqs", [UNIFORM, RAGGED, PREFIXED], ids=["uniform", "ragged", "prefixed"])
def test_extend_plan_groups_within_the_padding_bound(reqs):
    """Every request is in exactly one group; a group pads its block to at most
    MAX_PADDED_WASTE times the attention it holds; a group without a prefix has no mask
    (SDPA's is_causal); a batch of equal prompts is one group that reads q and writes the
    output in place (no index)."""
    seq_lens = [p + n for p, n in reqs]
    extend_lens = [n for _, n in reqs]
    backend, per_req = setup(seq_lens, sdpa_extend=True)
    backend.init_forward_metadata(batch(ForwardMode.EXTEND, per_req, seq_lens, extend_lens))
    plan = backend.extend_plan
    assert sum(g.size for g in plan.groups) == len(reqs)
    assert sum(g.size * g.num_queries for g in plan.groups) >= sum(extend_lens)
    for g in plan.groups:
        assert g.slots.numel() == g.size * g.num_keys
    if reqs is UNIFORM:
        assert len(plan.groups) == 1 and plan.groups[0].query_index is None and plan.output_index is None
        assert plan.groups[0].mask is None
    else:
        assert plan.output_index is not None
    if reqs is RAGGED:
        assert all(g.mask is None for g in plan.groups)
        assert len(plan.groups) < len(reqs)  # batched, not one call per request
    if reqs is PREFIXED:
        assert any(g.mask is not None for g in plan.groups)
    total_padded = sum(g.size * g.num_queries * g.num_keys for g in plan.groups)
    total_real = sum(p * n + n * n for p, n in reqs)
    assert total_padded <= MAX_PADDED_WASTE * total_real
