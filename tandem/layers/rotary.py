"""Rotary position embedding (the "rotate halves" layout of Hugging Face Llama/Qwen).

Supports the `rope_scaling` kinds found in Llama-family configs: none/default, linear,
dynamic (NTK, evaluated at the cache length), and llama3; and per-frequency divisors
(`freq_factors`, how GGUF files store Llama 3.x scaling: llama.cpp's `rope_freqs`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tandem.kernels import cpu as cpu_kernels


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates heads by their token's position ("rotate halves", as Hugging Face Llama).

    `cos_sin_cache` [max_position, 2, rotary_dim] holds each position's cos and signed sin
    over the full rotary width, so that `rotate_half(x) * sin == roll(x, half) * [-sin, sin]`
    (no split and concatenation). The table has `dtype`, by default torch's default dtype,
    which the model runner sets to the model's while it builds the model: Hugging Face
    casts cos and sin to the activations' dtype and rotates in that dtype, so float32
    models rotate in float32 and bfloat16 models in bfloat16, as there.
    """

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict | None = None,
        dtype: torch.dtype | None = None,
        freq_factors: list[float] | None = None,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        positions = torch.arange(max_position, dtype=torch.float64)
        kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if kind == "linear":
            positions = positions / rope_scaling["factor"]
        elif kind == "dynamic":
            factor = rope_scaling["factor"]
            orig = rope_scaling.get("original_max_position_embeddings", max_position)
            if max_position > orig:
                base = base * ((factor * max_position / orig) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
                inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        elif kind not in ("default", None):
            raise ValueError(f"rope_scaling type {kind!r} is not supported")
        if freq_factors is not None:
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float64)
        freqs = torch.outer(positions, inv_freq)
        cos, sin = freqs.cos().float(), freqs.sin().float()  # float32 first, as HF computes them
        table = torch.stack([torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)], dim=1)
        self.register_buffer("cos_sin_cache", table.to(dtype or torch.get_default_dtype()), persistent=False)

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        """Each token's cos and signed sin, [tokens, 2, rotary_dim]: what `rotate` rotates
        by. A model looks them up once per forward for all its layers."""
        return torch.index_select(self.cos_sin_cache, 0, positions)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`rotate(x, lookup(positions))`."""
        return self.rotate(x, self.lookup(positions))

    def rotate(self, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """Rotates `x` in place by `cos_sin` (`lookup`'s) and returns it: [tokens, heads,
        head_dim], any heads of each token (the query and key heads side by side, a view
        of the QKV projection's output, in one call). Per element as Hugging Face:
        `x * cos + rotate_half(x) * sin`, each op rounding to the dtype, bit for bit: on CPU
        in one pass of Tandem's C++ kernel, else in four PyTorch ops."""
        ops = cpu_kernels.ops_for(x, cos_sin)
        if ops is not None and x.dim() == 3 and x.stride(-1) == 1:
            ops.rotary_embedding(x, cos_sin)
            return x
        cos, sin = cos_sin[:, 0].unsqueeze(1), cos_sin[:, 1].unsqueeze(1)  # [tokens, 1, rotary_dim]
        rot = x if self.rotary_dim == x.shape[-1] else x[..., : self.rotary_dim]
        rotated_half = torch.roll(rot, self.rotary_dim // 2, dims=-1).mul_(sin)
        rot.mul_(cos).add_(rotated_half)
        return x
