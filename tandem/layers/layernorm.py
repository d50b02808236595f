"""RMSNorm as Llama/Qwen define it, and Gemma's (`1 + weight`), with the residual add folded
into the call (SGLang's `RMSNorm.forward(x, residual)`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import cpu as cpu_kernels


class RMSNorm(nn.Module):
    """`forward(x)`: `x / sqrt(mean(x^2) + eps) * weight`, computed in float32 as Hugging
    Face does. `forward(x, residual)`: `(norm(x + residual), x + residual)`, the sum in the
    model's dtype as Hugging Face's residual add, returned to be the next residual. The
    sum is taken in place into `x`, a sublayer's fresh output that no one else holds
    (saves a new tensor per add, and at prefill its page faults); `residual` is unchanged.

    On CPU, Tandem's C++ kernels (tandem/kernels/csrc/elementwise_cpu.cpp) add and
    normalize in one pass over each row; they sum the squares in another order than
    PyTorch (results within float32's last bits; in bfloat16 and float16 the rounding to
    the dtype hides that almost always). Elsewhere, or without the kernels: one call of
    `torch.nn.functional.rms_norm`, which returns `x * rsqrt(...)` rounded to `x`'s dtype,
    the weight applied after, in place, in `x`'s dtype, as Hugging Face rounds before it
    scales: the result equals Hugging Face's bit for bit in float32 and bfloat16."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        ops = cpu_kernels.ops_for(x, residual, self.weight)
        if (
            ops is not None
            and x.dim() in (2, 3)
            and x.shape == residual.shape
            and x.stride(-1) == residual.stride(-1) == 1
        ):
            return ops.fused_add_rms_norm(x, residual, self.weight, self.eps), x
        x = x.add_(residual)
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_kernels.ops_for(x, self.weight)
        if ops is not None and x.dim() in (2, 3) and x.stride(-1) == 1:
            return ops.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), None, self.eps).mul_(self.weight)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm (transformers' `Gemma2RMSNorm` / `Gemma3RMSNorm`): `x / sqrt(mean(x^2)
    + eps) * (1 + weight)`, all of it in float32 and rounded to `x`'s dtype once at the end
    (Llama rounds before it scales); the checkpoint's weight is the offset from 1.
    `forward(x, residual)` as `RMSNorm`'s: the sum (in the model's dtype, in place into `x`)
    normalized, and the sum, the next residual. PyTorch ops on every device."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x.add_(residual)
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)
