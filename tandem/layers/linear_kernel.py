"""How a linear layer multiplies: `y = x @ W.T (+ b)` with the weight in the best layout
for its device, chosen once after the weights are loaded (`--linear-backend`).

- `torch`: `F.linear` on the weight as loaded (row-major [out, in]).
- `auto`: on CPU, where PyTorch has oneDNN and the dtype is float32 or bfloat16, the
  weight is reordered once into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`)
  and every call runs `mkldnn._linear_pointwise` on it, as vLLM's CPU backend does with
  its prepacked oneDNN matmuls. Decode multiplies a few rows by every weight each step,
  so the weight layout decides the speed: measured on 2 EPYC cores (`bench_one_batch`,
  docs/perf-log/peers.md), a decode step of a 100M-parameter Llama takes 38-42 ms instead of
  69-75 ms at batch 16, and 23-27 ms instead of 33-38 ms at batch 1.
  Inputs of 1 or 2 rows run as `PADDED_ROWS` (4), padded with zero rows: oneDNN's
  kernels for 1 or 2 rows read the weight more slowly than its kernel for 4 (measured on
  the 100M model's decode linears, one thread: 1 row 8-18% and 2 rows 17-34% slower than
  4 rows; 3 rows as fast as 4; docs/perf-log/cpu-decode.md, "Linear kernels").
  Elsewhere (CUDA, other dtypes, no oneDNN, bfloat16 on a CPU whose oneDNN path lacks the
  ISA for it) `auto` is `torch`.

Results equal `F.linear`'s to float rounding (the summation order differs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

LinearKernel = Callable[[torch.Tensor], torch.Tensor]

LINEAR_BACKENDS = ("auto", "torch")
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Batch size hint oneDNN picks the weight's blocking for; the decode batches that matter
# (measured: 4-64 rows do as well with 32 as with their own size; a hint of 1 slows 4+ rows).
_PACK_BATCH_HINT = 32
# Inputs of at most SMALL_ROWS rows run padded to PADDED_ROWS (see the module docstring).
SMALL_ROWS = 2
PADDED_ROWS = 4


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `auto` packs this weight: a 2-D CPU float32/bfloat16 tensor, oneDNN built in
    and packing that dtype on this CPU (its bfloat16 path needs AVX-512 or AVX-NE-CONVERT)."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in _PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and _onednn_packs(weight.dtype)
    )


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """oneDNN reorders a weight of `dtype` here (probed once: it refuses by the CPU's ISA)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), _PACK_BATCH_HINT)
    except RuntimeError:
        return False
    return True


class PackedCpuLinear:
    """`x @ W.T (+ b)` with W held only in oneDNN's blocked layout (x: [..., in])."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        if 0 < rows <= SMALL_ROWS:
            padded = x2.new_zeros(PADDED_ROWS, self.in_features)
            padded[:rows] = x2
            out = self._matmul(padded)[:rows]
        else:
            out = self._matmul(x2 if x2.is_contiguous() else x2.contiguous())
        return out.view(*lead, self.out_features)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")


def make_linear_kernel(weight: torch.Tensor, bias: torch.Tensor | None, backend: str) -> LinearKernel | None:
    """The packed kernel for `weight` under `backend`, or None where `F.linear` on the
    weight as loaded is the kernel (backend `torch`, or a weight `auto` cannot pack)."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"--linear-backend: unknown backend {backend!r}")
    if backend == "torch" or not can_pack(weight):
        return None
    try:
        return PackedCpuLinear(weight, bias)
    except RuntimeError:  # a build whose oneDNN refuses this shape or dtype
        return None
