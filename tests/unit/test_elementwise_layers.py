"""The per-layer elementwise ops (RMSNorm with its residual add, rotary embedding,
SiLU-and-mul) against the plain formulas Hugging Face's Llama computes, in both of their
implementations (`impl`): Tandem's C++ CPU kernels and the PyTorch code that runs without
them. PyTorch's: equal in float32 and bfloat16 where the rounding steps are the same,
within bfloat16's rounding where only the tables' rounding differs. The kernels: the
rotary embedding equal; RMSNorm and SiLU-and-mul within float32's last bits (another
summation order, another exp), which rounding to bfloat16 or float16 almost always hides.
All run under inference mode, as the model does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tandem.kernels import cpu as cpu_kernels
from tandem.layers.activation import SiluAndMul
from tandem.layers.layernorm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=["kernel", "pytorch"], autouse=True)
def impl(request, monkeypatch):
    """Which implementation the layers run: the C++ kernels, or PyTorch's ops."""
    if request.param == "kernel" and cpu_kernels.load() is None:
        pytest.skip("Tandem's C++ CPU kernels could not be built here")
    if request.param == "pytorch":
        monkeypatch.setattr(cpu_kernels, "ops_for", lambda *tensors: None)
    with torch.inference_mode():
        yield request.param


def assert_matches(out: torch.Tensor, expected: torch.Tensor, impl: str) -> None:
    """Bit for bit from PyTorch's ops; from a kernel, float32 within its last bits, and
    bfloat16/float16 at most one unit in the last place apart and equal almost everywhere."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if impl == "pytorch":
        assert torch.equal(out, expected)
    elif out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    else:
        ulp = torch.finfo(out.dtype).eps
        torch.testing.assert_close(out.float(), expected.float(), rtol=ulp, atol=1e-6)
        assert (out == expected).float().mean() > 0.99


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def make_norm(hidden: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden))
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_hf_formula(dtype, impl):
    torch.manual_seed(0)
    for width in (96, 768, 20):  # whole 16-element blocks, and a tail
        norm = make_norm(width, dtype)
        for rows in (1, 5, 300):  # 300 rows: split over threads
            x = (3 * torch.randn(rows, width)).to(dtype)
            assert_matches(norm(x), hf_rms_norm(x, norm.weight, norm.eps), impl)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_adds_then_normalizes(dtype, impl):
    """`norm(x, residual)` is `(norm(x + residual), x + residual)`, the sum in `dtype`
    taken in place into `x` (a sublayer's fresh output); `residual` is left as it was."""
    torch.manual_seed(1)
    norm = make_norm(64, dtype)
    x, residual = torch.randn(7, 64).to(dtype), torch.randn(7, 64).to(dtype)
    x0, residual0 = x.clone(), residual.clone()
    out, new_residual = norm(x, residual)
    expected_sum = residual0 + x0
    assert torch.equal(new_residual, expected_sum)
    assert_matches(out, hf_rms_norm(expected_sum, norm.weight, norm.eps), impl)
    assert new_residual.data_ptr() == x.data_ptr() and torch.equal(residual, residual0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_over_heads(dtype, impl):
    """Qwen3's per-head q/k norm: the last axis of a [tokens, heads, head_dim] view."""
    torch.manual_seed(2)
    norm = make_norm(16, dtype)
    qkv = torch.randn(3, 10 * 16).to(dtype)
    q = qkv[:, : 6 * 16].view(3, 6, 16)  # a strided view, as models/base.Attention passes it
    assert_matches(norm(q), hf_rms_norm(q, norm.weight, norm.eps), impl)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def cos_sin(rope: RotaryEmbedding, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The table's cos and sin in Hugging Face's form (sin unsigned), [tokens, 1, dim]."""
    table = rope.cos_sin_cache[positions]
    half = rope.rotary_dim // 2
    return table[:, 0].unsqueeze(1), table[:, 1, half:].repeat(1, 2).unsqueeze(1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_equals_rotate_half_formula(dtype, impl):
    """q and k rotated in one call, in place on adjacent views of a QKV output, equal
    Hugging Face's `q * cos + rotate_half(q) * sin` on the same cos/sin, in the table's
    dtype; the V part of the output is untouched."""
    torch.manual_seed(3)
    heads, kv_heads, dim = 6, 2, 32
    rope = RotaryEmbedding(dim, dim, 512, 10000.0, dtype=dtype)
    assert rope.cos_sin_cache.dtype == dtype
    qkv = torch.randn(9, (heads + 2 * kv_heads) * dim).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].view(9, heads + kv_heads, dim)
    positions = torch.tensor([0, 1, 2, 7, 100, 101, 300, 511, 5])
    qkv0 = qkv.clone()
    qk0 = qk.clone()
    out = rope(positions, qk)
    cos, sin = cos_sin(rope, positions)
    assert out.data_ptr() == qkv.data_ptr() and out.dtype == dtype
    assert torch.equal(out, qk0 * cos + rotate_half(qk0) * sin)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], qkv0[:, (heads + kv_heads) * dim :])
    q, k = qk0.clone().split([heads, kv_heads], dim=1)  # separate calls: the same values
    assert torch.equal(torch.cat([rope(positions, q), rope(positions, k)], dim=1), out)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 2e-2)])
def test_rotary_close_to_transformers(dtype, tol, impl):
    """Against transformers' own LlamaRotaryEmbedding + apply_rotary_pos_emb, whose tables
    are computed in float32 (ours in float64, rounded; float32 angles drift by ~1e-4 at
    position 2047): equal up to the tables' rounding."""
    torch.manual_seed(4)
    config = LlamaConfig(
        hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=2048, rope_theta=10000.0
    )
    positions = torch.tensor([0, 3, 64, 1000, 2047])
    q = torch.randn(5, 4, 64).to(dtype)
    k = torch.randn(5, 2, 64).to(dtype)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions.unsqueeze(0))
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos, sin)
    rope = RotaryEmbedding(64, 64, 2048, 10000.0, dtype=dtype)
    out = rope(positions, torch.cat([q, k], dim=1))  # a copy: q and k stay as they were
    torch.testing.assert_close(out[:, :4], ref_q[0].transpose(0, 1), atol=tol, rtol=tol)
    torch.testing.assert_close(out[:, 4:], ref_k[0].transpose(0, 1), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_rotary_keeps_the_rest(dtype, impl):
    torch.manual_seed(5)
    rope = RotaryEmbedding(64, 32, 128, 10000.0, dtype=dtype)
    x, positions = torch.randn(4, 3, 64).to(dtype), torch.tensor([1, 2, 50, 127])
    out = rope(positions, x.clone())
    cos, sin = cos_sin(rope, positions)
    assert torch.equal(out[..., 32:], x[..., 32:])
    assert torch.equal(out[..., :32], x[..., :32] * cos + rotate_half(x[..., :32]) * sin)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_formula(dtype, impl):
    torch.manual_seed(6)
    for rows, d in ((11, 40), (64, 2816), (3, 8)):
        gate_up = (4 * torch.randn(rows, 2 * d)).to(dtype)
        gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # exp's clamps
        before = gate_up.clone()
        out = SiluAndMul()(gate_up)
        gate, up = before.chunk(2, dim=-1)
        assert out.is_contiguous()
        assert_matches(out, F.silu(gate) * up, impl)
        assert torch.equal(gate_up, before)


def test_kernels_refuse_what_they_do_not_take():
    """Called directly, the kernels name what is wrong instead of reading out of bounds;
    the layers send such tensors to PyTorch's ops instead."""
    ops = cpu_kernels.load()
    if ops is None:
        pytest.skip("no kernels here")
    x = torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.rms_norm(x, torch.ones(32, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(x, torch.ones(16), 1e-5)
    with pytest.raises(RuntimeError, match="one shape"):
        ops.fused_add_rms_norm(x, torch.randn(4, 16), torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous last axis"):
        ops.silu_and_mul(x.t())
    with pytest.raises(RuntimeError, match="rot even"):
        ops.rotary_embedding(x.view(4, 1, 32), torch.randn(4, 2, 48))
    assert cpu_kernels.ops_for(x, torch.ones(32, dtype=torch.float64)) is None
    assert cpu_kernels.ops_for(x.to(torch.float64)) is None
