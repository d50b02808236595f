"""Tandem's C++ CPU decode attention (tandem/kernels/csrc/decode_attention_cpu.cpp) against
a float64 softmax attention: dtypes, head sizes (compile-time and run-time paths), grouped
and plain heads, ragged lengths around its 16-key blocks, slots scattered in the pool, a
query that is a view into a wider tensor (the checks: tests/decode_attention_checks.py), also
on builds for CPUs without AVX-512 or without its bfloat16 dot products; and the torch-native
backend uses it on CPU."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest
import torch
from decode_attention_checks import (
    DTYPES,
    LENGTHS,
    SHAPES,
    check_decode_attention,
    make_pool,
    reference,
)
from kernel_variants import run_variant

from tandem.forward_batch import ForwardBatch, ForwardMode
from tandem.kernels import cpu as cpu_kernels
from tandem.layers.attention.torch_native import TorchNativeAttnBackend

HAS_COMPILER = bool(shutil.which("c++") or shutil.which("g++"))
ops = cpu_kernels.load()
needs_kernel = pytest.mark.skipif(ops is None, reason="Tandem's C++ CPU kernels could not be built here")


def test_kernels_build_where_a_compiler_exists():
    """A machine with a C++ compiler must get the kernels (a broken build would otherwise
    only show as a slower server)."""
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler: the PyTorch fallback runs (tests/unit/test_torch_native_attention.py)")
    assert ops is not None
    for name in ("decode_attention", "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"):
        assert hasattr(ops, name), name


def test_a_failing_build_raises_with_the_compiler_errors(tmp_path, monkeypatch):
    """`build` into an empty cache runs the compiler; its failure raises (and `load` then
    falls back to PyTorch) instead of leaving a partial library behind."""
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    with pytest.raises(RuntimeError, match="false failed"):
        cpu_kernels.build()
    assert list(tmp_path.iterdir()) == []


@needs_kernel
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("num_heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("seq_lens,threads", list(LENGTHS.values()), ids=list(LENGTHS))
def test_decode_attention_matches_float64(dtype, tol, num_heads, kv_heads, head_dim, seq_lens, threads):
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        check_decode_attention(ops, dtype, tol, num_heads, kv_heads, head_dim, seq_lens)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.slow  # compiles the kernel once more for each variant
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the variants are x86-64 builds")
@pytest.mark.parametrize("march", ["x86-64-v3", "skylake-avx512"])
def test_decode_attention_builds_for_other_cpus(march):
    """A CPU with AVX2 and no AVX-512 (the generic vector code of every dtype, float32 values
    and prefill attention by explicit AVX2 halves), and AVX-512 without its bfloat16 dot products
    (bfloat16 keys widened, values in pairs of lanes): where this machine's build runs other
    paths, those builds of the decode and prefill kernels (in a subprocess: their ops have the
    same names) pass the same checks."""
    if march == "skylake-avx512" and "avx512bw" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU runs no AVX-512 code")
    assert run_variant("decode_attention_checks.py", march) == ["ok"]


def one_request_args() -> tuple:
    """The attention kernels' leading arguments after q (k, v, req_to_token, req_pool_indices)
    for a pool of one 4-token request, 2 KV heads of 64, float32."""
    kv, rows, per_req = make_pool([4], 4, 2, 64, torch.float32)
    return kv.k_buffer[0], kv.v_buffer[0], rows.req_to_token, torch.tensor([per_req[0][0]])


@needs_kernel
def test_decode_attention_refuses_bad_input():
    q = torch.randn(1, 4, 64)
    args = one_request_args()
    with pytest.raises(RuntimeError, match="int64"):
        ops.decode_attention(q, *args, torch.tensor([4], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.decode_attention(q.bfloat16(), *args, torch.tensor([4]), 0.125)
    with pytest.raises(RuntimeError, match="multiple of the KV heads|times the KV heads"):
        ops.decode_attention(torch.randn(1, 3, 64), *args, torch.tensor([4]), 0.125)


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_backend_decodes_with_the_kernel(dtype, tol):
    """On CPU the backend's decode (and a mixed batch's decode rows) run the kernel, with no
    KV table built; outputs equal the float64 reference."""
    seq_lens, num_heads, kv_heads, head_dim = [7, 30, 19], 12, 4, 64
    kv, rows, per_req = make_pool(seq_lens, num_heads, kv_heads, head_dim, dtype)
    backend = TorchNativeAttnBackend(rows, kv, num_heads=num_heads)
    assert backend.decode_kernel is not None
    q = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype)
    n = len(seq_lens)
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=n,
        input_ids=torch.zeros(n, dtype=torch.int64),
        positions=torch.zeros(n, dtype=torch.int64),
        out_cache_loc=torch.zeros(n, dtype=torch.int64),
        req_pool_indices=torch.tensor([r[0] for r in per_req]),
        seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=[s - 1 for s in seq_lens],
        extend_lens_cpu=[1] * n,
    )
    backend.init_forward_metadata(fb)
    assert backend.forward_metadata is None
    out = backend.forward(q.reshape(n, -1), 0, fb, head_dim**-0.5, num_heads, kv_heads, head_dim)
    torch.testing.assert_close(out.double(), reference(q, per_req, head_dim**-0.5), atol=tol, rtol=tol)
