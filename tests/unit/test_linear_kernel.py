"""Linear kernels (`--linear-backend`): the packed oneDNN kernel equals F.linear, the
layers free or keep their weight as told, and the tied LM head still shares the
embedding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.layers.linear import ColumnParallelLinear, RowParallelLinear
from tandem.layers.linear_kernel import PADDED_ROWS, PackedCpuLinear, can_pack, make_linear_kernel
from tandem.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

needs_onednn = pytest.mark.skipif(
    not can_pack(torch.empty(2, 2)), reason="this PyTorch build has no oneDNN linear on CPU"
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_equals_f_linear(rows, with_bias):
    torch.manual_seed(rows)
    w = torch.randn(96, 80)
    b = torch.randn(96) if with_bias else None
    x = torch.randn(rows, 80)
    kernel = PackedCpuLinear(w, b)
    torch.testing.assert_close(kernel(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # Leading dims and non-contiguous inputs.
    x3 = torch.randn(2, rows, 160)[..., ::2]
    torch.testing.assert_close(kernel(x3), F.linear(x3, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    not can_pack(torch.empty(2, 2, dtype=torch.bfloat16)),
    reason="oneDNN packs no bfloat16 weight here (it needs AVX-512 or AVX-NE-CONVERT)",
)
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_packed_bfloat16_close_to_f_linear(rows):
    torch.manual_seed(0)
    w, x = torch.randn(64, 48, dtype=torch.bfloat16), torch.randn(rows, 48, dtype=torch.bfloat16)
    out = PackedCpuLinear(w)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 64)
    torch.testing.assert_close(out.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)


@needs_onednn
@pytest.mark.parametrize("rows, run_rows", [(1, PADDED_ROWS), (2, PADDED_ROWS), (3, 3), (16, 16)])
def test_one_or_two_rows_run_padded(rows, run_rows, monkeypatch):
    """1-2 rows run through oneDNN as PADDED_ROWS zero-padded rows (its faster kernel);
    the caller gets its own rows only, bias included."""
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 80), torch.randn(96), torch.randn(rows, 80)
    kernel = PackedCpuLinear(w, b)
    run, matmul = [], PackedCpuLinear._matmul
    monkeypatch.setattr(PackedCpuLinear, "_matmul", lambda self, x2: run.append(x2.shape[0]) or matmul(self, x2))
    out = kernel(x)
    assert run == [run_rows]
    assert out.shape == (rows, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_backend_choice():
    w = torch.randn(8, 4)
    assert make_linear_kernel(w, None, "torch") is None
    assert make_linear_kernel(w.to(torch.float16), None, "auto") is None  # not packable: F.linear
    with pytest.raises(ValueError, match="linear-backend"):
        make_linear_kernel(w, None, "fast")


@needs_onednn
def test_layers_free_the_weight_unless_kept():
    torch.manual_seed(0)
    col = ColumnParallelLinear(16, 24, bias=True)
    row = RowParallelLinear(24, 16, bias=True)
    for layer in (col, row):
        layer.weight.data.normal_()
        layer.bias.data.normal_()
    x = torch.randn(3, 16)
    expected = F.linear(F.linear(x, col.weight, col.bias), row.weight, row.bias)
    col.process_weights_after_loading("auto")
    row.process_weights_after_loading("auto")
    assert col.weight.numel() == 0 and row.weight.numel() == 0  # the packed copy is the only one
    torch.testing.assert_close(row(col(x)), expected, rtol=1e-5, atol=1e-5)

    head = ParallelLMHead(10, 16)
    embed = VocabParallelEmbedding(10, 16)
    embed.weight.data.normal_()
    head.weight = embed.weight
    head.process_weights_after_loading("auto", keep_weight=True)
    assert head.weight is embed.weight and embed.weight.shape == (10, 16)
    torch.testing.assert_close(head(x), F.linear(x, embed.weight), rtol=1e-5, atol=1e-5)


def test_torch_backend_keeps_f_linear():
    layer = ColumnParallelLinear(4, 6)
    layer.weight.data.normal_()
    layer.process_weights_after_loading("torch")
    assert layer.kernel is None and layer.weight.shape == (6, 4)
    x = torch.randn(2, 4)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
