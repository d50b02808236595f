"""RMSNorm as Llama/Qwen define it, with the residual add folded into the call (SGLang's
`RMSNorm.forward(x, residual)`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """`forward(x)`: `x / sqrt(mean(x^2) + eps) * weight`, computed in float32 as Hugging
    Face does. `forward(x, residual)`: `(norm(x + residual), x + residual)`, the sum in the
    model's dtype as Hugging Face's residual add, returned to be the next residual. The
    sum is taken in place into `x`, a sublayer's fresh output that no one else holds
    (saves a new tensor per add, and at prefill its page faults); `residual` is unchanged.

    The normalization is one call of `torch.nn.functional.rms_norm` (on CPU PyTorch runs
    its composite in C++: the same float32 kernels as the formula, without a Python call
    each). It returns `x * rsqrt(...)` rounded to `x`'s dtype; the weight is applied
    after, in place, in `x`'s dtype, as Hugging Face rounds before it scales: the result
    equals Hugging Face's bit for bit in float32 and bfloat16."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x.add_(residual)
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), None, self.eps).mul_(self.weight)
