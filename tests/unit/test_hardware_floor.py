"""The decode floor counts every linear weight (packed or not) and the batch's KV once."""

from __future__ import annotations

import torch
from torch import nn

from tandem.benchmarks.hardware_floor import decode_floor, linear_weight_elements
from tandem.layers.linear import ColumnParallelLinear


def two_linears(backend: str) -> nn.Module:
    model = nn.Sequential(ColumnParallelLinear(64, 32), ColumnParallelLinear(32, 16))
    for layer in model:
        layer.weight.data.normal_()
        layer.process_weights_after_loading(backend)
    return model


def test_packed_and_plain_weights_count_the_same():
    assert linear_weight_elements(two_linears("torch")) == 64 * 32 + 32 * 16
    assert linear_weight_elements(two_linears("auto")) == 64 * 32 + 32 * 16


def test_floor_is_the_slower_of_bytes_and_flops():
    model = two_linears("torch")
    weights = 64 * 32 + 32 * 16
    seq_lens = [10, 20]  # 2 layers, 1 KV head of dim 4, 2 query heads, float32
    kv_bytes = 30 * 2 * 2 * 1 * 4 * 4
    flops = 2 * 2 * weights + 4 * 30 * 2 * 2 * 4
    memory_bound = decode_floor(model, torch.float32, seq_lens, 2, 2, 1, 4, bandwidth=1.0, matmul_flops=1e30)
    assert memory_bound.bytes_read == weights * 4 + kv_bytes and memory_bound.floor_s == weights * 4 + kv_bytes
    compute_bound = decode_floor(model, torch.float32, seq_lens, 2, 2, 1, 4, bandwidth=1e30, matmul_flops=1.0)
    assert compute_bound.flops == flops and compute_bound.floor_s == flops
