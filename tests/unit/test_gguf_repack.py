"""tandem/layers/quantization/gguf_repack.py: GGUF blocks in the CPU kernels' own layouts.

- Every type with a layout (Q4_0, Q4_1, Q4_K as bits=4; IQ4_NL, IQ4_XS as bits=4 with the
  grid; Q8_0, Q5_0, Q5_1, Q5_K as bits=8 group 32; Q6_K, Q3_K, Q2_K as bits=8 group 16) repacks to weights equal to
  ``gguf.quants.dequantize``'s, value for value (max abs difference 0; bit for bit but for
  the sign of zero weights), on blocks quantized from data and on random bytes (every bit
  pattern of the quants and the packed scales, finite f16 scales).
- widen / concat_rows / slice_cols keep the weights; they refuse what they cannot do.
- F32 / F16 / BF16 and the types without a layout (the other IQ types, TQ, MXFP4) repack to None.
- The layout the C++ kernels read is asserted on its own terms: dtypes, C-contiguity,
  shapes, the nibble order of bits=4 and the offsets of the 8-bit codes.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf_writer import quantize as quantize_k

from tandem.layers.quantization.gguf_repack import Packed, concat_rows, repack, slice_cols, widen

QT = gguf.GGMLQuantizationType

# type -> (bits, group) of its layout
FORMAT = {
    "Q4_0": (4, 32),
    "Q4_1": (4, 32),
    "Q4_K": (4, 32),
    "Q8_0": (8, 32),
    "Q5_0": (8, 32),
    "Q5_1": (8, 32),
    "Q5_K": (8, 32),
    "Q6_K": (8, 16),
    "Q3_K": (8, 16),
    "Q2_K": (8, 16),
    "IQ4_NL": (4, 32),  # the grid layout
    "IQ4_XS": (4, 32),
}
TYPES = list(FORMAT)
GGUF_QUANTIZED = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"}  # gguf.quants.quantize has these
# byte offsets of each block's f16 fields (d, dmin / m)
F16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "IQ4_NL": [0],
    "IQ4_XS": [0],
}
SHAPES = [(r, c) for r in (1, 3, 64) for c in (256, 512, 768)]


def _quantized(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[0, :64] = 0  # zero blocks / sub-blocks (d or sc of 0)
    if name in GGUF_QUANTIZED:
        return gguf.quants.quantize(x, QT[name])
    return quantize_k(x, name)


def _random_blocks(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes: every quant and packed-scale bit pattern; f16 fields finite, both signs."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[QT[name]]
    b = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        f = (rng.standard_normal(b.shape[:2]) * 0.05).astype(np.float16)
        f[rng.random(f.shape) < 0.05] = 0
        b[..., off : off + 2] = f.view(np.uint8).reshape(*f.shape, 2)
    return b.reshape(rows, -1)


def _assert_same_weights(got: np.ndarray, ref: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert np.isfinite(ref).all()
    assert np.array_equal(got, ref), f"max abs diff {np.abs(got - ref).max()}"
    # bit for bit, except that x + (-x) is +0.0 where gguf's d * 0 may be -0.0
    differ = got.view(np.uint32) != ref.view(np.uint32)
    assert (got[differ] == 0).all()


def _packed(name: str, rows: int, cols: int, random: bool = False) -> tuple[Packed, np.ndarray]:
    b = (_random_blocks if random else _quantized)(name, rows, cols)
    return repack(b, QT[name], (rows, cols)), gguf.quants.dequantize(b, QT[name])


def _assert_layout(p: Packed, bits: int, group: int, rows: int, cols: int) -> None:
    assert (p.bits, p.group, p.rows, p.cols) == (bits, group, rows, cols)
    assert p.q.dtype == np.uint8 and p.q.flags.c_contiguous
    assert p.q.shape == (rows, cols // 2 if bits == 4 else cols)
    for a in (p.scale, p.mn):
        assert a.dtype == np.float32 and a.flags.c_contiguous and a.shape == (rows, cols // group)


# ----------------------------------------------------------------------------- repack


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", TYPES)
def test_repack_dequantizes_as_gguf(name, shape):
    p, ref = _packed(name, *shape)
    _assert_layout(p, *FORMAT[name], *shape)
    assert p.grid == name.startswith("IQ4") and p.code == (20 if p.grid else p.bits)
    _assert_same_weights(p.dequantize(), ref)


@pytest.mark.parametrize("name", TYPES)
def test_repack_random_blocks(name):
    p, ref = _packed(name, 64, 512, random=True)
    _assert_layout(p, *FORMAT[name], 64, 512)
    _assert_same_weights(p.dequantize(), ref)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "IQ2_XXS", "IQ3_S", "TQ2_0", "MXFP4"])
def test_types_without_a_layout_repack_to_none(name):
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    if name in ("F32", "F16"):
        blocks = quantize_k(x, name)
    elif name == "BF16":
        blocks = gguf.quants.quantize(x, QT.BF16)
    else:  # no quantizer here: any bytes of the right size (repack looks only at the type)
        block_size, type_size = gguf.GGML_QUANT_SIZES[QT[name]]
        blocks = np.zeros((4, 256 // block_size * type_size), dtype=np.uint8)
    assert repack(blocks, QT[name], (4, 256)) is None


def test_repack_reads_read_only_blocks_and_refuses_wrong_sizes():
    b = _quantized("Q4_K", 3, 512)
    b.setflags(write=False)  # as a memory-mapped file's
    _assert_same_weights(repack(b, QT.Q4_K, (3, 512)).dequantize(), gguf.quants.dequantize(b, QT.Q4_K))
    with pytest.raises(ValueError):
        repack(b, QT.Q4_K, (3, 768))  # too few bytes
    with pytest.raises(ValueError):
        repack(_quantized("Q8_0", 2, 96), QT.Q8_0, (2, 80))  # not whole blocks
    with pytest.raises(ValueError):
        repack(b, QT.Q4_K, (3, 2, 256))


# ----------------------------------------------------------------------------- layout facts


def _blocks(name: str, rows: int, n_blocks: int, fill) -> np.ndarray:
    """Random blocks whose f16 fields and packed scales ``fill`` sets (so the codes are known)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[QT[name]]
    b = _random_blocks(name, rows, n_blocks * block_size, seed=1).reshape(rows, n_blocks, type_size)
    fill(b)
    return b.reshape(rows, -1)


