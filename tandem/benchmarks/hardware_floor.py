"""What the hardware allows for one decode step: `bench_one_batch --floor`.

A decode step must read every weight once (the quantized blocks, for layers that multiply
a batch this small by them: `gguf_linear`) and each request's KV cache once, and do
2 FLOPs per dense weight per request plus the attention's 4 * seq_len * heads * head_dim
per request and layer. Its floor is the larger of (bytes / measured memory bandwidth) and
(FLOPs / measured matmul throughput at the batch's row count, in the model's dtype);
the step's latency over that floor says how far the engine is from the machine. The
layers that run quantized count by their bytes only: their integer dot products are not
what `F.linear` measures, and at these row counts the bytes bound them.

Bandwidth is measured by summing a buffer far larger than the caches, matmul throughput
by `F.linear` of the batch's rows against a 1024 x 1024 weight that stays in cache (so
that a few rows measure the arithmetic, not the memory again); each is the best of a few
tries, with the thread count the step runs with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.linear import LinearBase

_BANDWIDTH_BYTES = 512 * 2**20
_MATMUL_DIM = 1024
_TRIES = 5


@dataclass(frozen=True)
class DecodeFloor:
    """One decode step's work and its lower bound on this machine."""

    bytes_read: int
    flops: int
    bandwidth: float  # bytes/s
    matmul_flops: float  # FLOP/s
    floor_s: float


def _best_time(fn) -> float:
    fn()
    best = float("inf")
    for _ in range(_TRIES):
        tic = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - tic)
    return best


def measure_bandwidth() -> float:
    """Read bandwidth (bytes/s) of summing a 512 MiB buffer."""
    buf = torch.ones(_BANDWIDTH_BYTES // 4, dtype=torch.float32)
    return _BANDWIDTH_BYTES / _best_time(lambda: buf.sum())


def measure_matmul_flops(rows: int, dtype: torch.dtype) -> float:
    """FLOP/s of `F.linear` with `rows` rows against a cache-resident 1024 x 1024 weight in `dtype`."""
    x = torch.randn(rows, _MATMUL_DIM).to(dtype)
    w = torch.randn(_MATMUL_DIM, _MATMUL_DIM).to(dtype)
    return 2 * rows * _MATMUL_DIM * _MATMUL_DIM / _best_time(lambda: F.linear(x, w))


def dense_weight_elements(model: nn.Module, rows: int) -> int:
    """Weights a step of `rows` rows multiplies in the model's dtype (not quantized)."""
    return sum(
        _dense_elements(m)
        for m in model.modules()
        if isinstance(m, LinearBase) and not (m.quant_kernel is not None and rows <= m.quant_kernel.max_rows)
    )


def linear_weight_bytes(model: nn.Module, rows: int, element_size: int) -> int:
    """Bytes of weights a step of `rows` rows reads: each layer's quantized blocks where it
    multiplies that many rows by them, else its dense weights."""
    total = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            if module.quant_kernel is not None and rows <= module.quant_kernel.max_rows:
                total += module.quant_kernel.nbytes()
            else:
                total += _dense_elements(module) * element_size
    return total


def _dense_elements(module: LinearBase) -> int:
    kernel = module.kernel
    return (
        kernel.out_features * kernel.in_features
        if kernel is not None and module.weight.numel() == 0
        else module.weight.numel()
    )


def decode_floor(
    model: nn.Module,
    dtype: torch.dtype,
    seq_lens: list[int],
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    bandwidth: float,
    matmul_flops: float,
    kv_dtype: torch.dtype | None = None,
) -> DecodeFloor:
    """The floor of one decode step of requests with KV lengths `seq_lens` (the KV cache in
    `kv_dtype`, `dtype` when None)."""
    size = torch.tensor([], dtype=dtype).element_size()
    weights = dense_weight_elements(model, len(seq_lens))
    tokens = sum(seq_lens)
    kv_size = size if kv_dtype is None else torch.tensor([], dtype=kv_dtype).element_size()
    kv_bytes = tokens * num_layers * 2 * num_kv_heads * head_dim * kv_size
    bytes_read = linear_weight_bytes(model, len(seq_lens), size) + kv_bytes
    flops = 2 * len(seq_lens) * weights + 4 * tokens * num_layers * num_heads * head_dim
    floor_s = max(bytes_read / bandwidth, flops / matmul_flops)
    return DecodeFloor(bytes_read, flops, bandwidth, matmul_flops, floor_s)
