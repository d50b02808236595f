"""Rotary position embedding (the "rotate halves" layout of Hugging Face Llama/Qwen).

Supports every `rope_scaling` kind of transformers' `ROPE_INIT_FUNCTIONS` that Llama 3.x,
Qwen2.5 and Phi-3 checkpoints use, with transformers' formulas and defaults:

- `default` / none; `linear` (positions divided by `factor`); `llama3` (per-frequency
  smoothing between `low_freq_factor` and `high_freq_factor`).
- `yarn`: the frequencies blended between interpolation and extrapolation over the
  correction range of `beta_fast` / `beta_slow` (32 / 1 by default) at
  `original_max_position_embeddings`, floored/ceiled unless `truncate` is false; cos and
  sin multiplied by the attention factor (`attention_factor`, else from `mscale` /
  `mscale_all_dim`, else `0.1 * ln(factor) + 1`), as transformers does.
- `dynamic` (NTK): transformers recomputes the base whenever one forward's sequence grows
  beyond `max_position_embeddings` (and uses the plain base below it), which a server
  batching sequences of different lengths over one KV cache cannot do: a key's rotation
  must not change once it is cached. Tandem does what SGLang does
  (`DynamicNTKScalingRotaryEmbedding`): one table, its base scaled once for the longest
  sequence, `max_position_embeddings * factor` positions long. It therefore equals
  transformers' table for a sequence of exactly that length, not for shorter ones.
- `longrope` (Phi-3 128k): `short_factor` for positions below
  `original_max_position_embeddings`, `long_factor` from there on, cos and sin times the
  attention factor (`attention_factor`, else `sqrt(1 + ln(f) / ln(original))` with `f`
  = `factor` or `max_position_embeddings / original_max_position_embeddings`). Chosen
  per position, so a position's rotation never depends on its batch (the radix cache and
  chunked prefill reuse cached keys): this equals transformers for every sequence up to
  the original length, and from there on for each new position. transformers instead
  picks one set per forward by its longest sequence (a prompt longer than the original
  length is rotated with `long_factor` throughout, and Phi-3's generate re-runs the whole
  sequence with it once it crosses that length); SGLang/vLLM pick the long set for the
  whole batch when any position in it is beyond the original length.

Also per-frequency divisors (`freq_factors`, how GGUF files store Llama 3.x scaling:
llama.cpp's `rope_freqs`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tandem.kernels import cpu as cpu_kernels


def _inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(base: float, rotary_dim: int, max_position: int, scaling: dict) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention factor) of YaRN, as transformers' `_compute_yarn_parameters`."""
    orig = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / orig
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # the share of each frequency left unscaled
    inv_freq = _inv_freq(base, rotary_dim)
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, float(attention)


def _longrope_attention_factor(max_position: int, scaling: dict) -> float:
    attention = scaling.get("attention_factor")
    if attention is not None:
        return float(attention)
    orig = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / orig
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


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
        scaling = rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        inv_freq = _inv_freq(base, rotary_dim)
        positions = torch.arange(max_position, dtype=torch.float64)
        attention = 1.0  # cos and sin multiplied by it (yarn, longrope)
        long_inv_freq = None  # longrope: the frequencies from original_max_position_embeddings on
        if kind == "linear":
            positions = positions / scaling["factor"]
        elif kind == "dynamic":  # SGLang's: one base, for the longest sequence (module docstring)
            factor = scaling["factor"]
            longest = int(max_position * factor)
            base = base * ((factor * longest / max_position) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
            inv_freq = _inv_freq(base, rotary_dim)
            positions = torch.arange(max(longest, max_position), dtype=torch.float64)
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "yarn":
            inv_freq, attention = _yarn(base, rotary_dim, max_position, scaling)
        elif kind == "longrope":
            attention = _longrope_attention_factor(max_position, scaling)
            long_inv_freq = inv_freq / torch.tensor(scaling["long_factor"], dtype=torch.float64)
            inv_freq = inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float64)
        elif kind not in ("default", None):
            raise ValueError(f"rope_scaling type {kind!r} is not supported")
        if freq_factors is not None:
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float64)
        freqs = torch.outer(positions, inv_freq)
        if long_inv_freq is not None:  # per position: short below the original length, long from it on
            orig = scaling["original_max_position_embeddings"]
            freqs[orig:] = torch.outer(positions[orig:], long_inv_freq)
        cos, sin = freqs.cos().float(), freqs.sin().float()  # float32 first, as HF computes them
        if attention != 1.0:
            cos, sin = cos * attention, sin * attention  # in float32, as HF
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
