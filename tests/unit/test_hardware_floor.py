"""The decode floor counts every linear weight (packed or not) and the batch's KV once; a
layer that runs quantized at the batch's row count by its blocks' bytes, with no FLOPs."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from tandem.benchmarks.hardware_floor import decode_floor, dense_weight_elements, linear_weight_bytes
from tandem.kernels import cpu as cpu_kernels
from tandem.layers.linear import ColumnParallelLinear
from tandem.layers.quantization.gguf_linear import QUANT_MAX_ROWS
from tandem.model_executor.gguf_loader import GGUFWeight


def two_linears(backend: str) -> nn.Module:
    model = nn.Sequential(ColumnParallelLinear(64, 32), ColumnParallelLinear(32, 16))
    for layer in model:
        layer.weight.data.normal_()
        layer.process_weights_after_loading(backend)
    return model


def test_packed_and_plain_weights_count_the_same():
    assert dense_weight_elements(two_linears("torch"), 1) == 64 * 32 + 32 * 16
    assert dense_weight_elements(two_linears("auto"), 1) == 64 * 32 + 32 * 16


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


@pytest.mark.skipif(cpu_kernels.load() is None, reason="Tandem's C++ CPU kernels are not built (no compiler)")
def test_a_quantized_layer_counts_its_blocks_for_few_rows():
    layer = ColumnParallelLinear(256, 64)
    blocks = gguf.quants.quantize(
        np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32), gguf.GGMLQuantizationType.Q4_0
    )
    layer.weight_loader(layer.weight, GGUFWeight(blocks, gguf.GGMLQuantizationType.Q4_0, (64, 256)))
    layer.process_weights_after_loading("auto")
    model = nn.Sequential(layer)
    q_bytes = 64 * 128 + 2 * 64 * 8 * 2  # 4-bit values, float16 scale and offset per 32
    assert (
        linear_weight_bytes(model, QUANT_MAX_ROWS, 4) == q_bytes and dense_weight_elements(model, QUANT_MAX_ROWS) == 0
    )
    assert linear_weight_bytes(model, QUANT_MAX_ROWS + 1, 4) == 64 * 256 * 4
    assert dense_weight_elements(model, QUANT_MAX_ROWS + 1) == 64 * 256
