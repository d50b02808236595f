"""SiLU-and-mul, the gated activation of Llama-family MLPs (SGLang's `SiluAndMul`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """`silu(x[..., :d]) * x[..., d:]` for `x` of width `2 * d` (the fused gate/up
    projection's output): two kernels, one new tensor ([..., d], contiguous); the product
    is taken in place on the SiLU's output. Rounding as Hugging Face's `act_fn(gate) * up`
    (each op rounds to the input's dtype)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]).mul_(x[..., d:])
