"""GGUF weights kept quantized for the matmuls that read every weight for few rows.

A linear layer loaded from a GGUF file records, besides its dense weight, which part of
which file tensor each of its rows came from (`BlockPart`: a fused QKV or gate-up layer
has one part per tensor, a tensor-parallel rank a slice of each). Once loaded,
`QuantLinearKernel.build` repacks those parts' blocks into one of Tandem's layouts
(`gguf_repack`, exact for every supported type; scales in float16 where that is exact)
and the layer multiplies inputs of few rows (decode steps; `quant_max_rows`) with the
C++ kernel `tandem_cpu.quant_linear`,
reading 4-bit or 8-bit weights instead of the dense ones; larger inputs (prefill) keep
the dense kernel where that is faster (oneDNN's bfloat16 on AMX, or on a build without AVX-512
VNNI where oneDNN packs bfloat16); elsewhere every input takes the blocks and no dense copy is
kept. The kernel rounds the rows to int8 (llama.cpp's
recipe: bfloat16 rows always, float32 rows unless the model asked for exact float32 matmuls,
`--dtype float32`); exact float32 results equal the dense matmul's up to the summation order
(the kernel computes in float32 on the exact dequantized values).

Parts of different layouts (a Q4_K_M file's Q4_K query and Q6_K value rows, an IQ4_XS file's
grid-coded rows and Q5_K ones) are widened to the 8-bit layout to share one matrix; so is the
grid layout (IQ4_NL / IQ4_XS) on a build whose int8 path is AVX2's where no tiles are stored
(`takes_grid`). On the
AVX-512 VNNI build, the stored tiles of an 8-bit weight whose codes lie below 16, 32 or 64 (Q2_K,
Q3_K, Q5_x, Q6_K, 4-bit parts widened with those) hold 4, 5 or 6 bits a code ("narrow tiles"),
and float32 scales that factor per 256 columns into a float32 and int8s (the K-quants', IQ4_XS's)
take 0.75 bits a weight instead of 2 ("compact scales"); both exact. The AVX2 build stores tiles of
8 rows (narrow ones, compact scales and grid codes too).
Where a part has no layout (F16, BF16, F32, a type without one), a tensor-parallel column
slice does not fall on group boundaries, the rows do not cover the whole weight, the weight
is not on the CPU or the C++ kernels are unavailable, the layer keeps only the dense kernel.

`--quantization q8_0|q4_0|q4_1` gives a Hugging Face checkpoint the same kernel:
`quantize_dense` rounds a layer's dense weight to that GGUF type with gguf's own numpy
quantizer (llama.cpp's reference rounding) and repacks the blocks;
`QuantLinearKernel.from_packed` multiplies them, and the layer's dense weight becomes
their dequantized values, so that both paths use the same weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch

from tandem.kernels import cpu as cpu_kernels
from tandem.layers.linear_kernel import can_pack
from tandem.layers.quantization.gguf_repack import Packed, concat_rows, repack, slice_cols, widen
from tandem.utils.huge_pages import HugePageArena

logger = logging.getLogger(__name__)

# Inputs of up to this many rows run on the quantized weights on the exact float32 path (no
# int8 rows), and where int8 rows meet oneDNN's bfloat16 on a build without AVX-512 VNNI:
# measured on 2 EPYC cores (AVX-512 VNNI/BF16), 40 distinct 3072 x 576 Q4 weights (out of
# cache), bf16 rows, per matmul: 1 row 0.12 ms against oneDNN's bf16 0.33, 2 rows 0.15 / 0.31,
# 4 rows 0.22 / 0.28, 8 rows 0.36 / 0.24 (the one-weight-row-at-a-time kernel).
QUANT_MAX_ROWS = 4
# ... and where int8 rows meet a slower dense kernel (float32, or bfloat16 that oneDNN packs
# not): measured on 2 Zen 3 cores (AVX2, no AVX-512), 24 distinct Q4_1 weights from memory,
# float32 rows against oneDNN's float32, time of quant / dense: 3072 x 576 at 8 rows 0.39,
# 16 0.54, 32 0.81, 64 0.89, 128 0.95, 256 1.11; 576 x 1536 at 64 0.75, 256 0.99. Also where the
# AVX-512 VNNI build multiplies 8 rows and more by transposed weight tiles: the decode step of
# the default model (Q4_1, bf16, 2 Zen 5 cores) at 64 rows against 4, alternated in one process:
# batch 8 0.73 of the time, 16 0.78, 32 0.86, 64 0.88 (Q4_0: 16 0.82, 64 0.93).
QUANT_MAX_ROWS_INT8 = 64
# ... and on the AVX-512 VNNI build where the CPU has no AMX (on which oneDNN's bfloat16 runs),
# every input: prefill too multiplies the stored tiles (`quant_tiles`; measured with transposed
# tiles, whose sums the packed ones give), against oneDNN's bfloat16 on the dense copy, the
# default model's prefill alternated in one process (2 Zen 4 cores, bf16): 1 x 128 tokens 0.85
# of the time, 4 x 256 0.89, 16 x 96 0.90 (Q8_0 0.87), 1 x 1024 0.91 (Q4_0).
# ... and on the AVX2 build (its tiles of 8 rows, `quant_tiles`) where the dense kernel is
# oneDNN's float32: 3072 x 576 from memory, float32 rows, 2 Zen 3 cores, quant / dense at 128,
# 256 and 512 rows 0.60, 0.65, 0.72 (4-bit) and 0.86, 0.93, 0.98 (8-bit)
# (`benchmarks/quant_linear_bench.py --dtype float32 --tiles`).
QUANT_MAX_ROWS_ALL = 1 << 62


def quant_max_rows(weight: torch.Tensor, int8_x: bool, ops) -> int:
    """Rows up to which a layer with dense `weight` multiplies the quantized blocks instead."""
    isa = ops.quant_linear_isa()
    int8_rows = (int8_x or weight.dtype != torch.float32) and not isa.startswith("float,")
    onednn_bf16 = weight.dtype == torch.bfloat16 and can_pack(weight)
    vnni = isa.startswith("avx512_vnni")
    if int8_rows and (not torch.cpu._is_amx_tile_supported() if vnni else not onednn_bf16):
        return QUANT_MAX_ROWS_ALL
    return QUANT_MAX_ROWS_INT8 if int8_rows and (vnni or not onednn_bf16) else QUANT_MAX_ROWS


def is_gguf_tensor(loaded: Any) -> bool:
    """Whether a checkpoint tensor carries GGUF blocks (`gguf_loader.GGUFWeight`)."""
    return hasattr(loaded, "blocks") and hasattr(loaded, "qtype")


@dataclass(frozen=True)
class BlockPart:
    """Rows `[dest_row, dest_row + rows)` of a layer's weight are rows `[row_start, ...)`
    and columns `[col_start, col_start + cols)` of the GGUF tensor `loaded`."""

    dest_row: int
    loaded: Any
    row_start: int
    rows: int
    col_start: int
    cols: int

    def pack(self) -> Packed | None:
        full_cols = self.loaded.shape[1]
        blocks = np.ascontiguousarray(self.loaded.blocks[self.row_start : self.row_start + self.rows])
        packed = repack(blocks, self.loaded.qtype, (self.rows, full_cols))
        if packed is None or self.cols == full_cols:
            return packed
        try:
            return slice_cols(packed, self.col_start, self.cols)
        except ValueError:  # not on group boundaries
            return None


# Rows quantized at a time (bounds the float32 copies gguf's quantizer makes of a large head).
_QUANTIZE_ROWS = 4096


def quantize_dense(weight: torch.Tensor, method: str) -> Packed | None:
    """`weight` [out, in] rounded to the GGUF type `method` names (q8_0, q4_0, q4_1) by
    `gguf.quants.quantize` from its float32 values, repacked (`Packed.dequantize` equals
    `gguf.quants.dequantize` of those blocks); None when `in` is not a whole number of the
    type's blocks (32 columns), where the layer stays dense."""
    qtype = gguf.GGMLQuantizationType[method.upper()]
    if weight.dim() != 2 or weight.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return None
    dense = weight.detach()
    blocks = np.concatenate(
        [
            gguf.quants.quantize(dense[i : i + _QUANTIZE_ROWS].float().cpu().numpy(), qtype)
            for i in range(0, dense.shape[0], _QUANTIZE_ROWS)
        ]
    )
    return repack(blocks, qtype, tuple(dense.shape))


