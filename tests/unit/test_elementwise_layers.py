"""The per-layer elementwise ops (RMSNorm with its residual add, rotary embedding,
SiLU-and-mul) against the plain formulas Hugging Face's Llama computes: equal in float32
and in bfloat16 where the rounding steps are the same, within bfloat16's rounding where
only the tables' rounding differs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tandem.layers.activation import SiluAndMul
from tandem.layers.layernorm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


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
def test_rms_norm_equals_hf_formula(dtype):
    torch.manual_seed(0)
    norm = make_norm(96, dtype)
    for rows in (1, 5, 300):
        x = (3 * torch.randn(rows, 96)).to(dtype)
        out = norm(x)
        assert out.dtype == dtype
        assert torch.equal(out, hf_rms_norm(x, norm.weight, norm.eps))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_adds_then_normalizes(dtype):
    """`norm(x, residual)` is `(norm(x + residual), x + residual)`, the sum in `dtype`
    taken in place into `x` (a sublayer's fresh output); `residual` is left as it was."""
    torch.manual_seed(1)
    norm = make_norm(64, dtype)
    x, residual = torch.randn(7, 64).to(dtype), torch.randn(7, 64).to(dtype)
    x0, residual0 = x.clone(), residual.clone()
    out, new_residual = norm(x, residual)
    expected_sum = residual0 + x0
    assert torch.equal(new_residual, expected_sum)
    assert torch.equal(out, hf_rms_norm(expected_sum, norm.weight, norm.eps))
    assert new_residual.data_ptr() == x.data_ptr() and torch.equal(residual, residual0)


def test_rms_norm_over_heads():
    """Qwen3's per-head q/k norm: the last axis of a [tokens, heads, head_dim] view."""
    torch.manual_seed(2)
    norm = make_norm(16, torch.float32)
    qkv = torch.randn(3, 10 * 16)
    q = qkv[:, : 6 * 16].view(3, 6, 16)  # a strided view, as LlamaAttention passes it
    assert torch.equal(norm(q), hf_rms_norm(q, norm.weight, norm.eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def cos_sin(rope: RotaryEmbedding, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The table's cos and sin in Hugging Face's form (sin unsigned), [tokens, 1, dim]."""
    table = rope.cos_sin_cache[positions]
    half = rope.rotary_dim // 2
    return table[:, 0].unsqueeze(1), table[:, 1, half:].repeat(1, 2).unsqueeze(1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_equals_rotate_half_formula(dtype):
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
def test_rotary_close_to_transformers(dtype, tol):
    """Against transformers' own LlamaRotaryEmbedding + apply_rotary_pos_emb, whose tables
    are computed in float32 (ours in float64, rounded; float32 angles drift by ~1e-4 at
    position 2047): equal up to the tables' rounding."""
    torch.manual_seed(4)
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=2048,
                         rope_theta=10000.0)
    positions = torch.tensor([0, 3, 64, 1000, 2047])
    q = torch.randn(5, 4, 64).to(dtype)
    k = torch.randn(5, 2, 64).to(dtype)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions.unsqueeze(0))
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos, sin)
    rope = RotaryEmbedding(64, 64, 2048, 10000.0, dtype=dtype)
    out = rope(positions, torch.cat([q, k], dim=1))  # a copy: q and k stay as they were
    torch.testing.assert_close(out[:, :4], ref_q[0].transpose(0, 1), atol=tol, rtol=tol)
    torch.testing.assert_close(out[:, 4:], ref_k[0].transpose(0, 1), atol=tol, rtol=tol)


def test_partial_rotary_keeps_the_rest():
    torch.manual_seed(5)
    rope = RotaryEmbedding(64, 32, 128, 10000.0, dtype=torch.float32)
    x, positions = torch.randn(4, 3, 64), torch.tensor([1, 2, 50, 127])
    out = rope(positions, x.clone())
    cos, sin = cos_sin(rope, positions)
    assert torch.equal(out[..., 32:], x[..., 32:])
    assert torch.equal(out[..., :32], x[..., :32] * cos + rotate_half(x[..., :32]) * sin)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_formula(dtype):
    torch.manual_seed(6)
    gate_up = (2 * torch.randn(11, 2 * 40)).to(dtype)
    before = gate_up.clone()
    out = SiluAndMul()(gate_up)
    gate, up = before.chunk(2, dim=-1)
    assert out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, F.silu(gate) * up)
    assert torch.equal(gate_up, before)
