"""GGUF quantized blocks repacked into the two layouts Tandem's CPU kernels read.

A :class:`Packed` matrix is ``weight[r, c] = scale[r, c // group] * q[r, c] + mn[r, c // group]``
(float32) with, per format:

* ``bits=4, group=32``: ``q`` uint8 ``[rows, cols // 2]``; for column group ``g`` (columns
  ``32g .. 32g+31``) byte ``16g + j`` of a row holds column ``32g + j`` in its low nibble and
  column ``32g + 16 + j`` in its high nibble (ggml's own Q4_0 / Q4_1 order), values 0..15;
* ``bits=8, group=16`` or ``32``: ``q`` uint8 ``[rows, cols]``, values 0..255;
* ``bits=4, group=32, grid=True``: the 4-bit layout whose values are codes into IQ4_NL's
  non-linear grid: the weight's ``q`` is ``GRID_VALUES[code]`` (ggml's int8 grid + 128);
  the kernels take it as the code ``bits | GRID`` (`Packed.code`);
* all: ``scale`` and ``mn`` float32 ``[rows, cols // group]``; every array C-contiguous.

:func:`repack` turns a GGUF tensor's blocks into one of them without losing anything:

========  ==============================  =========================================
type      format                          q, scale, mn
========  ==============================  =========================================
Q4_0      bits 4, group 32                q, d, -8d
Q4_1      bits 4, group 32                q, d, m
Q4_K      bits 4, group 32                q, d*sc, -(dmin*m)      (6-bit sc, m)
Q8_0      bits 8, group 32                q + 128, d, -128d
Q5_0      bits 8, group 32                q, d, -16d
Q5_1      bits 8, group 32                q, d, m
Q5_K      bits 8, group 32                q, d*sc, -(dmin*m)
Q6_K      bits 8, group 16                q, d*sc, -32*(d*sc)     (int8 sc)
Q3_K      bits 8, group 16                q + 4, d*(sc-32), -4*(d*(sc-32))
Q2_K      bits 8, group 16                q, d*(sc&15), -(dmin*(sc>>4))
IQ4_NL    bits 4, group 32, grid          code, d, -128d          (grid[code] + 128)
IQ4_XS    bits 4, group 32, grid          code, d*(ls-32), -128*(d*(ls-32))  (6-bit ls)
========  ==============================  =========================================

Scales are computed in float32 exactly as ``gguf.quants`` computes them (the f16 ``d`` widened,
then one float32 product with the small integer). Every product ``scale * q`` is then exact in
float32 (at most 24 significant bits) and so is each offset ``mn``, so ``scale * q + mn`` rounds
at most once, where gguf's ``d * (q - k)`` / ``d * q - dm`` does: :meth:`Packed.dequantize`
equals ``gguf.quants.dequantize`` value for value for every type above (max abs difference 0;
only the sign of a zero weight may differ, e.g. ``-0.0`` where a block's ``d`` is ``-0.0``).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType
QK_K = 256

# The (bits, group) formats the kernels take.
FORMATS = frozenset({(4, 32), (8, 16), (8, 32)})
# `bits | GRID`: the kernels' code of the grid layout (the C++ kernel's kGrid).
GRID = 16
# IQ4_NL / IQ4_XS values: a 4-bit code into ggml's non-linear grid of int8 values; the layout's
# q is the grid value plus 128 (1..241), unsigned as the 8-bit layout's.
GRID_VALUES = (np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.int16) + 128).astype(np.uint8)


@dataclass
class Packed:
    """A matrix in one of the formats above (arrays made C-contiguous on construction)."""

    bits: int
    group: int
    q: np.ndarray
    scale: np.ndarray
    mn: np.ndarray
    grid: bool = False  # bits 4 only: q's values are codes into GRID_VALUES

    def __post_init__(self) -> None:
        if (self.bits, self.group) not in FORMATS or (self.grid and self.bits != 4):
            raise ValueError(f"no packed format with bits={self.bits}, group={self.group}, grid={self.grid}")
        if self.q.dtype != np.uint8 or self.q.ndim != 2:
            raise ValueError(f"q must be a 2-D uint8 array, got {self.q.dtype} {self.q.shape}")
        rows, cols = self.rows, self.cols
        if cols % self.group:
            raise ValueError(f"{cols} columns are not a whole number of groups of {self.group}")
        for name in ("scale", "mn"):
            a = getattr(self, name)
            if a.dtype != np.float32 or a.shape != (rows, cols // self.group):
                raise ValueError(f"{name} must be float32 {(rows, cols // self.group)}, got {a.dtype} {a.shape}")
        self.q = np.ascontiguousarray(self.q)
        self.scale = np.ascontiguousarray(self.scale)
        self.mn = np.ascontiguousarray(self.mn)

    @property
    def layout(self) -> tuple[int, int, bool]:
        return self.bits, self.group, self.grid

    @property
    def code(self) -> int:
        """The kernels' `bits` argument: bits, or bits | GRID for the grid layout."""
        return self.bits | GRID if self.grid else self.bits

    def take_rows(self, rows) -> Packed:
        """The rows ``rows`` (an index array or slice) in the same layout."""
        return Packed(self.bits, self.group, self.q[rows], self.scale[rows], self.mn[rows], self.grid)

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    @property
    def cols(self) -> int:
        return self.q.shape[1] * (2 if self.bits == 4 else 1)

    def values(self) -> np.ndarray:
        """q as one uint8 per weight, ``[rows, cols]`` (nibbles unpacked for bits=4, grid codes
        looked up)."""
        if self.bits == 8:
            return self.q
        return GRID_VALUES[_unpack4(self.q)] if self.grid else _unpack4(self.q)

    def dequantize(self) -> np.ndarray:
        """The weights, float32 ``[rows, cols]``: ``scale * q + mn`` (two float32 roundings,
        no fused multiply-add), the reference the kernels are tested against."""
        rows, cols, group = self.rows, self.cols, self.group
        q = self.values().reshape(rows, cols // group, group).astype(np.float32)
        w = self.scale[:, :, None] * q + self.mn[:, :, None]
        return w.reshape(rows, cols)


# ----------------------------------------------------------------------------- nibbles


def _pack4(v: np.ndarray) -> np.ndarray:
    """uint8 values 0..15 ``[rows, cols]`` -> the bits=4 layout ``[rows, cols // 2]``."""
    rows, cols = v.shape
    v = v.reshape(rows, cols // 32, 2, 16)
    return (v[:, :, 0] | (v[:, :, 1] << np.uint8(4))).reshape(rows, cols // 2)


def _unpack4(q: np.ndarray) -> np.ndarray:
    """The bits=4 layout ``[rows, cols // 2]`` -> uint8 values ``[rows, cols]``."""
    rows, half = q.shape
    q = q.reshape(rows, half // 16, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(rows, half * 2)


# ----------------------------------------------------------------------------- per type
# Each takes the blocks as uint8 [rows, n_blocks, type_size] and returns (bits, group, q,
# scale, mn) with q [rows, cols] (bits 8) or [rows, cols // 2] (bits 4) and scale / mn
# [rows, n_blocks * groups per block]; rows and cols come from the caller.


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per entry of the last axis [..., 2] -> float32 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _bits(b: np.ndarray, shifts, mask: int) -> np.ndarray:
    """``(b[..., None, :] >> shifts[:, None]) & mask``: [..., n] -> [..., len(shifts), n]."""
    s = np.array(shifts, dtype=np.uint8).reshape(-1, 1)
    return (b[..., None, :] >> s) & np.uint8(mask)


def _flat(a: np.ndarray) -> np.ndarray:
    """[rows, n_blocks, ...] -> [rows, n_blocks * ...]."""
    return a.reshape(a.shape[0], -1)


def _q4_0(b):
    d = _f16(b[..., 0:2])
    return 4, 32, _flat(b[..., 2:18]), d, d * np.float32(-8)


def _q4_1(b):
    return 4, 32, _flat(b[..., 4:20]), _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _q5(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 values: value j < 16 the low nibble of qs[j], 16 + j its high nibble; bit 4
    of value i is bit i of the little-endian uint32 qh."""
    low = _bits(qs, [0, 4], 0x0F)  # [..., 2, 16]
    high = np.unpackbits(qh, axis=-1, bitorder="little")  # [..., 32], value i
    return _flat(low.reshape(*qs.shape[:-1], 32) | (high << np.uint8(4)))


def _q5_0(b):
    d = _f16(b[..., 0:2])
    return 8, 32, _q5(b[..., 2:6], b[..., 6:22]), d, d * np.float32(-16)


def _q5_1(b):
    return 8, 32, _q5(b[..., 4:8], b[..., 8:24]), _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _q8_0(b):
    d = _f16(b[..., 0:2])
    return 8, 32, _flat(b[..., 2:34] ^ np.uint8(0x80)), d, d * np.float32(-128)


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's eight 6-bit scales and mins from 12 bytes [..., 12] -> two [..., 8]."""
    d, m, m_d = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_affine(b):
    """Q4_K/Q5_K's per-32 scale d*sc and offset -(dmin*m), float32 [rows, n_blocks * 8]."""
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, m = _k_scale_min(b[..., 4:16])
    return _flat(d * sc.astype(np.float32)), _flat(-(dmin * m.astype(np.float32)))


def _q4_k(b):
    # qs: 4 chunks of 32 bytes; chunk c holds sub-block 2c in its low nibbles and 2c + 1 in
    # its high ones, value j in byte j. The layout wants sub-block g's values j and 16 + j
    # together in byte 16g + j.
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 2, 16)  # [..., c, half, j]
    lo, hi = qs[..., 0, :], qs[..., 1, :]
    even = (lo & np.uint8(0x0F)) | ((hi & np.uint8(0x0F)) << np.uint8(4))
    odd = (lo >> np.uint8(4)) | (hi & np.uint8(0xF0))
    q = np.stack([even, odd], axis=-2)  # [..., c, 2, 16]: sub-block 2c + t
    return (4, 32, _flat(q), *_k_affine(b))


def _q5_k(b):
    low = _bits(b[..., 48:176].reshape(*b.shape[:-1], 4, 32), [0, 4], 0x0F)  # [..., 4, 2, 32]
    high = _bits(b[..., 16:48], range(8), 0x01)  # [..., 8, 32]: sub-block s is bit s
    q = low.reshape(high.shape) | (high << np.uint8(4))
    return (8, 32, _flat(q), *_k_affine(b))


def _q6_k(b):
    low = _bits(b[..., 0:128].reshape(*b.shape[:-1], 2, 64), [0, 4], 0x0F)  # [..., 2, 2, 64]
    high = _bits(b[..., 128:192].reshape(*b.shape[:-1], 2, 32), [0, 2, 4, 6], 0x03)  # [..., 2, 4, 32]
    q = low.reshape(*b.shape[:-1], QK_K) | (high.reshape(*b.shape[:-1], QK_K) << np.uint8(4))
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    scale = _f16(b[..., 208:210])[..., None] * sc
    return 8, 16, _flat(q), _flat(scale), _flat(scale * np.float32(-32))


def _q3_k(b):
    # 16 6-bit scales: low nibbles in bytes 0..7 (scales 0..7 low, 8..15 high), top two
    # bits in bytes 8..11 (scale j's at bits 2*(j // 4) of byte 8 + j % 4).
    s = b[..., 96:108]
    lsc = _bits(s[..., 0:8], [0, 4], 0x0F).reshape(*b.shape[:-1], 16)
    hsc = _bits(s[..., 8:12], [0, 2, 4, 6], 0x03).reshape(*b.shape[:-1], 16)
    sc = ((lsc | (hsc << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32)
    scale = _f16(b[..., 108:110])[..., None] * sc
    low = _bits(b[..., 32:96].reshape(*b.shape[:-1], 2, 32), [0, 2, 4, 6], 0x03)  # [..., 2, 4, 32]
    high = _bits(b[..., 0:32], range(8), 0x01)  # [..., 8, 32]; gguf: q = low - 4 * (1 - high)
    q = low.reshape(*b.shape[:-1], QK_K) | (high.reshape(*b.shape[:-1], QK_K) << np.uint8(2))
    return 8, 16, _flat(q), _flat(scale), _flat(scale * np.float32(-4))


def _q2_k(b):
    s = b[..., 0:16]
    d, dmin = _f16(b[..., 80:82])[..., None], _f16(b[..., 82:84])[..., None]
    scale = d * (s & np.uint8(0x0F)).astype(np.float32)
    mn = -(dmin * (s >> np.uint8(4)).astype(np.float32))
    q = _bits(b[..., 16:80].reshape(*b.shape[:-1], 2, 32), [0, 2, 4, 6], 0x03)  # [..., 2, 4, 32]
    return 8, 16, _flat(q), _flat(scale), _flat(mn)


# IQ4_NL / IQ4_XS: per 32 values 16 bytes of grid codes in ggml's Q4 nibble order (value j the
# low nibble of byte j, 16 + j its high one): the 4-bit layout's bytes as they are.


def _iq4_nl(b):
    d = _f16(b[..., 0:2])
    return 4, 32, _flat(b[..., 2:18]), d, d * np.float32(-128)


def _iq4_xs(b):
    # Eight 6-bit scales: sub-block s's low four bits in byte 4 + s // 2 (nibble s % 2), its
    # top two at bits 2s of the little-endian uint16 in bytes 2..3; scale d * (ls - 32).
    lead = b.shape[:-1]
    low = _bits(b[..., 4:8], [0, 4], 0x0F).swapaxes(-1, -2).reshape(*lead, 8)
    high = _bits(b[..., 2:4], [0, 2, 4, 6], 0x03).swapaxes(-1, -2).reshape(*lead, 8)
    ls = (low | (high << np.uint8(4))).astype(np.float32) - np.float32(32)
    scale = _f16(b[..., 0:2])[..., None] * ls
    return 4, 32, _flat(b[..., 8:136]), _flat(scale), _flat(scale * np.float32(-128))


_REPACKERS = {
    QT.Q4_0: _q4_0,
    QT.Q4_1: _q4_1,
    QT.Q4_K: _q4_k,
    QT.Q8_0: _q8_0,
    QT.Q5_0: _q5_0,
    QT.Q5_1: _q5_1,
    QT.Q5_K: _q5_k,
    QT.Q6_K: _q6_k,
    QT.Q3_K: _q3_k,
    QT.Q2_K: _q2_k,
    QT.IQ4_NL: _iq4_nl,
    QT.IQ4_XS: _iq4_xs,
}

SUPPORTED_QTYPES = frozenset(_REPACKERS)
GRID_QTYPES = frozenset({QT.IQ4_NL, QT.IQ4_XS})  # their codes index GRID_VALUES


def repack(blocks: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]) -> Packed | None:
    """A GGUF matrix (``blocks``: its rows of ggml blocks, uint8 ``[rows, bytes_per_row]``;
    ``shape``: ``(rows, cols)``) in its packed format; None for a type without one (F32,
    F16, BF16, the IQ types, ...)."""
    fn = _REPACKERS.get(QT(qtype))
    if fn is None:
        return None
    if len(shape) != 2:
        raise ValueError(f"repack takes a matrix, got shape {tuple(shape)}")
    rows, cols = (int(n) for n in shape)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block_size:
        raise ValueError(f"{QT(qtype).name} rows are whole blocks of {block_size}, got {cols} columns")
    b = np.asarray(blocks)
    if b.dtype != np.uint8:
        b = np.ascontiguousarray(b).view(np.uint8)
    if b.size != rows * (cols // block_size) * type_size:
        raise ValueError(f"{b.size} bytes are not a {QT(qtype).name} tensor of shape {(rows, cols)}")
    bits, group, q, scale, mn = fn(b.reshape(rows, cols // block_size, type_size))
    return Packed(bits, group, q.reshape(rows, -1), scale, mn, QT(qtype) in GRID_QTYPES)


def widen(p: Packed, group: int) -> Packed:
    """``p`` as bits=8 with groups of ``group`` (a divisor of ``p.group``: scale and mn
    repeated), the same weights: to merge parts of different formats into one matrix.
    ``p`` itself when it is already in that format; the result may share ``p``'s q."""
    if (8, group) not in FORMATS or p.group % group:
        raise ValueError(f"cannot widen bits={p.bits}, group={p.group} to bits=8, group={group}")
    # (a grid's values are 1..241: the 8-bit layout holds them as they are)
    if p.bits == 8 and p.group == group:
        return p
    reps = p.group // group
    return Packed(8, group, p.values(), np.repeat(p.scale, reps, axis=1), np.repeat(p.mn, reps, axis=1))


def concat_rows(parts: list[Packed]) -> Packed:
    """Parts of one format and width stacked along rows (a fused QKV or gate-up layer)."""
    if not parts:
        raise ValueError("concat_rows needs at least one part")
    first = parts[0]
    for p in parts[1:]:
        if p.layout != first.layout:
            raise ValueError(f"cannot stack layout {p.layout} under {first.layout}: widen first")
        if p.cols != first.cols:
            raise ValueError(f"cannot stack {p.cols} columns under {first.cols}")
    return Packed(
        first.bits,
        first.group,
        np.concatenate([p.q for p in parts], axis=0),
        np.concatenate([p.scale for p in parts], axis=0),
        np.concatenate([p.mn for p in parts], axis=0),
        first.grid,
    )


def slice_cols(p: Packed, start: int, length: int) -> Packed:
    """Columns ``start .. start + length`` of ``p`` (a tensor-parallel shard), a copy; both
    ends must lie on group boundaries."""
    stop = start + length
    if length <= 0 or start < 0 or stop > p.cols:
        raise ValueError(f"columns {start}..{stop} are not within 0..{p.cols}")
    if start % p.group or length % p.group:
        raise ValueError(f"columns {start}..{stop} do not start and end on groups of {p.group}")
    per_byte = 2 if p.bits == 4 else 1
    g0, g1 = start // p.group, stop // p.group
    return Packed(
        p.bits,
        p.group,
        p.q[:, start // per_byte : stop // per_byte].copy(),
        p.scale[:, g0:g1].copy(),
        p.mn[:, g0:g1].copy(),
        p.grid,
    )
