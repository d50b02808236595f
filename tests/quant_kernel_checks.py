"""Checks of the C++ quantized matmul shared by tests/unit/test_quant_linear.py and, run as
`python tests/quant_kernel_checks.py MARCH`, by a build of the kernel for another CPU
(`-march=MARCH`, compiled alone and loaded in this process): prints the build's paths
(`quant_linear_isa()`) and "ok" once every type passes `check_kernel`, with and without the
weight's stored tiles (`with_tiles`).

`python tests/quant_kernel_checks.py --digests LIB` loads the kernel library LIB (a .so that
`tandem.kernels.cpu.build` made) and prints `output_digests` of its quant_linear, without and
with the weights' stored tiles, as JSON: how
tests/data/quant_linear_avx512_vnni.json, the AVX-512 VNNI path's bit-exact outputs, is made
from a build of the kernel whose outputs are to be kept.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from gguf_writer import quantize as quantize_k  # noqa: E402

from tandem.layers.quantization.gguf_linear import takes_grid  # noqa: E402
from tandem.layers.quantization.gguf_repack import repack, widen  # noqa: E402

QT = gguf.GGMLQuantizationType
TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"]


def super_blocks(name: str) -> bool:
    """Whether the type's blocks are 256 columns wide (the K-quants, IQ4_XS)."""
    return gguf.GGML_QUANT_SIZES[QT[name]][0] == 256


def blocks(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    if name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        return gguf.quants.quantize(x, QT[name])
    return quantize_k(x, name)


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the int8 paths (AVX-512 VNNI, AVX-VNNI, AVX2) round it: per 32 columns
    d = max|x| / 127 (float32) and x ~ d * round(x * (1 / d)), to nearest even."""
    x = x.float()
    blocks = x.view(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / torch.tensor(127.0)
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)
    return (d * torch.round(blocks * inv)).view_as(x)


def half_rows_reference(x: torch.Tensor, isa: str) -> torch.Tensor:
    """What a build with paths `isa` multiplies for bfloat16 / float16 rows x (float64): x
    itself on the float path, else x rounded to int8."""
    return (x if isa.startswith("float,") else int8_rows(x)).double()


def check_kernel(kernel, isa: str, name: str, rows: int) -> None:
    """`kernel` (quant_linear of some build, whose paths are `isa`) against the float64
    references of the module docstring: float32, bfloat16 and float16 rows; float32 rows
    with `int8_x` against x rounded as half rows are (the float32 sums of the bfloat16 rows'
    path: rounded to bfloat16, bit-identical to that path's outputs)."""
    # Odd output counts; column counts that leave a partial 64-byte chunk at a row's end
    # (17 groups of 32) where the type allows (K-quants and IQ4_XS hold 256 columns a block).
    k_quant = super_blocks(name)
    out_features, in_features = (7, 256 if k_quant else 96) if rows > 17 else (300, 768 if k_quant else 544)
    packed = repack(blocks(name, out_features, in_features), QT[name], (out_features, in_features))
    if packed.grid and not takes_grid(isa, getattr(kernel, "tiled", False)):
        # the AVX2 path takes the grid layout in its stored tiles only: widened as the layer does
        with pytest.raises(RuntimeError, match="grid"):
            kernel(
                torch.ones(rows, in_features).bfloat16(),
                *map(torch.from_numpy, (packed.q, packed.scale, packed.mn)),
                packed.code,
                packed.group,
            )
        packed = widen(packed, 32)
    weight = torch.from_numpy(gguf.quants.dequantize(blocks(name, out_features, in_features), QT[name])).double()
    arrays = [torch.from_numpy(a) for a in (packed.q, packed.scale, packed.mn)]
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    ref = x.double() @ weight.T
    got = kernel(x, *arrays, packed.code, packed.group)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), ref, atol=2e-6 * ref.abs().max().item(), rtol=0)
    got_int8 = kernel(x, *arrays, packed.code, packed.group, None, True)
    assert got_int8.dtype == torch.float32
    ref_int8 = half_rows_reference(x, isa) @ weight.T
    torch.testing.assert_close(got_int8.double(), ref_int8, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)
    xb = x.to(torch.bfloat16)
    got_bf16 = kernel(xb, *arrays, packed.code, packed.group)
    assert torch.equal(kernel(xb.float(), *arrays, packed.code, packed.group, None, True).to(torch.bfloat16), got_bf16)
    for dtype in (torch.bfloat16, torch.float16):
        xh = x.to(dtype)
        got_half = kernel(xh, *arrays, packed.code, packed.group)
        assert got_half.dtype == dtype
        ref_half = (half_rows_reference(xh, isa) @ weight.T).float().to(dtype)
        torch.testing.assert_close(
            got_half.float(),
            ref_half.float(),
            atol=1e-5 * ref.abs().max().item(),
            rtol=2**-7 if dtype == torch.bfloat16 else 2**-10,
        )


