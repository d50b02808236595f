"""The gated activations of the MLPs: SiLU-and-mul (Llama families, SGLang's `SiluAndMul`) and
GELU(tanh)-and-mul (Gemma's `gelu_pytorch_tanh`, SGLang's `GeluAndMul`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import cpu as cpu_kernels


class SiluAndMul(nn.Module):
    """`silu(x[..., :d]) * x[..., d:]` for `x` of width `2 * d` (the fused gate/up
    projection's output) into one new tensor ([..., d], contiguous), rounding as Hugging
    Face's `act_fn(gate) * up` (each op rounds to the input's dtype). On CPU one pass of
    Tandem's C++ kernel (its exp may differ from PyTorch's in float32's last bit); else
    two PyTorch kernels, the product taken in place on the SiLU's output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_kernels.ops_for(x)
        if ops is not None and x.dim() == 2 and x.stride(-1) == 1:
            return ops.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]).mul_(x[..., d:])


class GeluTanhAndMul(nn.Module):
    """`gelu(x[..., :d], approximate="tanh") * x[..., d:]` (transformers' `gelu_pytorch_tanh`
    gate times up, each op rounding to the input's dtype), in two PyTorch kernels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh").mul_(x[..., d:])
