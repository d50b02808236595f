"""The C++ quantized matmul (`tandem_cpu.quant_linear`) and the linear layers that keep GGUF
blocks for it (`tandem.layers.quantization.gguf_linear`):

- against dequantize-then-matmul in float64 on blocks of every type with a layout, odd
  shapes and row counts 1, 2, 3, 6, 17, 64, 300: within 2e-6 of the largest output in float32,
  and, for bfloat16 inputs, within one bfloat16 rounding of the float32 result, where the
  reference's x is first rounded per 32 columns to int8 as llama.cpp does when the build
  takes an int8 path (`quant_linear_isa()`: AVX-512 VNNI, AVX-VNNI or AVX2), and the 8-bit
  layouts' extreme bytes (where AVX2's int16 pair sums could saturate);
- the same checks on the builds for other CPUs (AVX2 without AVX-512, whose bfloat16 rows take
  the AVX2 int8 path; plain x86-64, the float path), each compiled here in a subprocess, so
  those paths run on every x86 machine; the AVX-VNNI build (x86-64-v3 with -mavxvnni) is
  compiled wherever the compiler knows the flag and checked where the CPU has it;
- the same checks given the weight's stored tiles (`quant_tiles`, what the layer keeps at load
  for the many-rows path), and outputs bit-identical with and without them;
- on an AVX-512 VNNI build, outputs bit-identical to the kernel the quantized model's accuracy
  bounds were measured on (tests/data/quant_linear_avx512_vnni.json: fp32, bf16 and fp16 rows,
  every type, the default model's shapes), so that another path's code cannot move that one's
  float summation order (it did once: the bf16 GGUF model's greedy answers moved);
- a fused layer whose parts have different types (a Q4_K_M file's Q4_K and Q6_K rows) and a
  tensor-parallel column shard run quantized and equal the dense layer;
- the layer uses the quantized weights for few rows and the dense kernel for many, and
  keeps only the dense one where a part has no layout (F16) or `--linear-backend torch`.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from kernel_variants import run_variant
from quant_kernel_checks import TYPES, blocks, check_extreme_bytes, check_kernel, output_digests, with_tiles

from tandem.kernels import cpu as cpu_kernels
from tandem.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from tandem.layers.linear_kernel import can_pack
from tandem.layers.quantization.gguf_linear import (
    QUANT_MAX_ROWS,
    QUANT_MAX_ROWS_ALL,
    QUANT_MAX_ROWS_INT8,
    narrowest_scales,
)
from tandem.layers.quantization.gguf_repack import repack, widen
from tandem.layers.vocab_embedding import VocabParallelEmbedding
from tandem.model_executor.gguf_loader import GGUFWeight

QT = gguf.GGMLQuantizationType
ops = cpu_kernels.load()
pytestmark = pytest.mark.skipif(ops is None, reason="Tandem's C++ CPU kernels are not built (no compiler)")


def gguf_weight(name: str, rows: int, cols: int, seed: int = 0) -> GGUFWeight:
    return GGUFWeight(blocks(name, rows, cols, seed), QT[name], (rows, cols))


def run(packed, x: torch.Tensor) -> torch.Tensor:
    return ops.quant_linear(
        x, *(torch.from_numpy(a) for a in (packed.q, packed.scale, packed.mn)), packed.code, packed.group
    )


KERNELS = {"plain": lambda: ops.quant_linear, "stored tiles": lambda: with_tiles(ops)}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 17, 64, 300])
def test_kernel_equals_dequantize_then_matmul(kernel, name, rows):
    check_kernel(KERNELS[kernel](), ops.quant_linear_isa(), name, rows)


@pytest.mark.parametrize("kernel", KERNELS)
def test_extreme_bytes(kernel):
    check_extreme_bytes(KERNELS[kernel](), ops.quant_linear_isa())


# the layouts: 4-bit (symmetric or not), 8-bit by 32 and by 16; narrow tiles of 8-bit codes
# below 16 (Q3_K), 32 (Q5_0) and 64 (Q6_K)
@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q6_K", "Q5_0", "Q3_K"])
def test_stored_tiles_give_the_same_outputs(name):
    """Where the build has the tiled paths (AVX-512 VNNI: packed tiles of 32 rows; AVX2: tiles of
    8 rows), `quant_tiles` stores the weight's tiles, which serve every row count. AVX-512 VNNI:
    from 8 rows the many-rows path's sums in its order (bit-identical with and without them, on
    a partial last tile), below the row kernel's integer products summed in another order
    (within float32 rounding of its sums); AVX2: the row kernel's integer sums, the float sums in
    another order, at every row count. Tiles of another weight are refused. Without AVX2
    quant_tiles gives an empty tensor, which the kernel ignores."""
    rows, cols = 75, 512
    packed = repack(blocks(name, rows, cols), QT[name], (rows, cols))
    isa = ops.quant_linear_isa()
    vnni, tiled_build = isa.startswith("avx512_vnni"), not isa.startswith("float,")
    for scales in (torch.float32, torch.float16):
        q, scale, mn = torch.from_numpy(packed.q), *(torch.from_numpy(a).to(scales) for a in (packed.scale, packed.mn))
        tiles = ops.quant_tiles(q, scale, mn, packed.code, packed.group)
        if not tiled_build:
            assert tiles.numel() == 0
        else:
            assert tiles.dim() == 1 and tiles.numel() > 0 and tiles.dtype == torch.uint8
        for n in (1, 3, 7, 8, 9, 33, 64, 130):
            x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n))
            plain = ops.quant_linear(x.bfloat16(), q, scale, mn, packed.code, packed.group, None, False)
            tiled = ops.quant_linear(x.bfloat16(), q, scale, mn, packed.code, packed.group, None, False, tiles)
            if not tiled_build or (vnni and n >= 8):
                assert torch.equal(tiled, plain)
            else:  # float32 sums compared: the bfloat16 outputs are these rounded once
                plain32 = ops.quant_linear(x, q, scale, mn, packed.code, packed.group, None, True)
                tiled32 = ops.quant_linear(x, q, scale, mn, packed.code, packed.group, None, True, tiles)
                assert not torch.equal(tiled32, plain32)  # summed in another order: the packed tiles ran
                torch.testing.assert_close(tiled32, plain32, rtol=1e-5, atol=1e-5 * plain32.abs().max().item())
    if tiles.numel():
        with pytest.raises(RuntimeError, match="tiles must be quant_tiles of this weight"):
            ops.quant_linear(
                x[:, :256],
                q[:, : q.shape[1] // 2].contiguous(),
                scale[:, : scale.shape[1] // 2].contiguous(),
                mn[:, : mn.shape[1] // 2].contiguous(),
                packed.bits,
                packed.group,
                None,
                False,
                tiles,
            )


def narrow_and_plain_tiles(name: str, rows: int, cols: int, group: int | None = None):
    """A weight of type `name` (its narrowest scales; widened to 8-bit groups of `group` where
    given) and its stored tiles with and without narrow tiles and compact scales
    (`quant_tiles(..., narrow=False)`)."""
    packed = repack(blocks(name, rows, cols), QT[name], (rows, cols))
    if group is not None:
        packed = widen(packed, group)
    q = torch.from_numpy(packed.q)
    scale, mn = (torch.from_numpy(a) for a in narrowest_scales(packed.scale, packed.mn))
    tiles = ops.quant_tiles(q, scale, mn, packed.code, packed.group)
    return (packed, q, scale, mn), tiles, ops.quant_tiles(q, scale, mn, packed.code, packed.group, False)


def assert_same_outputs(packed, q, scale, mn, tiles, plain):
    """Bit-identical outputs from both tiles at 1, 5, 9 and 40 bfloat16 rows."""
    for n in (1, 5, 9, 40):
        x = torch.randn(n, packed.cols, generator=torch.Generator().manual_seed(n)).bfloat16()
        got = ops.quant_linear(x, q, scale, mn, packed.code, packed.group, None, False, tiles)
        assert torch.equal(got, ops.quant_linear(x, q, scale, mn, packed.code, packed.group, None, False, plain))


# Narrow tiles (8-bit codes below 16, 32 or 64: kind 1 + bit planes) and compact scales (float32
# scales of 4-bit tiles that factor per 256 columns: the K-quants, IQ4_XS)
@pytest.mark.parametrize(
    "name,kind,compact",
    [
        *(("Q8_0", 0, 0), ("Q4_0", 0, 0), ("Q4_K", 0, 1), ("IQ4_XS", 0, 1), ("Q2_K", 1, 1), ("Q3_K", 1, 1)),
        *(("Q5_0", 2, 0), ("Q5_K", 2, 1), ("Q6_K", 3, 1)),
    ],
)
def test_narrow_tiles_and_compact_scales_give_the_same_outputs_from_fewer_bytes(name, kind, compact):
    """Against the layout's own tiles of the same weight (`narrow=False`): the headers say which,
    the narrow tiles leave out 8 - (4 + planes) bits a code, and the outputs are bit-identical
    for rows of the packed kernel (1, 5), the many-rows path (9) and the widened tiles (40)."""
    if not ops.quant_linear_isa().startswith("avx512_vnni"):
        pytest.skip("tiles are the AVX-512 VNNI path's")
    cols = 768
    (packed, q, scale, mn), tiles, plain = narrow_and_plain_tiles(name, 70, cols)
    header = tiles[:64].view(torch.int32)
    assert (int(header[1]), int(header[2])) == (kind, compact)
    assert int(plain[:64].view(torch.int32)[1]) == int(plain[:64].view(torch.int32)[2]) == 0
    if kind == compact == 0:
        assert torch.equal(tiles, plain)
    elif not compact:
        assert (plain.numel() - tiles.numel()) * 8 == 96 * cols * (8 - (3 + kind))  # 3 tiles of 32 rows
    else:
        assert tiles.numel() < plain.numel()
    assert_same_outputs(packed, q, scale, mn, tiles, plain)


# The AVX2 build's tiles of 8 rows: narrow ones for 8-bit codes below 16 (Q2_K, Q3_K), 32 (Q5_x;
# in groups of 16, as a part widened to share a matrix with Q6_K rows, stored as below 64) and 64
# (Q6_K); compact scales where float32 scales factor per 256 columns (the K-quants); grid codes
# (IQ4_NL, IQ4_XS) as 4-bit tiles
@pytest.mark.parametrize(
    "name,group,kind,compact",
    [
        *(("Q8_0", None, 0, 0), ("Q4_0", None, 0, 0), ("Q4_1", None, 0, 0), ("Q4_K", None, 0, 1)),
        *(("Q2_K", None, 1, 1), ("Q3_K", None, 1, 1), ("Q5_0", None, 2, 0), ("Q5_K", None, 2, 1)),
        *(("Q5_0", 16, 3, 0), ("Q6_K", None, 3, 1), ("Q4_K", 16, 1, 1), ("IQ4_NL", None, 0, 0), ("IQ4_XS", None, 0, 1)),
    ],
)
def test_avx2_narrow_tiles_and_compact_scales_give_the_same_outputs_from_fewer_bytes(name, group, kind, compact):
    """Against the layout's own tiles of the same weight (`narrow=False`): the header (int32 4, 5)
    says the kind and whether the scales are compact; a narrow tile leaves out 8 - (4 + planes)
    bits a code, compact scales keep per group and row one int8 a scale (and offset) instead of a
    float32, and per 256 columns and row one float32 each; the outputs are bit-identical (the
    same integer sums, scaled by the same float32 values in the same order) at 1, 5, 9 and 40
    rows."""
    isa = ops.quant_linear_isa()
    if isa.startswith(("avx512_vnni", "float,")):
        pytest.skip(f"this build's path is {isa}: these are the AVX2 build's tiles")
    cols = 768
    (packed, q, scale, mn), tiles, plain = narrow_and_plain_tiles(name, 70, cols, group)
    header, plain_header = tiles[:64].view(torch.int32), plain[:64].view(torch.int32)
    assert (int(header[4]), int(header[5])) == (kind, compact)
    assert int(plain_header[4]) == int(plain_header[5]) == 0
    assert int(header[6]) == int(plain_header[6]) == int(packed.grid)  # grid codes: looked up in the tiles
    scale_bytes, offsets = scale.element_size(), int(header[0]) < 0
    saved = 72 * cols * (8 - (3 + kind)) // 8 if kind else 0  # 9 tiles of 8 rows (72), cols codes each
    if compact:  # per group and row 3 bytes fewer a float32 scale / offset; per 256 columns and row 4 more
        assert scale_bytes == 4
        per = (2 if offsets else 1) * 72
        saved += per * (cols // packed.group) * 3 - per * (cols // 256) * 4
    assert plain.numel() - tiles.numel() == saved
    if kind == compact == 0:
        assert torch.equal(tiles, plain)
    assert_same_outputs(packed, q, scale, mn, tiles, plain)


@pytest.mark.slow  # ~20 s: 900 products of up to 4096 x 1536, with and without stored tiles
@pytest.mark.parametrize("kernel", KERNELS)
def test_avx512_vnni_outputs_are_bit_identical_to_the_measured_kernel(kernel):
    isa = ops.quant_linear_isa()
    if not isa.startswith("avx512_vnni"):
        pytest.skip(f"this build's path is {isa}: the digests are the AVX-512 VNNI path's")
    expected = json.loads((Path(__file__).parents[1] / "data" / "quant_linear_avx512_vnni.json").read_text())
    got = output_digests(KERNELS[kernel]())
    want = expected["digests with stored tiles" if kernel == "stored tiles" else "digests"]
    changed = sorted(case for case, digest in want.items() if got.get(case) != digest)
    assert not changed, f"outputs changed for {changed} (made from: {expected['made_from']})"


def check_variant(march: str, isa: str) -> None:
    """The kernel built with `-march=MARCH`, loaded in a subprocess (its ops have the same
    names), has paths `isa` and passes the same checks on every type."""
    assert run_variant("quant_kernel_checks.py", march) == [isa, "ok"]


x86_only = pytest.mark.skipif(platform.machine() != "x86_64", reason="the variants are x86-64 builds")


@pytest.mark.slow  # compiles the kernel twice more (-march variants)
@x86_only
@pytest.mark.parametrize("march,isa", [("x86-64-v3", "avx2_maddubs,avx2"), ("x86-64", "float,portable")])
def test_kernel_builds_for_other_cpus(march, isa):
    """A CPU without AVX-512 (AVX2: the int8 path by VPMADDUBSW) and plain x86-64 (the float path)."""
    check_variant(march, isa)


def compiler_accepts(flag: str) -> bool:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    return (
        cxx is not None
        and subprocess.run([cxx, flag, "-x", "c++", "-E", "-"], input="", capture_output=True, text=True).returncode
        == 0
    )


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.slow  # compiles the kernel once more
@x86_only
def test_kernel_builds_for_avx_vnni():
    """AVX2 with AVX-VNNI (Alder Lake, Sapphire Rapids, Zen 5: the int8 path by VEX VPDPBUSD):
    compiled on every machine whose compiler knows -mavxvnni, checked where the CPU has it."""
    if not compiler_accepts("-mavxvnni"):
        pytest.skip("the C++ compiler does not know -mavxvnni")
    march = "x86-64-v3 -mavxvnni"
    cpu_kernels.build((cpu_kernels.CSRC / "quant_linear_cpu.cpp",), march)
    if "avx_vnni" not in cpu_flags():
        pytest.skip(
            "this CPU lacks AVX-VNNI (no avx_vnni in /proc/cpuinfo): the variant compiles, its checks need the CPU"
        )
    check_variant(march, "avx_vnni,avx2")


def test_kernel_refuses_bad_layouts():
    packed = repack(blocks("Q4_0", 4, 64), QT["Q4_0"], (4, 64))
    q, scale, mn = (torch.from_numpy(a) for a in (packed.q, packed.scale, packed.mn))
    with pytest.raises(RuntimeError, match="layouts are"):
        ops.quant_linear(torch.randn(1, 64), q, scale, mn, 4, 16)
    with pytest.raises(RuntimeError, match="multiple of the group"):
        ops.quant_linear(torch.randn(1, 48), q, scale, mn, 4, 32)
    with pytest.raises(RuntimeError, match="q must be"):
        ops.quant_linear(torch.randn(1, 64), q.int(), scale, mn, 4, 32)


def test_fused_layer_of_mixed_types_runs_quantized():
    layer = MergedColumnParallelLinear(256, [64, 32], bias=False)
    parts = [gguf_weight("Q4_K", 64, 256, 1), gguf_weight("Q6_K", 32, 256, 2)]
    for shard, loaded in enumerate(parts):
        layer.weight_loader(layer.weight, loaded, shard)
    dense = layer.weight.data.clone()
    layer.process_weights_after_loading("auto")
    assert layer.quant_kernel is not None and (layer.quant_kernel.bits, layer.quant_kernel.group) == (8, 16)
    x = torch.randn(3, 256)
    torch.testing.assert_close(layer.forward(x), x @ dense.T, atol=2e-6 * (x @ dense.T).abs().max().item(), rtol=0)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_row_parallel_shard_runs_quantized(tp_rank):
    layer = RowParallelLinear(512, 48, bias=False, tp_rank=tp_rank, tp_size=2)
    layer.tp_size = 1  # the matmul alone: no all-reduce outside a TP group
    loaded = gguf_weight("Q4_0", 48, 512)
    layer.weight_loader(layer.weight, loaded)
    dense = layer.weight.data.clone()
    layer.process_weights_after_loading("auto")
    assert layer.quant_kernel is not None and layer.quant_kernel.in_features == 256
    x = torch.randn(2, 256)
    torch.testing.assert_close(layer.forward(x), x @ dense.T, atol=2e-6 * (x @ dense.T).abs().max().item(), rtol=0)


# (dtype, int8_x): the rows up to which the blocks beat the dense kernel (`quant_max_rows`)
@pytest.mark.parametrize("dtype,int8_x", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)])
def test_few_rows_use_the_blocks_many_the_dense_kernel(monkeypatch, dtype, int8_x):
    layer = MergedColumnParallelLinear(256, [32, 32], bias=False)
    layer.weight.data = layer.weight.data.to(dtype)
    for shard in (0, 1):
        layer.weight_loader(layer.weight, gguf_weight("Q8_0", 32, 256, shard), shard)
    dense_bf16 = can_pack(layer.weight.data) and dtype == torch.bfloat16
    layer.process_weights_after_loading("auto", int8_x=int8_x)
    isa = ops.quant_linear_isa()
    int8_path = not isa.startswith("float,") and (int8_x or dtype != torch.float32)
    # exact float32 rows, and int8 rows of a build without AVX-512 VNNI against oneDNN's
    # bfloat16, stop at 4; on the AVX-512 VNNI build with AMX int8 rows stop at 64; every input
    # takes the blocks (prefill too) on that build without AMX, and on the AVX2 build (its tiles
    # of 8 rows) against a float32 (or unpacked bfloat16) dense kernel
    vnni = isa.startswith("avx512_vnni")
    if int8_path and (not torch.cpu._is_amx_tile_supported() if vnni else not dense_bf16):
        limit = 300  # any count: QUANT_MAX_ROWS_ALL
        assert layer.quant_kernel.max_rows == QUANT_MAX_ROWS_ALL
        assert layer.kernel is None and layer.weight.numel() == 0  # so no dense copy is kept
    else:
        limit = QUANT_MAX_ROWS_INT8 if int8_path and vnni else QUANT_MAX_ROWS
        assert layer.quant_kernel.max_rows == limit
    kernel, calls = layer.quant_kernel, []

    class Counted:
        max_rows = kernel.max_rows

        def __call__(self, x):
            calls.append(x.shape[0])
            return kernel(x)

    monkeypatch.setattr(layer, "quant_kernel", Counted())
    layer.matmul(torch.randn(limit, 256, dtype=dtype))
    layer.matmul(torch.randn(limit + 1, 256, dtype=dtype))
    assert calls == ([limit, limit + 1] if Counted.max_rows == QUANT_MAX_ROWS_ALL else [limit])


def test_dense_only_without_a_layout_or_with_the_torch_backend():
    f16 = MergedColumnParallelLinear(256, [32, 32], bias=False)
    f16.weight_loader(f16.weight, gguf_weight("Q8_0", 32, 256), 0)
    half = np.random.default_rng(0).standard_normal((32, 256)).astype(np.float16)
    f16.weight_loader(f16.weight, GGUFWeight(half, QT.F16, (32, 256)), 1)
    f16.process_weights_after_loading("auto")
    assert f16.quant_kernel is None and f16.dequantized_types == {"F16", "Q8_0"}
    torch_backend = MergedColumnParallelLinear(256, [32, 32], bias=False)
    for shard in (0, 1):
        torch_backend.weight_loader(torch_backend.weight, gguf_weight("Q8_0", 32, 256, shard), shard)
    torch_backend.process_weights_after_loading("torch")
    assert torch_backend.quant_kernel is None and torch_backend.kernel is None


@pytest.mark.parametrize(
    "name,half", [("Q4_0", True), ("Q4_1", True), ("Q8_0", True), ("Q5_1", True), ("Q4_K", False), ("Q6_K", False)]
)
def test_scales_are_float16_where_that_is_exact(name, half):
    layer = MergedColumnParallelLinear(256, [64], bias=False)
    layer.weight_loader(layer.weight, gguf_weight(name, 64, 256), 0)
    dense = layer.weight.data.clone()
    layer.process_weights_after_loading("auto")
    kernel = layer.quant_kernel
    assert kernel.scale.dtype == kernel.mn.dtype == (torch.float16 if half else torch.float32)
    x = torch.randn(2, 256)
    torch.testing.assert_close(layer.forward(x), x @ dense.T, atol=2e-6 * (x @ dense.T).abs().max().item(), rtol=0)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "IQ4_NL"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp_rank", [None, 1])
@pytest.mark.parametrize("kernels", [True, False], ids=["quant_rows", "numpy"])
def test_embedding_rows_from_blocks_equal_the_dense_table(name, dtype, tp_rank, kernels, monkeypatch):
    """An embedding that keeps its GGUF blocks (untied) frees the dense table and looks up the
    same values (under TP, rank 1 of 2: its shard's rows; the all-reduce needs a group), by the
    C++ `quant_rows` or, without the kernels, numpy."""
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    elif cpu_kernels.load() is None:
        pytest.skip("the C++ CPU kernels are not built here")
    loaded = gguf_weight(name, 40, 256, seed=3)
    emb = VocabParallelEmbedding(40, 256) if tp_rank is None else VocabParallelEmbedding(40, 256, tp_rank, 2)
    emb.weight.data = emb.weight.data.to(dtype)
    emb.weight_loader(emb.weight, loaded)
    dense = emb.weight.data.clone()
    emb.finish_loading(shared_with_head=False)
    assert emb.packed is not None and emb.weight.numel() == 0
    ids = torch.tensor([[0, 19, 7], [3, 12, 1]])
    got = emb.forward(ids) if tp_rank is None else emb._lookup(ids)
    assert got.dtype == dtype and torch.equal(got, dense[ids])


def test_embedding_without_a_layout_keeps_its_table():
    half = np.random.default_rng(0).standard_normal((40, 256)).astype(np.float16)
    emb = VocabParallelEmbedding(40, 256)
    emb.weight_loader(emb.weight, GGUFWeight(half, QT.F16, (40, 256)))
    emb.finish_loading(shared_with_head=False)
    assert emb.packed is None and emb.weight.shape == (40, 256)