def check_extreme_bytes(kernel, isa: str) -> None:
    """The 8-bit layouts' extreme values (weights 0 and 255 against int8 activations of +-127:
    where a dot product of unsigned by signed bytes summed in int16 pairs would saturate)
    against the float64 reference, for bfloat16 and float16 rows."""
    rows, cols = 4, 96
    levels = torch.tensor(
        [[255] * cols, [0] * cols, [255, 0] * (cols // 2), [0, 255, 255, 0] * (cols // 4)], dtype=torch.uint8
    )
    x = torch.stack(
        [
            torch.ones(cols),
            -torch.ones(cols),
            torch.tensor([1.0, -1.0] * (cols // 2)),
            torch.tensor([1.0, 1.0, -1.0, -1.0] * (cols // 4)),
        ]
    )
    for group, reps, dtype in itertools.product((16, 32), (1, 3), (torch.bfloat16, torch.float16)):
        scale = torch.full((rows, cols // group), 0.5)
        mn = torch.full((rows, cols // group), -64.0)
        weight = levels.double() * 0.5 - 64.0
        xr = x.repeat(reps, 1).to(dtype)  # 12 rows: the many-rows path (weight tiles) too
        got = kernel(xr, levels, scale, mn, 8, group).double()
        ref = half_rows_reference(xr, isa) @ weight.T
        torch.testing.assert_close(got, ref, atol=1e-3, rtol=2**-8)


def with_tiles(ops):
    """`ops.quant_linear` given the weight's tiles as the layer stores them at load
    (`quant_tiles`: the many-rows path's transposed weights; an empty tensor on builds without
    that path), to be checked as the kernel itself is: the same results."""

    def kernel(x, q, scale, mn, bits, group, bias=None, int8_x=False):
        return ops.quant_linear(x, q, scale, mn, bits, group, bias, int8_x, ops.quant_tiles(q, scale, mn, bits, group))

    kernel.tiled = True  # (takes_grid)
    return kernel


DIGEST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def output_digests(kernel) -> dict[str, str]:
    """Per tensor type and dtype of x, a SHA-256 (16 hex digits) of `kernel`'s outputs in order
    over fixed blocks and rows: out features 576, 1536, 4096 by in features 576 (768 for the
    K-quants, whose blocks are 256 wide) and 1536, each times 1, 2, 4, 8, 16 and 33 rows of x
    (the shapes of the default model's layers; from 8 rows on the many-rows path: 33 rows are
    four row blocks and one row).
    Equal digests: bit-identical outputs."""
    hashes = {(name, str(dt)): hashlib.sha256() for name in TYPES for dt in DIGEST_DTYPES}
    for name, out_features, in_cols in itertools.product(TYPES, (576, 1536, 4096), (576, 1536)):
        k = 768 if super_blocks(name) and in_cols == 576 else in_cols
        packed = repack(blocks(name, out_features, k), QT[name], (out_features, k))
        arrays = [torch.from_numpy(a) for a in (packed.q, packed.scale, packed.mn)]
        for rows in (1, 2, 4, 8, 16, 33):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows * 7919 + k))
            for dt in DIGEST_DTYPES:
                y = kernel(x.to(dt), *arrays, packed.code, packed.group)
                hashes[(name, str(dt))].update(y.contiguous().view(torch.uint8).numpy().tobytes())
    return {f"{name} {dt}": h.hexdigest()[:16] for (name, dt), h in hashes.items()}


if __name__ == "__main__":
    from tandem.kernels import cpu

    if sys.argv[1] == "--digests":
        torch.ops.load_library(sys.argv[2])
        ops = torch.ops.tandem_cpu
        digests = {
            "digests": output_digests(ops.quant_linear),
            "digests with stored tiles": output_digests(with_tiles(ops)),
        }
        print(json.dumps({"isa": ops.quant_linear_isa(), **digests}, indent=1))
        sys.exit(0)

    torch.ops.load_library(str(cpu.build(sources=(cpu.CSRC / "quant_linear_cpu.cpp",), march=sys.argv[1])))
    ops = torch.ops.tandem_cpu
    for kernel in (ops.quant_linear, with_tiles(ops)):
        for name in TYPES:
            for rows in (1, 3, 5, 17, 64):
                check_kernel(kernel, ops.quant_linear_isa(), name, rows)
        check_extreme_bytes(kernel, ops.quant_linear_isa())
    print(ops.quant_linear_isa(), "ok")