def _f16_bytes(v: float) -> np.ndarray:
    return np.array([v], dtype=np.float16).view(np.uint8)


def _d1(b):  # Q4_0 / Q8_0 / Q5_0: d = 1
    b[..., 0:2] = _f16_bytes(1.0)


def _d1_m0(b):  # Q4_1 / Q5_1: d = 1, m = 0
    b[..., 0:2], b[..., 2:4] = _f16_bytes(1.0), _f16_bytes(0.0)


def _k_unit(b):  # Q4_K / Q5_K: d = 1, dmin = 0, all eight 6-bit scales 1, mins 0
    _d1_m0(b)
    b[..., 4:8], b[..., 8:12], b[..., 12:16] = 0x01, 0x00, 0x01


def test_bits4_nibble_order():
    """Byte 16g + j of a row: column 32g + j in the low nibble, 32g + 16 + j in the high one."""
    rows, cols = 3, 512
    for name, fill, offset in (("Q4_0", _d1, 8), ("Q4_1", _d1_m0, 0), ("Q4_K", _k_unit, 0)):
        block_size, type_size = gguf.GGML_QUANT_SIZES[QT[name]]
        blocks = _blocks(name, rows, cols // block_size, fill)
        codes = gguf.quants.dequantize(blocks, QT[name]) + offset
        assert (codes == np.round(codes)).all() and codes.min() == 0 and codes.max() == 15, name
        p = repack(blocks, QT[name], (rows, cols))
        _assert_layout(p, 4, 32, rows, cols)
        q = p.q.reshape(rows, cols // 32, 16)
        by_group = codes.reshape(rows, cols // 32, 32)
        np.testing.assert_array_equal(q & 0x0F, by_group[..., :16], err_msg=name)
        np.testing.assert_array_equal(q >> 4, by_group[..., 16:], err_msg=name)
        np.testing.assert_array_equal(p.values(), codes, err_msg=name)
        if name != "Q4_K":  # ggml's own Q4_0 / Q4_1 bytes, unchanged
            raw = blocks.reshape(rows, -1, type_size)[..., -16:]
            np.testing.assert_array_equal(p.q, raw.reshape(rows, -1), err_msg=name)


def test_bits8_codes():
    """bits=8: q[r, c] is column c's code, offset as the module's table says."""
    rows, cols = 3, 512

    def q6_k(b):
        b[..., 192:208], b[..., 208:210] = 1, _f16_bytes(1.0)

    def q3_k(b):  # every 6-bit scale 33: sc - 32 = 1
        b[..., 96:104], b[..., 104:108], b[..., 108:110] = 0x11, 0xAA, _f16_bytes(1.0)

    def q2_k(b):  # sc = 1, m = 0, dmin = 0
        b[..., 0:16], b[..., 80:82], b[..., 82:84] = 0x01, _f16_bytes(1.0), _f16_bytes(0.0)

    cases = [
        ("Q8_0", _d1, 128, 255),
        ("Q5_0", _d1, 16, 31),
        ("Q5_1", _d1_m0, 0, 31),
        ("Q5_K", _k_unit, 0, 31),
        ("Q6_K", q6_k, 32, 63),
        ("Q3_K", q3_k, 4, 7),
        ("Q2_K", q2_k, 0, 3),
    ]
    for name, fill, offset, top in cases:
        blocks = _blocks(name, rows, cols // gguf.GGML_QUANT_SIZES[QT[name]][0], fill)
        codes = gguf.quants.dequantize(blocks, QT[name]) + offset
        assert (codes == np.round(codes)).all() and codes.min() >= 0 and codes.max() <= top, name
        assert codes.min() == 0 and codes.max() == top, name  # the whole range was drawn
        p = repack(blocks, QT[name], (rows, cols))
        _assert_layout(p, *FORMAT[name], rows, cols)
        np.testing.assert_array_equal(p.q, codes, err_msg=name)
        np.testing.assert_array_equal(p.mn, np.float32(-offset) * p.scale, err_msg=name)


def test_packed_checks_its_arrays():
    q, s = np.zeros((2, 64), np.uint8), np.zeros((2, 4), np.float32)
    Packed(8, 16, q, s, s)
    with pytest.raises(ValueError):
        Packed(4, 16, q, s, s)  # no such format
    with pytest.raises(ValueError):
        Packed(8, 32, q, s, s)  # scale of the wrong width
    with pytest.raises(ValueError):
        Packed(8, 16, q.astype(np.int8), s, s)
    with pytest.raises(ValueError):
        Packed(8, 16, q, s.astype(np.float16), s)
    p = Packed(8, 16, np.zeros((64, 2), np.uint8).T, s, s)  # made contiguous
    assert p.q.flags.c_contiguous


# ----------------------------------------------------------------------------- widen, concat, slice


@pytest.mark.parametrize("name", TYPES)
def test_widen_keeps_the_weights(name):
    p, ref = _packed(name, 3, 512, random=True)
    for group in (16, 32):
        if p.group % group:
            with pytest.raises(ValueError):
                widen(p, group)
            continue
        w = widen(p, group)
        _assert_layout(w, 8, group, 3, 512)
        _assert_same_weights(w.dequantize(), ref)
        if (p.bits, p.group) == (8, group):
            assert w is p
    assert widen(widen(p, 16), 16).group == 16


def test_concat_rows_stacks_parts_of_one_format():
    q4_0, r1 = _packed("Q4_0", 3, 512, random=True)
    q4_k, r2 = _packed("Q4_K", 64, 512, random=True)
    q6_k, r3 = _packed("Q6_K", 1, 512, random=True)
    q8_0, r4 = _packed("Q8_0", 3, 512, random=True)

    fused = concat_rows([q4_0, q4_k, q4_0])  # a fused QKV of bits=4 parts
    _assert_layout(fused, 4, 32, 70, 512)
    _assert_same_weights(fused.dequantize(), np.concatenate([r1, r2, r1]))

    with pytest.raises(ValueError):
        concat_rows([q4_k, q6_k])  # formats differ: widen first
    mixed = concat_rows([widen(q4_k, 16), q6_k, widen(q8_0, 16)])
    _assert_layout(mixed, 8, 16, 68, 512)
    _assert_same_weights(mixed.dequantize(), np.concatenate([r2, r3, r4]))

    iq4, r5 = _packed("IQ4_NL", 2, 512, random=True)
    with pytest.raises(ValueError):
        concat_rows([q4_0, iq4])  # codes and grid codes: widen first
    _assert_same_weights(concat_rows([iq4, iq4]).dequantize(), np.concatenate([r5, r5]))
    _assert_same_weights(concat_rows([widen(q4_0, 32), widen(iq4, 32)]).dequantize(), np.concatenate([r1, r5]))

    with pytest.raises(ValueError):
        concat_rows([q4_k, _packed("Q4_K", 3, 256)[0]])  # widths differ
    with pytest.raises(ValueError):
        concat_rows([])
    assert concat_rows([q6_k]).q.shape == q6_k.q.shape


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "Q6_K", "IQ4_XS"])
def test_slice_cols_takes_a_shard(name):
    p, ref = _packed(name, 3, 768, random=True)
    for start, length in ((0, 384), (384, 384), (p.group, 2 * p.group), (0, 768), (768 - p.group, p.group)):
        s = slice_cols(p, start, length)
        _assert_layout(s, p.bits, p.group, 3, length)
        _assert_same_weights(s.dequantize(), np.ascontiguousarray(ref[:, start : start + length]))
    for start, length in ((8, 64), (0, p.group + 8), (0, 0), (-p.group, p.group), (768 - p.group, 2 * p.group)):
        with pytest.raises(ValueError):
            slice_cols(p, start, length)