def takes_grid(isa: str, tiled: bool) -> bool:
    """Whether the kernel build whose paths are `isa` (`quant_linear_isa()`) takes the grid
    layout (IQ4_NL / IQ4_XS's 4-bit codes), given stored tiles (`tiled`) or not: its AVX-512
    VNNI and float paths do; the AVX2 path in its stored tiles only, and without them gets those
    weights widened to bits 8 (the same values, twice the bytes)."""
    return tiled or not isa.startswith(("avx_vnni", "avx2"))


def narrowest_scales(scale: np.ndarray, mn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`scale` and `mn` as float16 when float16 holds every value exactly (the types whose
    file stores float16 scales: Q4_0, Q4_1, Q8_0, Q5_0, Q5_1; 2 bytes fewer per group), else
    as they are (float32)."""
    with np.errstate(over="ignore"):
        half = scale.astype(np.float16), mn.astype(np.float16)
    exact = all(np.isfinite(h).all() and np.array_equal(h.astype(np.float32), f) for h, f in zip(half, (scale, mn)))
    return half if exact else (scale, mn)


def place_in_huge_pages(kernels: list[QuantLinearKernel]) -> None:
    """Move the kernels' blocks, scales and offsets, in the order given (the order a decode
    step reads them), into one arena of huge pages (tandem/utils/huge_pages.py); each
    original is freed as soon as it is copied. Same values: the outputs do not change."""
    tensors = [t for k in kernels for t in (k.q, k.scale, k.mn, k.tiles) if t is not None]
    if not tensors:
        return
    nbytes = HugePageArena.size_of(tensors)
    arena = HugePageArena(nbytes)
    for k in kernels:
        k.q, k.scale, k.mn = arena.take(k.q), arena.take(k.scale), arena.take(k.mn)
        if k.tiles is not None:
            k.tiles = arena.take(k.tiles)
    logger.debug(
        "quantized weights: %.1f MB in one arena (%s)",
        nbytes / 1e6,
        "huge pages advised" if arena.huge else "huge pages refused: 4 KB pages",
    )


class QuantLinearKernel:
    """`x @ W.T (+ b)` for W in a `Packed` layout (x: [..., in], float32/bfloat16/float16).
    bfloat16/float16 rows are rounded to int8 per 32 columns and multiplied in integers
    (llama.cpp's recipe), float32 rows too where `int8_x`; float32 rows without it are
    multiplied exactly (dequantize-then-matmul up to the summation order)."""

    def __init__(self, packed: Packed, bias: torch.Tensor | None, ops, int8_x: bool, max_rows: int):
        if packed.grid and not takes_grid(ops.quant_linear_isa(), tiled=max_rows > QUANT_MAX_ROWS):
            packed = widen(packed, packed.group)
        # bits: the kernels' layout code (`Packed.code`: bits, or bits | GRID)
        self.bits, self.group, self.ops, self.int8_x = packed.code, packed.group, ops, int8_x
        self.max_rows = max_rows  # inputs of more rows take the dense kernel (`quant_max_rows`)
        self.q = torch.from_numpy(packed.q)
        self.scale, self.mn = (torch.from_numpy(a) for a in narrowest_scales(packed.scale, packed.mn))
        self.out_features, self.in_features = packed.rows, packed.cols
        # Where the build multiplies rows by weight tiles (AVX-512 VNNI; AVX2: tiles of 8 rows), the weight's packed
        # tiles stored once here (`quant_tiles`), which calls of any rows read instead of its rows
        # and of the tiles transposed per call from 8 rows on (the same sums there): about as many
        # bytes again as the blocks (0.56-0.63 a 4-bit weight, 1.06-1.13 an 8-bit one); the default
        # Q4_0 model's decode step 0.95 of its time at batch 1, 0.84 at 16
        # (docs/perf-log/quant-gemm-tiles.md).
        tiles = (
            ops.quant_tiles(self.q, self.scale, self.mn, self.bits, self.group) if max_rows > QUANT_MAX_ROWS else None
        )
        self.tiles = tiles if tiles is not None and tiles.numel() > 0 else None
        # The kernel adds the bias in float32 before rounding once; the dense path adds it in
        # the model's dtype (equal for float32 models).
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @classmethod
    def build(
        cls, parts: list[BlockPart], weight: torch.Tensor, bias: torch.Tensor | None, int8_x: bool
    ) -> QuantLinearKernel | None:
        """The kernel for a layer whose rows `parts` name, or None (module docstring)."""
        if not parts or weight.device.type != "cpu" or weight.dim() != 2:
            return None
        parts = sorted(parts, key=lambda p: p.dest_row)
        rows = 0
        for part in parts:
            if part.dest_row != rows or part.cols != weight.shape[1]:
                return None
            rows += part.rows
        if rows != weight.shape[0]:
            return None
        ops = cpu_kernels.load()
        packs = [part.pack() for part in parts]
        if ops is None or any(p is None for p in packs):
            return None
        if len({p.layout for p in packs}) > 1:
            group = min(p.group for p in packs)
            packs = [widen(p, group) for p in packs]
        packed = concat_rows(packs) if len(packs) > 1 else packs[0]
        return cls(packed, bias, ops, int8_x, quant_max_rows(weight, int8_x, ops))

    @classmethod
    def from_packed(
        cls, packed: Packed, weight: torch.Tensor, bias: torch.Tensor | None, int8_x: bool
    ) -> QuantLinearKernel | None:
        """The kernel for a dense `weight` quantized at load (`quantize_dense` gave `packed`),
        or None where the weight is not on the CPU or the C++ kernels are unavailable."""
        ops = cpu_kernels.load()
        if ops is None or weight.device.type != "cpu":
            return None
        return cls(packed, bias, ops, int8_x, quant_max_rows(weight, int8_x, ops))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # a decode step's [rows, in]: no reshapes (a few us on each of ~120 calls a step)
            return self.ops.quant_linear(
                x, self.q, self.scale, self.mn, self.bits, self.group, self.bias, self.int8_x, self.tiles
            )
        lead = x.shape[:-1]
        out = self.ops.quant_linear(
            x.reshape(-1, self.in_features),
            self.q,
            self.scale,
            self.mn,
            self.bits,
            self.group,
            self.bias,
            self.int8_x,
            self.tiles,
        )
        return out.view(*lead, self.out_features)

    def tensors(self) -> list[torch.Tensor]:
        """Its tensors as `tandem_cpu.decode_layer` takes a linear: q, scale, mn, the tiles
        where it has them, the bias where it has one (`fused_format` says which)."""
        return [self.q, self.scale, self.mn] + [t for t in (self.tiles, self.bias) if t is not None]

    def fused_format(self) -> list[int]:
        """(bits, group, int8_x, tiled): `tandem_cpu.decode_layer`'s format of this linear."""
        return [self.bits, self.group, int(self.int8_x), int(self.tiles is not None)]

    def nbytes(self) -> int:
        """Bytes a call of few rows reads: the packed tiles where it has them, else its rows,
        scales and offsets (`tandem_cpu.quant_decode_bytes`)."""
        return self.ops.quant_decode_bytes(self.q, self.scale, self.mn, self.bits, self.group, self.tiles)
