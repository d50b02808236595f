// y = x @ W.T with W kept quantized: the decode-time matmul of GGUF weights on CPU.
//
// W [N, K] is in one of Tandem's two layouts (tandem/layers/quantization/gguf_repack.py),
// in which every supported GGUF block type is exact: per group of `group` columns a
// scale and offset (float32, or float16 where that holds them exactly: 2 bytes fewer a
// group, for the types whose scales are float16 in the file), W[n, k] = scale[n, k / group] * q[n, k] + mn[n, k / group], with
//   bits 4 (group 32): q packed two to a byte, ggml's Q4 order: byte 16g + j of a row holds
//                      column 32g + j in its low nibble and column 32g + 16 + j in its high;
//   bits 8 (group 16 or 32): one uint8 q per column;
//   bits 4 | kGrid (group 32): the 4-bit layout whose codes index IQ4_NL's grid of values
//                      (kGridValues: ggml's int8 grid plus 128), q[n, k] the grid value of the
//                      code: IQ4_NL / IQ4_XS at the 4-bit layout's bytes. The AVX-512 VNNI and
//                      float paths take it; the AVX2 path in its stored tiles only (without
//                      them the caller widens it to bits 8: gguf_repack.widen).
// The paths, chosen when the library is built for the machine it runs on (-march=native; the
// cached build's name hashes the CPU's flags, so another CPU gets its own build):
// - float32 rows (unless the caller asks for int8 activations: `int8_x`) and every row where the
//   CPU lacks AVX2 are multiplied in float32:
//   y[r, n] = sum_g (sum_k (scale * q) * x[r, k]) + sum_g mn * (sum_k x[r, k]), the products
//   scale * q rounded as a dequantized weight is, so a result differs from
//   dequantize-then-matmul only by the summation order (widening by AVX-512F, AVX2 or plain
//   loops);
// - bfloat16 / float16 rows (and float32 rows with `int8_x`) with AVX-512 VNNI: x quantized per
//   32 columns to int8 and integer dot products (llama.cpp's recipe; the VNNI section below says
//   what it computes);
// - the same rows with AVX2 but not AVX-512 VNNI: the same int8 recipe, the same
//   integer sums, by AVX-VNNI's VPDPBUSD or AVX2's VPMADDUBSW (the AVX2 section below; code
//   of its own, so that the AVX-512 VNNI path's results stay bit-identical:
//   tests/data/quant_linear_avx512_vnni.json).
// Output rows (N) are split over PyTorch's OpenMP threads; the int8 paths read each weight byte
// from memory once for all rows of x (tiles of kTileRows weight rows), the float path once for
// up to four rows at a time. From kGemmRows rows of x on, the AVX-512 VNNI path transposes each
// tile of weight rows once so that every int32 lane is one output (gemm_rows, below); given the
// tiles stored at load (quant_tiles), rows of any count read packed tiles of that order instead
// (gemv_rows: below kGemmRows the row kernel's integer products, summed in another order). The
// AVX2 path's own stored tiles (8 weight rows each, avx2_tile_rows) serve rows of any count too.
// `quant_linear_isa()` names the paths of this build.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace tandem_cpu;

typedef uint8_t u8x16 __attribute__((vector_size(16)));

constexpr int kRowBlock = 4;  // rows of x sharing one read of a weight row
// `bits | kGrid`: the grid layout (above); kGridValues[code] = ggml's kvalues_iq4nl[code] + 128.
constexpr int64_t kGrid = 16;
alignas(16) constexpr uint8_t kGridValues[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
// Weight rows whose blocks the int8 paths multiply by every row block of x before the next ones
// (<= 32 x 1.5 KB: from L1/L2 after the first row block, instead of one stream from memory for
// each); a multiple of the 16 (8) outputs whose lanes are summed together.
constexpr int64_t kTileRows = 32;
// Bytes ahead of the weight stream that the int8 paths ask for (software prefetch): with the
// hardware prefetchers alone a core read the blocks at about half a plain read's rate.
constexpr int64_t kPrefetch = 2048;

inline float lane_sum(vec16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// 16 bytes as 16 floats. GCC scalarizes this widening in vector-extension form, so the
// x86 paths are written with intrinsics; elsewhere a plain loop.
inline vec16 bytes_to_floats(u8x16 b) {
  vec16 out;
#if defined(__AVX512F__)
  __m128i v;
  std::memcpy(&v, &b, sizeof(v));
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
  std::memcpy(&out, &f, sizeof(out));
#elif defined(__AVX2__)
  __m128i v;
  std::memcpy(&v, &b, sizeof(v));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
  std::memcpy(&out, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof(lo), &hi, sizeof(hi));
#else
  for (int i = 0; i < 16; ++i) out[i] = static_cast<float>(b[i]);
#endif
  return out;
}

inline u8x16 load_bytes(const uint8_t* p) {
  u8x16 b;
  std::memcpy(&b, p, sizeof(b));
  return b;
}

// 16 4-bit codes (one per byte) as their grid values.
inline u8x16 grid_bytes(u8x16 codes) {
  u8x16 out;
  for (int i = 0; i < 16; ++i) out[i] = kGridValues[codes[i]];
  return out;
}

// The 16-column slices of one weight group, scaled: `parts` vectors (2 for 32 columns, 1 for 16).
template <int BITS, int GROUP, bool GRID>
inline void group_weights(const uint8_t* q, float scale, vec16* w) {
  if constexpr (BITS == 4) {
    const u8x16 b = load_bytes(q);
    const u8x16 lo = b & 15, hi = b >> 4;
    w[0] = bytes_to_floats(GRID ? grid_bytes(lo) : lo) * scale;
    w[1] = bytes_to_floats(GRID ? grid_bytes(hi) : hi) * scale;
  } else {
    w[0] = bytes_to_floats(load_bytes(q)) * scale;
    if constexpr (GROUP == 32) w[1] = bytes_to_floats(load_bytes(q + 16)) * scale;
  }
}

// A scale or offset as float: float32 as is, float16 by F16C where the CPU has it.
inline float to_float(float v) { return v; }
inline float to_float(c10::Half v) {
#if defined(__F16C__)
  return _cvtsh_ss(v.x);
#else
  return static_cast<float>(v);
#endif
}

// NR rows of x (float32 [.., K], from `x`) times output rows [n0, n1) (+ bias[n]): y[r * N + n],
// rounded to T. S: the dtype of the scales and offsets.
template <int BITS, int GROUP, bool GRID, int NR, typename T, typename S>
void quant_block(const float* x, const float* xsum, const uint8_t* q, const S* scale, const S* mn,
                 const float* bias, T* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int kParts = GROUP / 16;
  const int64_t G = K / GROUP;
  const int64_t row_bytes = BITS == 4 ? K / 2 : K;
  constexpr int64_t group_bytes = BITS == 4 ? GROUP / 2 : GROUP;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = q + n * row_bytes;
    const S* sn = scale + n * G;
    vec16 acc[NR] = {};
    for (int64_t g = 0; g < G; ++g) {
      vec16 w[kParts];
      group_weights<BITS, GROUP, GRID>(qn + g * group_bytes, to_float(sn[g]), w);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const float* xg = x + r * K + g * GROUP;
#pragma GCC unroll 2
        for (int p = 0; p < kParts; ++p) acc[r] += w[p] * load16(xg + 16 * p);
      }
    }
    const S* mnn = mn + n * G;
    for (int r = 0; r < NR; ++r) {
      const float* xs = xsum + r * G;
      float offset = 0.f;
      for (int64_t g = 0; g < G; ++g) offset += to_float(mnn[g]) * xs[g];
      y[r * N + n] = static_cast<T>(lane_sum(acc[r]) + offset + (bias ? bias[n] : 0.f));
    }
  }
}

// Every row of x (float32 [R, K]) times output rows [n0, n1), up to kRowBlock rows of x per
// read of the weights.
template <int BITS, int GROUP, bool GRID, typename T, typename S>
void quant_rows(const float* x, const float* xsum, const uint8_t* q, const S* scale, const S* mn,
                const float* bias, T* y, int64_t R, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = K / GROUP;
  for (int64_t r0 = 0; r0 < R; r0 += kRowBlock) {
    const float* xr = x + r0 * K;
    const float* xs = xsum + r0 * G;
    T* yr = y + r0 * N;
    switch (std::min<int64_t>(kRowBlock, R - r0)) {
      case 1: quant_block<BITS, GROUP, GRID, 1, T, S>(xr, xs, q, scale, mn, bias, yr, K, N, n0, n1); break;
      case 2: quant_block<BITS, GROUP, GRID, 2, T, S>(xr, xs, q, scale, mn, bias, yr, K, N, n0, n1); break;
      case 3: quant_block<BITS, GROUP, GRID, 3, T, S>(xr, xs, q, scale, mn, bias, yr, K, N, n0, n1); break;
      default: quant_block<BITS, GROUP, GRID, 4, T, S>(xr, xs, q, scale, mn, bias, yr, K, N, n0, n1); break;
    }
  }
}

// One row of x (K columns) rounded to int8 per block of 32 columns (each int8 path's own: qx
// past K zero, d[b] = max|x| / 127, the same bytes on every path).
template <typename T>
inline void quantize_row(const T* row, int64_t K, int8_t* qx, float* dblock);

// x's columns 32b .. 32b + 31 of one row (K columns, a multiple of 16) as two vec16, zero past
// K: what each ISA's quantize_row rounds.
template <typename T>
inline void load_block32(const T* row, int64_t K, int64_t b, vec16* f) {
  for (int p = 0; p < 2; ++p) f[p] = 32 * b + 16 * p < K ? load16(row + 32 * b + 16 * p) : vec16{};
}

// gsum[g] = d * sum(qx) over each weight group g of one rounded row (and isum[g] = that sum,
// where asked for).
inline void group_sums(const int8_t* qx, const float* dblock, int64_t G, int64_t group, float* gsum,
                       int32_t* isum = nullptr) {
  for (int64_t g = 0; g < G; ++g) {
    int sum = 0;
    for (int64_t k = g * group; k < (g + 1) * group; ++k) sum += qx[k];
    gsum[g] = dblock[g * group / 32] * static_cast<float>(sum);
    if (isum) isum[g] = sum;
  }
}

// Rows of x rounded to int8 (quantize_row), kept in column order: qx[r * stride + k],
// d[r * blocks + k / 32], gsum[r * G + g] = d * sum(qx) over weight group g, isum[r * G + g] =
// that sum(qx) itself.
struct RowsX {
  int64_t stride = 0, blocks = 0, G = 0;
  std::vector<int8_t> qx;
  std::vector<float> d, gsum;
  std::vector<int32_t> isum;
};

template <typename T>
RowsX quantize_rows(const T* x, int64_t stride, int64_t R, int64_t K, int64_t group) {
  RowsX X;
  X.blocks = (K + 31) / 32;
  X.stride = 32 * X.blocks;
  X.G = K / group;
  X.qx.assign(R * X.stride, 0);
  X.d.assign(R * X.blocks, 0.f);
  X.gsum.assign(R * X.G, 0.f);
  X.isum.assign(R * X.G, 0);
  // Rows split over PyTorch's threads (prefill's many rows; inside decode_layers' region, where
  // every thread needs all rows, at::parallel_for runs them on the calling thread).
  at::parallel_for(0, R, tandem_cpu::row_grain(K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int8_t* qx = X.qx.data() + r * X.stride;
      float* d = X.d.data() + r * X.blocks;
      quantize_row(x + r * stride, K, qx, d);
      group_sums(qx, d, X.G, group, X.gsum.data() + r * X.G, X.isum.data() + r * X.G);
    }
  });
  return X;
}

// c where every offset of a tile is -c times its scale (mn = -c * scale: the weights are
// scale * (q - c), as Q4_0's q - 8 and the 8-bit layout's Q8_0 q - 128), an integer in [0, 255];
// else -1. Such a tile's integer sums take -c * sum(qx) (exact) instead of a float term.
inline int32_t symmetric_offset(const float* ws, const float* wmn, int64_t count) {
  float c = -1.f;
  for (int64_t i = 0; i < count; ++i) {
    if (ws[i] == 0.f) {
      if (wmn[i] != 0.f) return -1;
      continue;
    }
    if (c < 0.f) {
      c = -wmn[i] / ws[i];
      if (!(c >= 0.f && c <= 255.f) || c != std::nearbyint(c)) return -1;
    }
    if (-c * ws[i] != wmn[i]) return -1;
  }
  return c < 0.f ? 0 : static_cast<int32_t>(c);
}

// The tile kind quant_tiles stores for W (bits, its codes q [N, row bytes]): a narrow tile (1 +
// planes) for an 8-bit weight whose codes lie below 64, else 0.
inline int32_t narrow_kind(const at::Tensor& q, int64_t bits) {
  if (bits != 8 || q.numel() == 0) return 0;
  const int top = q.max().item<uint8_t>();
  return top < 16 ? 1 : top < 32 ? 2 : top < 64 ? 3 : 0;
}

// Compact scales (both tiled paths: the AVX-512 VNNI path's packed tiles, the AVX2 path's tiles
// of 8 rows) factor a row's float32 scales per super-block of kSuperCols columns.
constexpr int64_t kSuperCols = 256;

// One row's values of a super-block (v[0 .. n)) as d * k[j] exactly in float32, k int8: the
// factor of the largest magnitude tried as it divided by 1 .. 128 (either sign; the true one is
// among them where the values are a float16 times small integers, as the K-quants' are).
inline bool factor_block(const float* v, int n, float& d, int8_t* k) {
  int top = 0;
  for (int j = 0; j < n; ++j) {
    if (!std::isfinite(v[j])) return false;
    if (std::fabs(v[j]) > std::fabs(v[top])) top = j;
  }
  if (v[top] == 0.f) {
    d = 0.f;
    std::fill(k, k + n, 0);
    return true;
  }
  for (int div = 1; div <= 128; ++div)
    for (int sign = 1; sign >= -1; sign -= 2) {
      const float cand = v[top] / static_cast<float>(sign * div);
      bool ok = true;
      for (int j = 0; j < n && ok; ++j) {
        const float r = std::nearbyint(v[j] / cand);
        ok = r >= -128.f && r <= 127.f && cand * r == v[j] && !(v[j] == 0.f && std::signbit(v[j]) != std::signbit(cand * r));
        if (ok) k[j] = static_cast<int8_t>(r);
      }
      if (ok) {
        d = cand;
        return true;
      }
    }
  return false;
}

// A [N, G] float32 array (scales or offsets) factored per row and super-block (`factor_block`):
// d[n * B + b], k[n * G + g]; false where some block does not factor.
struct Factors {
  std::vector<float> d;
  std::vector<int8_t> k;
};
inline bool factor_rows(const float* v, int64_t N, int64_t G, int64_t per_block, Factors& f) {
  const int64_t B = G / per_block;
  f.d.assign(N * B, 0.f);
  f.k.assign(N * G, 0);
  std::atomic<bool> ok{G % per_block == 0};
  if (!ok) return false;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1 && ok; ++n)
      for (int64_t b = 0; b < B && ok; ++b)
        if (!factor_block(v + n * G + b * per_block, static_cast<int>(per_block), f.d[n * B + b],
                          f.k.data() + n * G + b * per_block))
          ok = false;
  });
  return ok;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
// ----------------------------------------------------------------------------------------------
// bfloat16 / float16 rows: int8 activations and VNNI integer dot products (llama.cpp's recipe).
//
// Each row of x is quantized per block of 32 columns to int8: d = max|x| / 127 and
// qx = round(x * (1 / d)) to nearest even, so that x ~ d * qx. A 64-byte chunk of a weight row
// (128 columns of the 4-bit layout, 64 of the 8-bit ones) meets the matching int8 of x in
// VPDPBUSD (unsigned weight bytes times signed activations, four exact products summed into
// each of 16 int32 lanes); each lane's sum is scaled by its weight group's scale and its x
// block's d:  y[r, n] = sum_lanes float(isum) * scale * d + sum_g mn[n, g] * (d * sum_group qx).
// The one approximation is x rounded to int8 (at most half a step, max|x_block| / 254).

constexpr int64_t kChunk = 64;  // weight bytes per step

// x quantized for the chunks of a weight row: per row r and chunk i, `lo` (64 int8) meets the
// chunk's bytes (the low nibbles of the 4-bit layout), `hi` (4-bit only) its high nibbles, `d`
// (16 floats) is each int32 lane's x scale (zero past K), and gsum[r][g] = d * sum(qx) over
// weight group g.
struct QuantizedX {
  int64_t chunks = 0, G = 0;
  std::vector<int8_t> lo, hi;
  std::vector<float> d, gsum;
};

// One row of x (K columns) rounded to int8 per block of 32 columns: d[b] = max|x| / 127 and
// qx = round(x * (1 / d)) to nearest even, saturated (qx past K left as it is: zero).
template <typename T>
inline void quantize_row(const T* row, int64_t K, int8_t* qx, float* dblock) {
  for (int64_t b = 0; 32 * b < K; ++b) {
    const int parts = K - 32 * b >= 32 ? 2 : 1;  // K is a multiple of 16
    vec16 f[2];
    load_block32(row, K, b, f);
    __m512 v[2];
    std::memcpy(v, f, sizeof(v));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    for (int p = 0; p < parts; ++p) {
      const __m128i q8 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v[p], _mm512_set1_ps(id))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + 32 * b + 16 * p), q8);
    }
    dblock[b] = d;
  }
}

template <typename T>
QuantizedX quantize_x(const T* x, int64_t stride, int64_t R, int64_t K, int64_t bits, int64_t group) {
  QuantizedX X;
  const int64_t row_bytes = bits == 4 ? K / 2 : K;
  const int64_t cols_pad = (row_bytes + kChunk - 1) / kChunk * kChunk * (bits == 4 ? 2 : 1);
  X.chunks = (row_bytes + kChunk - 1) / kChunk;
  X.G = K / group;
  X.lo.assign(R * X.chunks * kChunk, 0);
  if (bits == 4) X.hi.assign(R * X.chunks * kChunk, 0);
  X.d.assign(R * X.chunks * 16, 0.f);
  X.gsum.assign(R * X.G, 0.f);
  std::vector<int8_t> qx(cols_pad);
  std::vector<float> dblock(cols_pad / 32);
  for (int64_t r = 0; r < R; ++r) {
    std::fill(qx.begin(), qx.end(), 0);
    std::fill(dblock.begin(), dblock.end(), 0.f);
    quantize_row(x + r * stride, K, qx.data(), dblock.data());
    group_sums(qx.data(), dblock.data(), X.G, group, X.gsum.data() + r * X.G);
    for (int64_t i = 0; i < X.chunks; ++i) {
      int8_t* lo = X.lo.data() + (r * X.chunks + i) * kChunk;
      float* d = X.d.data() + (r * X.chunks + i) * 16;
      if (bits == 4) {  // groups 4i + j: bytes 16j .. 16j + 15, lanes 4j .. 4j + 3
        int8_t* hi = X.hi.data() + (r * X.chunks + i) * kChunk;
        for (int j = 0; j < 4; ++j) {
          std::memcpy(lo + 16 * j, qx.data() + 128 * i + 32 * j, 16);
          std::memcpy(hi + 16 * j, qx.data() + 128 * i + 32 * j + 16, 16);
          for (int l = 0; l < 4; ++l) d[4 * j + l] = dblock[4 * i + j];
        }
      } else {  // columns 64i .. 64i + 63; lane l holds columns 64i + 4l .. 64i + 4l + 3
        std::memcpy(lo, qx.data() + 64 * i, 64);
        for (int l = 0; l < 16; ++l) d[l] = dblock[2 * i + l / 8];
      }
    }
  }
  return X;
}

// 64 bytes of 4-bit codes (one per byte) as their grid values where GRID (VPSHUFB: the grid in
// every 128-bit lane of `grid`), as they are otherwise.
template <bool GRID>
inline __m512i code_bytes(__m512i codes, __m512i grid) {
  if constexpr (GRID) return _mm512_shuffle_epi8(grid, codes);
  return codes;
}

inline __m512i grid_vector() {
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kGridValues)));
}

// The 4 floats of f spread over 16 lanes: lane l gets f[l / LANES_PER_GROUP] (4 or 8 lanes each).
template <int LANES_PER_GROUP>
inline __m512 spread_groups(__m128 f) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  return _mm512_permutexvar_ps(_mm512_srli_epi32(lane, LANES_PER_GROUP == 8 ? 3 : 2), _mm512_castps128_ps512(f));
}

// `count` (<= 4) scales from p, each repeated over the 16 / groups_per_chunk lanes of its group.
template <int LANES_PER_GROUP>
inline __m512 lane_scales(const float* p, int count) {
  return spread_groups<LANES_PER_GROUP>(_mm_maskz_loadu_ps(static_cast<__mmask8>((1u << count) - 1), p));
}
template <int LANES_PER_GROUP>
inline __m512 lane_scales(const c10::Half* p, int count) {
  return spread_groups<LANES_PER_GROUP>(_mm_cvtph_ps(_mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << count) - 1), p)));
}

inline __m512 load16_masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16_masked(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

// Weight row n times x rows r0 .. r0 + NR - 1: acc[r] gets 16 lane partial sums of
// y[r0 + r, n], the mn offsets (sum_g mn[n, g] * gsum[r0 + r, g]) added into the same lanes;
// the caller sums the lanes.
template <int BITS, int GROUP, bool GRID, int NR, typename S>
__attribute__((always_inline)) inline void vnni_row(const QuantizedX& X, int64_t r0, const uint8_t* q,
                                                    const S* scale, const S* mn, int64_t row_bytes,
                                                    __mmask64 tail_mask, int tail_groups, int64_t n, vec16* out) {
  constexpr int kGroupsPerChunk = BITS == 4 ? 4 : kChunk / GROUP;
  const int64_t G = X.G, chunks = X.chunks;
  const uint8_t* qn = q + n * row_bytes;
  const __m512i low4 = _mm512_set1_epi8(0x0F), grid = grid_vector();
  __m512 acc[NR];  // local: stores through `out` could alias the loads below and keep acc in memory
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  _mm_prefetch(reinterpret_cast<const char*>(scale + n * G) + kPrefetch / 8, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(mn + n * G) + kPrefetch / 8, _MM_HINT_T0);
  for (int64_t i = 0; i < chunks; ++i) {
    const bool last = i == chunks - 1;
    // the weight rows are one stream, asked for kPrefetch bytes ahead
    _mm_prefetch(reinterpret_cast<const char*>(qn + kChunk * i + kPrefetch), _MM_HINT_T0);
    const __m512i w = _mm512_maskz_loadu_epi8(last ? tail_mask : ~0ull, qn + kChunk * i);
    const __m512 ws = lane_scales<16 / kGroupsPerChunk>(scale + n * G + kGroupsPerChunk * i,
                                                        last ? tail_groups : kGroupsPerChunk);
    const __m512i lo = BITS == 4 ? code_bytes<GRID>(_mm512_and_si512(w, low4), grid) : w;
    const __m512i hi = BITS == 4 ? code_bytes<GRID>(_mm512_and_si512(_mm512_srli_epi16(w, 4), low4), grid) : w;
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const int64_t at = (r0 + r) * chunks + i;
      __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(X.lo.data() + at * kChunk));
      if constexpr (BITS == 4) sum = _mm512_dpbusd_epi32(sum, hi, _mm512_loadu_si512(X.hi.data() + at * kChunk));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(ws, _mm512_loadu_ps(X.d.data() + at * 16)), acc[r]);
    }
  }
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 mask = G - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (G - g)) - 1);
    const __m512 mnv = load16_masked(mn + n * G + g, mask);
    for (int r = 0; r < NR; ++r)
      acc[r] = _mm512_fmadd_ps(mnv, _mm512_maskz_loadu_ps(mask, X.gsum.data() + (r0 + r) * G + g), acc[r]);
  }
  for (int r = 0; r < NR; ++r) out[r] = (vec16)acc[r];
}

// Rows [r0, r0 + NR) of the quantized x times weight rows [n0, n1): y[r * N + n]. The lanes
// of 16 weight rows at a time are summed by one transpose-and-add (lane_sums16) instead of a
// horizontal sum per output.
template <int BITS, int GROUP, bool GRID, int NR, typename T, typename S>
void vnni_block(const QuantizedX& X, int64_t r0, const uint8_t* q, const S* scale, const S* mn, const float* bias,
                T* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int kGroupsPerChunk = BITS == 4 ? 4 : kChunk / GROUP;
  const int64_t row_bytes = BITS == 4 ? K / 2 : K, chunks = X.chunks;
  const int64_t tail = row_bytes - (chunks - 1) * kChunk;  // bytes in the last chunk, 1..64
  const __mmask64 tail_mask = tail == kChunk ? ~0ull : (1ull << tail) - 1;
  const int tail_groups = static_cast<int>(X.G - (chunks - 1) * kGroupsPerChunk);
  for (int64_t n = n0; n < n1; n += 16) {
    const int rows = static_cast<int>(std::min<int64_t>(16, n1 - n));
    vec16 lanes[16][NR], by_row[NR][16];
    for (int j = 0; j < rows; ++j)
      vnni_row<BITS, GROUP, GRID, NR, S>(X, r0, q, scale, mn, row_bytes, tail_mask, tail_groups, n + j, lanes[j]);
    for (int r = 0; r < NR; ++r) {
      for (int j = 0; j < 16; ++j) by_row[r][j] = j < rows ? lanes[j][r] : vec16{};
      const vec16 sums = lane_sums16(by_row[r]);
      for (int j = 0; j < rows; ++j) y[(r0 + r) * N + n + j] = static_cast<T>(sums[j] + (bias ? bias[n + j] : 0.f));
    }
  }
}

template <int BITS, int GROUP, bool GRID, typename T, typename S>
void vnni_rows(const QuantizedX& X, int64_t R, const uint8_t* q, const S* scale, const S* mn, const float* bias,
               T* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t t0 = n0; t0 < n1; t0 += kTileRows) {  // a tile's weights stay in cache for every row block
    const int64_t t1 = std::min(n1, t0 + kTileRows);
    for (int64_t r0 = 0; r0 < R; r0 += kRowBlock) {
      switch (std::min<int64_t>(kRowBlock, R - r0)) {
        case 1: vnni_block<BITS, GROUP, GRID, 1, T, S>(X, r0, q, scale, mn, bias, y, K, N, t0, t1); break;
        case 2: vnni_block<BITS, GROUP, GRID, 2, T, S>(X, r0, q, scale, mn, bias, y, K, N, t0, t1); break;
        case 3: vnni_block<BITS, GROUP, GRID, 3, T, S>(X, r0, q, scale, mn, bias, y, K, N, t0, t1); break;
        default: vnni_block<BITS, GROUP, GRID, 4, T, S>(X, r0, q, scale, mn, bias, y, K, N, t0, t1); break;
      }
    }
  }
}

// ---- Many rows: weight tiles transposed so that each int32 lane is one output ----------------
// From kGemmRows rows of x on, a thread takes 32 weight rows at a time (a tile: two vectors of
// 16 outputs) and transposes their bytes once (gemm_tile): per group g and 4 columns v, one
// vector per 16 rows whose lane j holds the 4 weight bytes of row n + j that meet x's columns
// GROUP * g + 4v .. + 3 (the 4-bit layout's nibbles unpacked to bytes). Then one broadcast
// dword of a row of x meets both vectors in VPDPBUSD, adding to the sums of 32 outputs: a
// group's int32 sums are scaled per lane (the weight scales of those rows, times the row's x
// scale) and the mn offsets added, with no horizontal sums, and kGemmBlock rows of x share each
// weight vector loaded from the tile. The products and the integer sums per group are those of
// vnni_rows; only the float additions come in another order.
constexpr int64_t kGemmRows = 8;
constexpr int kGemmBlock = 4;
// Rows of x a packed tile's block takes (gemv_block) where x has at most kGemvFewRows rows: 5-8
// rows took 0.92-0.94 of the step in blocks of up to 6, but 512 rows (a prefill) 1.03 (2 Zen 4
// threads, Q4_0); more rows go in blocks of kGemmBlock.
constexpr int kGemvBlock = 6;
constexpr int64_t kGemvFewRows = 8;
constexpr int kSubs = kTileRows / 16;  // vectors of 16 outputs per tile
// Vectors per group and 16 outputs of a packed tile (gemv_rows): the group's bytes, 4 per lane.
constexpr int packed_vectors(int bits, int group) { return (bits == 4 ? group / 2 : group) / 4; }

// Weight rows [n, n + rows) (rows <= kTileRows; the lanes past them zero) transposed (and the `ahead`
// bytes after them prefetched): vector
// w[(g * GROUP / 4 + v) * kSubs + s] holds rows n + 16s .. + 15 for columns GROUP * g + 4v .. + 3;
// their scales and offsets as floats: ws[kTileRows * g + i], wmn[kTileRows * g + i] of row n + i
// (`flat`: scratch of kTileRows * G rounded up to 16 floats). Returns symmetric_offset of the tile.
template <int BITS, int GROUP, typename S, bool PACKED = false, bool GRID = false>
int32_t gemm_tile(const uint8_t* q, const S* scale, const S* mn, int64_t row_bytes, int64_t G, int64_t n, int rows,
                  __m512i* w, float* ws, float* wmn, float* flat, int64_t ahead) {
  // the next tile's bytes (`ahead` of them, right after this tile's), asked for a share per group:
  // all at once overran the outstanding misses a core keeps
  const char* next = reinterpret_cast<const char*>(q + (n + rows) * row_bytes);
  const int64_t lines = (ahead + 63) / 64, per_group = (lines + G - 1) / std::max<int64_t>(G, 1);
  constexpr int64_t kGroupBytes = BITS == 4 ? GROUP / 2 : GROUP;
  constexpr int kVectors = PACKED ? packed_vectors(BITS, GROUP) : GROUP / 4;
  static const uint8_t zeros[32] = {};
  const uint8_t* base[kTileRows];
  int64_t step[kTileRows];
  for (int j = 0; j < kTileRows; ++j) {
    base[j] = j < rows ? q + (n + j) * row_bytes : zeros;
    step[j] = j < rows ? kGroupBytes : 0;
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F), grid = grid_vector();
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t l = g * per_group; l < std::min(lines, (g + 1) * per_group); ++l) _mm_prefetch(next + 64 * l, _MM_HINT_T0);
    for (int sub = 0; sub < kSubs; ++sub) {
      const uint8_t* const* rb = base + 16 * sub;
      const int64_t* rs = step + 16 * sub;
      for (int h = 0; h < (kGroupBytes + 15) / 16; ++h) {  // 16 bytes of each row at a time
        __m512i a[4];  // a[k], 128-bit lane l: the bytes of row 4l + k
        for (int k = 0; k < 4; ++k) {
          __m512i v = _mm512_setzero_si512();
          for (int l = 0; l < 4; ++l) {
            const uint8_t* p = rb[4 * l + k] + g * rs[4 * l + k] + 16 * h;
            v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), l);
          }
          a[k] = v;
        }
        // 4 x 4 dword transposes within the lanes: b[m] lane 4l + k = dword m of row 4l + k
        const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
        const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
        const __m512i b[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                              _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
        __m512i* out = w + g * kVectors * kSubs + sub;
        for (int m = 0; m < 4; ++m) {
          if constexpr (BITS == 4 && PACKED) {  // dword m: both nibbles of bytes 4m .. 4m + 3
            _mm512_store_si512(out + m * kSubs, b[m]);
          } else if constexpr (BITS == 4) {  // dword m: columns 32g + 4m .. (low nibbles), 32g + 16 + 4m .. (high)
            _mm512_store_si512(out + m * kSubs, code_bytes<GRID>(_mm512_and_si512(b[m], low4), grid));
            _mm512_store_si512(out + (4 + m) * kSubs,
                               code_bytes<GRID>(_mm512_and_si512(_mm512_srli_epi16(b[m], 4), low4), grid));
          } else {  // columns GROUP * g + 16h + 4m ..
            _mm512_store_si512(out + (4 * h + m) * kSubs, b[m]);
          }
        }
      }
    }
  }
  // scales and offsets: each row's widened to float (rows past `rows` zero) into 16 x 16 blocks,
  // transposed by shuffles (gathers were a quarter of a 16-row call's time)
  const int64_t Gp = (G + 15) / 16 * 16;
  for (int a = 0; a < 2; ++a) {
    const S* src = a == 0 ? scale : mn;
    float* dst = a == 0 ? ws : wmn;
    for (int j = 0; j < kTileRows; ++j)
      for (int64_t g = 0; g < Gp; g += 16) {
        const __mmask16 m = G - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (G - g)) - 1);
        const __m512 v = j < rows ? load16_masked(src + (n + j) * G + g, m) : _mm512_setzero_ps();
        _mm512_storeu_ps(flat + j * Gp + g, v);
      }
    for (int64_t g0 = 0; g0 < Gp; g0 += 16)
      for (int sub = 0; sub < kSubs; ++sub) {
        vec16 v[16];
        for (int j = 0; j < 16; ++j) v[j] = load16(flat + (16 * sub + j) * Gp + g0);
        transpose16(v);
        for (int c = 0; c < 16 && g0 + c < G; ++c) store16(dst + kTileRows * (g0 + c) + 16 * sub, v[c]);
      }
  }
  return symmetric_offset(ws, wmn, kTileRows * G);
}

// A tile's sums (acc[r][s]: outputs n + 16s .. of row r0 + r of x) plus the bias, rounded to T
// into y [R, N] for its `rows` weight rows.
template <int NR, typename T>
inline void store_tile_sums(const __m512 (&acc)[NR][kSubs], const float* bias, T* y, int64_t N, int64_t n, int rows,
                            int64_t r0) {
  for (int s = 0; s < kSubs; ++s) {
    const int count = std::max(0, std::min(16, rows - 16 * s));
    if (count == 0) break;
    const __mmask16 mask = count == 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n + 16 * s) : _mm512_setzero_ps();
    for (int r = 0; r < NR; ++r) {
      vec16 sums;
      const __m512 v = _mm512_add_ps(acc[r][s], b);
      std::memcpy(&sums, &v, sizeof(v));
      T* to = y + (r0 + r) * N + n + 16 * s;
      if (count == 16) {  // straight into y, not through a buffer and a memcpy of `count` (16 rows: 0.84 of the time)
        store16(to, sums);
        continue;
      }
      T out[16];
      store16(out, sums);
      std::memcpy(to, out, count * sizeof(T));
    }
  }
}

// Rows [r0, r0 + NR) of x times the tile (weight rows [n, n + rows)): y[r * N + n + i]. A
// symmetric tile (sym = its offset c >= 0) starts each group's integer sums at -c * sum(qx), so
// that they are sum((q - c) * qx), and adds no offset term.
template <int GROUP, int NR, bool SYM, typename T>
void gemm_block(const RowsX& X, int64_t r0, const __m512i* w, const float* ws, const float* wmn, int32_t sym,
                const float* bias, T* y, int64_t N, int64_t n, int rows) {
  constexpr int kVectors = GROUP / 4;
  const int64_t G = X.G;
  __m512 acc[NR][kSubs];
  for (int r = 0; r < NR; ++r)
    for (int s = 0; s < kSubs; ++s) acc[r][s] = _mm512_setzero_ps();
  const int8_t* qx = X.qx.data() + r0 * X.stride;
  for (int64_t g = 0; g < G; ++g) {
    __m512i isum[NR][kSubs];
    for (int r = 0; r < NR; ++r) {
      const __m512i start = SYM ? _mm512_set1_epi32(-sym * X.isum[(r0 + r) * G + g]) : _mm512_setzero_si512();
      for (int s = 0; s < kSubs; ++s) isum[r][s] = start;
    }
#pragma GCC unroll 8
    for (int v = 0; v < kVectors; ++v) {
      __m512i wv[kSubs];
      for (int s = 0; s < kSubs; ++s) wv[s] = _mm512_load_si512(w + (g * kVectors + v) * kSubs + s);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        int32_t xv;
        std::memcpy(&xv, qx + r * X.stride + GROUP * g + 4 * v, 4);
        const __m512i xb = _mm512_set1_epi32(xv);
        for (int s = 0; s < kSubs; ++s) isum[r][s] = _mm512_dpbusd_epi32(isum[r][s], wv[s], xb);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m512 dx = _mm512_set1_ps(X.d[(r0 + r) * X.blocks + GROUP * g / 32]);
      for (int s = 0; s < kSubs; ++s) {
        const __m512 sc = _mm512_loadu_ps(ws + kTileRows * g + 16 * s);
        acc[r][s] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][s]), _mm512_mul_ps(sc, dx), acc[r][s]);
        if constexpr (!SYM) {
          const __m512 gs = _mm512_set1_ps(X.gsum[(r0 + r) * G + g]);
          acc[r][s] = _mm512_fmadd_ps(_mm512_loadu_ps(wmn + kTileRows * g + 16 * s), gs, acc[r][s]);
        }
      }
    }
  }
  store_tile_sums<NR, T>(acc, bias, y, N, n, rows, r0);
}

// ONCE: bytes read once (a tile that one block of rows reads): asked for as non-temporal, so
// that the weight stream does not push out of the caches what the step reads again (the KV,
// the activations, a compact tile's factors, the interpreter's own data). Zen 4, batch 1,
// `kernel_ab.py` against temporal prefetches: a Q4_K_M file of true K-quants 0.91-0.95 of the
// step (batch 4 0.90), the default model's Q8_0 0.95-0.96, Q4_0 / Q4_1 0.98-1.01; tiles that
// several row blocks read again stay temporal (batch 16 1.01 when they did not).
template <bool ONCE = false>
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, ONCE ? _MM_HINT_NTA : _MM_HINT_T0);
}

// How gemv_block asks for its tile's bytes ahead: not at all (a widened copy, in cache; or a
// stream the hardware prefetchers alone read faster), as data read again, or as data read once.
enum class Fetch { kNone, kAgain, kOnce };

// Every row of x times weight rows [kTileRows * t0, min(N, kTileRows * t1)): one tile at a time,
// transposed here (gemm_tile) and multiplied by every row block of x. (A weight whose tiles were
// stored at load reads its packed tiles instead: gemv_rows, the same sums.)
template <int BITS, int GROUP, bool GRID, typename T, typename S>
void gemm_rows(const RowsX& X, int64_t R, const uint8_t* q, const S* scale, const S* mn, const float* bias, T* y,
               int64_t K, int64_t N, int64_t t0, int64_t t1) {
  const int64_t G = X.G, row_bytes = BITS == 4 ? K / 2 : K;
  std::vector<__m512i> scratch(G * (GROUP / 4) * kSubs);
  std::vector<float> scratch_s(2 * kTileRows * G), flat(kTileRows * ((G + 15) / 16 * 16));
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n = kTileRows * t;
    const int rows = static_cast<int>(std::min<int64_t>(kTileRows, N - n));
    if (t + 1 < t1) {  // the next tile's scales and offsets, asked for while this one computes
      const int64_t next = n + kTileRows, next_rows = std::min<int64_t>(kTileRows, N - next);
      prefetch_bytes(scale + next * G, next_rows * G * static_cast<int64_t>(sizeof(S)));
      prefetch_bytes(mn + next * G, next_rows * G * static_cast<int64_t>(sizeof(S)));
    }
    const int64_t ahead = t + 1 < t1 ? std::min<int64_t>(kTileRows, N - n - kTileRows) * row_bytes : 0;
    const int32_t sym = gemm_tile<BITS, GROUP, S, false, GRID>(q, scale, mn, row_bytes, G, n, rows, scratch.data(),
                                                  scratch_s.data(), scratch_s.data() + kTileRows * G, flat.data(), ahead);
    const __m512i* w = scratch.data();
    const float* ws = scratch_s.data();
    const float* wmn = ws + kTileRows * G;
    auto blocks = [&](auto symmetric) {
      constexpr bool SYM = decltype(symmetric)::value;
      for (int64_t r0 = 0; r0 < R; r0 += kGemmBlock) {
        switch (std::min<int64_t>(kGemmBlock, R - r0)) {
          case 1: gemm_block<GROUP, 1, SYM, T>(X, r0, w, ws, wmn, sym, bias, y, N, n, rows); break;
          case 2: gemm_block<GROUP, 2, SYM, T>(X, r0, w, ws, wmn, sym, bias, y, N, n, rows); break;
          case 3: gemm_block<GROUP, 3, SYM, T>(X, r0, w, ws, wmn, sym, bias, y, N, n, rows); break;
          default: gemm_block<GROUP, 4, SYM, T>(X, r0, w, ws, wmn, sym, bias, y, N, n, rows); break;
        }
      }
    };
    if (sym >= 0) {
      blocks(std::true_type{});
    } else {
      blocks(std::false_type{});
    }
  }
}

// ---- Stored weights: packed weight tiles --------------------------------------------------
// Where a weight's tiles were stored at load (quant_tiles), rows of x of any count meet packed
// tiles: the same 32 weight rows and dword order as gemm_tile's, but the 4-bit layout's bytes
// kept whole (both nibbles: the low ones meet x's columns 32g + 4v .., the high ones
// 32g + 16 + 4v ..) and the scales and offsets in the layout's own dtype, so a decode step reads
// no more bytes than the row layout, with every int32 lane one output: no per-chunk scale
// shuffles and no horizontal sums; from kGemmRows rows the sums are gemm_rows', in its order
// (bit-identical), from half the bytes of its unpacked 4-bit tiles and float32 scales. Measured
// against the row kernel below kGemmRows and the stored transposed tiles from there (2 Zen 4
// threads, default model Q4_0, decode step): batch 1 0.95 of the time, 4 0.80, 16 0.84, 64 0.93;
// a 100-token prefill 0.93; Q8_0 batch 1 1.00, 16 0.90, prefill 0.98. Everything a tile holds is
// read in the order it is stored (one stream: regions skipped or read out of order halved what
// the hardware prefetcher delivered to one core, 27 -> 12 GB/s). A packed tile: 64 bytes whose first int32 is its
// symmetric_offset, then per group g its vectors (packed_vectors x kSubs), the kTileRows scales
// and, where some tile of the weight is not symmetric (`with_mn`), the kTileRows offsets (each
// rounded up to 64 bytes).
//
// Narrow tiles: the packed tiles of an 8-bit weight whose codes all lie below 16, 32 or 64 (Q2_K,
// Q3_K; Q5_0, Q5_1, Q5_K; Q6_K, and 4-bit parts widened to share a matrix with those) hold the
// codes' low nibbles as a 4-bit tile does (vector v's bytes pair with vector v + kV/2's as low
// and high nibbles: x's columns GROUP * g + 4v .. and GROUP * g + 4 (v + kV/2) ..), and after a
// group's vectors its PLANES (0-2) bit planes: per vector, for plane k, a 64-bit mask of the low
// nibbles' bit 4 + k, then one of the high nibbles'. 5 or 6 bits a weight instead of 8 (4 for
// Q2_K / Q3_K), the same codes, the same integer sums: bit-identical results. A tile's header
// says which (int32 at byte 4, its kind): 0 the layout's own tile, 1 + PLANES a narrow one.
constexpr int64_t round64(int64_t bytes) { return (bytes + 63) / 64 * 64; }
inline int64_t plane_bytes(int bits, int group, int planes) {
  return round64(static_cast<int64_t>(packed_vectors(bits, group)) * kSubs * 16 * planes);
}
//
// Compact scales: where a 4-bit tile's float32 scales (and offsets) factor exactly, per row and
// super-block of kSuperCols columns, into one float32 factor times an int8 per group (the
// K-quants' d * sc and dmin * m, IQ4_XS's d * (ls - 32): found at load, `factor_block`), the tile
// stores each super-block's factors once (kTileRows floats, and as many for the offsets), just
// before its groups, and per group the int8s (the scales', then the offsets', in one line): 0.75
// bits a weight instead of 2, and still one pass in order over the tile. The kernel multiplies
// them back, which gives the float32 values exactly (bit-identical results). The header says so
// (int32 at byte 8). (All factors at the tile's head, copied out before its groups, read at 0.82x
// the rate of tiles with float32 scales, one Zen 4 thread: 18.9 against 23.0 GB/s.)
inline int64_t scale_region_bytes(int64_t scale_bytes, bool with_mn, bool compact) {
  return compact ? 64 : (with_mn ? 2 : 1) * round64(kTileRows * scale_bytes);
}
inline int64_t packed_group_bytes(int bits, int group, int64_t scale_bytes, bool with_mn, int planes = 0,
                                  bool compact = false) {
  return packed_vectors(bits, group) * kSubs * 64 + plane_bytes(bits, group, planes) +
         scale_region_bytes(scale_bytes, with_mn, compact);
}
// A compact tile's factors of one super-block (scales', then offsets' where with_mn), and of all.
inline int64_t super_block_bytes(bool with_mn) { return (with_mn ? 2 : 1) * kTileRows * 4; }
inline int64_t super_bytes(int64_t G, int group, bool with_mn, bool compact) {
  return compact ? G * group / kSuperCols * super_block_bytes(with_mn) : 0;
}
inline int64_t packed_tile_bytes(int64_t G, int bits, int group, int64_t scale_bytes, bool with_mn, int planes = 0,
                                 bool compact = false) {
  return 64 + super_bytes(G, group, with_mn, compact) +
         G * packed_group_bytes(bits, group, scale_bytes, with_mn, planes, compact);
}
// Where group g of a packed tile starts (groups of group_bytes each; a compact tile's factors of
// a super-block lie before its groups), and where the factors of g's super-block start.
inline int64_t group_offset(int64_t g, int64_t group_bytes, int group, bool with_mn, bool compact) {
  return 64 + (compact ? (g * group / kSuperCols + 1) * super_block_bytes(with_mn) : 0) + g * group_bytes;
}
inline int64_t factors_offset(int64_t g, int64_t group_bytes, int group, bool with_mn) {
  const int64_t first = g - g % (kSuperCols / group);  // the super-block's first group
  return group_offset(first, group_bytes, group, with_mn, true) - super_block_bytes(with_mn);
}
// The tile format of a weight of `bits` whose tiles are of kind `kind` (the header's): (bits of
// the tile's vectors, planes).
inline std::pair<int, int> tile_format(int64_t bits, int32_t kind) {
  return kind == 0 ? std::pair<int, int>{static_cast<int>(bits), 0} : std::pair<int, int>{4, kind - 1};
}

// A narrow tile's bit planes (PLANES of them at p: per plane the low nibbles' mask, then the high
// nibbles') added to the nibbles lo and hi: bit 4 + k of each code set where plane k says.
template <int PLANES>
inline void add_planes(const uint8_t* p, __m512i& lo, __m512i& hi) {
  for (int k = 0; k < PLANES; ++k) {
    __mmask64* m = reinterpret_cast<__mmask64*>(const_cast<uint8_t*>(p) + 16 * k);
    const __m512i bit = _mm512_set1_epi8(static_cast<char>(0x10 << k));
    lo = _mm512_mask_add_epi8(lo, _load_mask64(m), lo, bit);
    hi = _mm512_mask_add_epi8(hi, _load_mask64(m + 1), hi, bit);
  }
}

inline __m512 load16_scales(const float* p) { return _mm512_loadu_ps(p); }
// 16 int8 as floats (a compact tile's integers).
inline __m512 int8_floats(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16_scales(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Rows [r0, r0 + NR) of x times one packed tile (weight rows [n, n + rows)): y[r * N + n + i].
// Up to 4 rows, two integer sums per output and group (the low and the high nibbles, or the even
// and odd dwords of 8-bit weights) keep two dependency chains, above one (the registers of 6
// rows); a symmetric tile (sym = its offset c) starts them at -c * sum(qx) and adds no offset
// term, as gemm_block does.
template <int BITS, int GROUP, bool GRID, int PLANES, bool COMPACT, int NR, bool SYM, typename T, typename S>
void gemv_block(const RowsX& X, int64_t r0, const uint8_t* tile, bool with_mn, int32_t sym, const float* bias, T* y,
                int64_t N, int64_t n, int rows, Fetch fetch) {
  constexpr int kV = packed_vectors(BITS, GROUP);
  constexpr int64_t kScaleBytes = round64(kTileRows * sizeof(S));
  constexpr int kSuper = kSuperCols / GROUP;  // groups per super-block (compact scales)
  const int64_t G = X.G, group_bytes = packed_group_bytes(BITS, GROUP, sizeof(S), with_mn, PLANES, COMPACT);
  const int64_t vector_bytes = kV * kSubs * 64 + plane_bytes(BITS, GROUP, PLANES);
  const __m512i low4 = _mm512_set1_epi8(0x0F), grid = grid_vector();
  __m512 acc[NR][kSubs];
  for (int r = 0; r < NR; ++r)
    for (int s = 0; s < kSubs; ++s) acc[r][s] = _mm512_setzero_ps();
  const int8_t* qx = X.qx.data() + r0 * X.stride;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* at = tile + group_offset(g, group_bytes, GROUP, with_mn, COMPACT);
    const __m512i* w = reinterpret_cast<const __m512i*>(at);
    const uint8_t* planes = at + kV * kSubs * 64;
    const S* ws = reinterpret_cast<const S*>(at + vector_bytes);
    // the stream kPrefetch bytes ahead, a line for each line read (none in a widened copy)
    const int64_t read = group_bytes + (COMPACT && g % kSuper == 0 ? super_block_bytes(with_mn) : 0);
    if (fetch == Fetch::kOnce) {
      prefetch_bytes<true>(at + kPrefetch, read);
    } else if (fetch == Fetch::kAgain) {
      prefetch_bytes(at + kPrefetch, read);
    }
    // (4 rows with one chain took 1.05x the time, 6 with two spilled)
    constexpr bool kTwo = NR <= 4;
    __m512i sum[NR][kSubs], sum2[kTwo ? NR : 1][kSubs];
    auto second = [&](int r, int s) -> __m512i& { return kTwo ? sum2[r][s] : sum[r][s]; };
    for (int r = 0; r < NR; ++r) {
      const __m512i start = SYM ? _mm512_set1_epi32(-sym * X.isum[(r0 + r) * G + g]) : _mm512_setzero_si512();
      for (int s = 0; s < kSubs; ++s) {
        sum[r][s] = start;
        if constexpr (kTwo) sum2[r][s] = _mm512_setzero_si512();
      }
    }
#pragma GCC unroll 8
    for (int v = 0; v < kV; ++v) {
      for (int s = 0; s < kSubs; ++s) {
        const __m512i wv = _mm512_load_si512(w + v * kSubs + s);
        if constexpr (BITS == 4) {
          // Plain codes in two chains: the high nibbles meet x in place (16 times their codes),
          // their sums shifted down once a group (exact: every product is a multiple of 16).
          constexpr bool kHigh16 = kTwo && !GRID && PLANES == 0;
          __m512i lo = code_bytes<GRID>(_mm512_and_si512(wv, low4), grid);
          __m512i hi = kHigh16 ? _mm512_andnot_si512(low4, wv)
                               : code_bytes<GRID>(_mm512_and_si512(_mm512_srli_epi16(wv, 4), low4), grid);
          add_planes<PLANES>(planes + (v * kSubs + s) * 16 * PLANES, lo, hi);
#pragma GCC unroll 8
          for (int r = 0; r < NR; ++r) {
            const int8_t* xr = qx + r * X.stride + GROUP * g;
            int32_t a, b;
            std::memcpy(&a, xr + 4 * v, 4);
            std::memcpy(&b, xr + 4 * (v + kV), 4);
            sum[r][s] = _mm512_dpbusd_epi32(sum[r][s], lo, _mm512_set1_epi32(a));
            second(r, s) = _mm512_dpbusd_epi32(second(r, s), hi, _mm512_set1_epi32(b));
          }
        } else {
#pragma GCC unroll 8
          for (int r = 0; r < NR; ++r) {
            int32_t a;
            std::memcpy(&a, qx + r * X.stride + GROUP * g + 4 * v, 4);
            __m512i& chain = v % 2 == 0 ? sum[r][s] : second(r, s);
            chain = _mm512_dpbusd_epi32(chain, wv, _mm512_set1_epi32(a));
          }
        }
      }
    }
    if constexpr (kTwo)
      for (int r = 0; r < NR; ++r)
        for (int s = 0; s < kSubs; ++s)
          sum[r][s] = _mm512_add_epi32(sum[r][s], BITS == 4 && !GRID && PLANES == 0 ? _mm512_srai_epi32(sum2[r][s], 4)
                                                                                    : sum2[r][s]);
    const float* factors = reinterpret_cast<const float*>(tile + (COMPACT ? factors_offset(g, group_bytes, GROUP, with_mn) : 0));
    const int8_t* ints = reinterpret_cast<const int8_t*>(ws);
    for (int s = 0; s < kSubs; ++s) {
      __m512 sc, mnv = _mm512_setzero_ps();
      if constexpr (COMPACT) {
        sc = _mm512_mul_ps(int8_floats(ints + 16 * s), _mm512_loadu_ps(factors + 16 * s));
        if constexpr (!SYM) mnv = _mm512_mul_ps(int8_floats(ints + 32 + 16 * s), _mm512_loadu_ps(factors + 32 + 16 * s));
      } else {
        sc = load16_scales(ws + 16 * s);
        if constexpr (!SYM)
          mnv = load16_scales(reinterpret_cast<const S*>(reinterpret_cast<const uint8_t*>(ws) + kScaleBytes) + 16 * s);
      }
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        const __m512 dx = _mm512_set1_ps(X.d[(r0 + r) * X.blocks + GROUP * g / 32]);
        acc[r][s] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][s]), _mm512_mul_ps(sc, dx), acc[r][s]);
        if constexpr (!SYM) acc[r][s] = _mm512_fmadd_ps(mnv, _mm512_set1_ps(X.gsum[(r0 + r) * G + g]), acc[r][s]);
      }
    }
  }
  store_tile_sums<NR, T>(acc, bias, y, N, n, rows, r0);
}

// A 4-bit packed tile (G groups; grid codes looked up, a narrow tile's planes added back) written
// out in the 8-bit layout: per group its vectors' low nibbles as the first half of the 8-bit
// vectors (x's columns GROUP * g + 4v ..) and their high nibbles as the second, the header, a
// compact tile's factors and the scales and offsets as they are, so that gemv_block<8> takes it.
template <int GROUP, bool GRID, int PLANES, bool COMPACT, typename S>
void widen_tile(const uint8_t* tile, int64_t G, bool with_mn, uint8_t* out) {
  constexpr int kV = packed_vectors(4, GROUP);
  const int64_t from = packed_group_bytes(4, GROUP, sizeof(S), with_mn, PLANES, COMPACT);
  const int64_t to = packed_group_bytes(8, GROUP, sizeof(S), with_mn, 0, COMPACT);
  const int64_t vector_bytes = kV * kSubs * 64 + plane_bytes(4, GROUP, PLANES);
  const __m512i low4 = _mm512_set1_epi8(0x0F), grid = grid_vector();
  std::memcpy(out, tile, 64);  // the header and each super-block's factors, as they are
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* at = tile + group_offset(g, from, GROUP, with_mn, COMPACT);
    uint8_t* dst = out + group_offset(g, to, GROUP, with_mn, COMPACT);
    if constexpr (COMPACT) {
      if (g % (kSuperCols / GROUP) == 0)
        std::memcpy(out + factors_offset(g, to, GROUP, with_mn), tile + factors_offset(g, from, GROUP, with_mn),
                    super_block_bytes(with_mn));
    }
    prefetch_bytes(at + kPrefetch, from);
    for (int v = 0; v < kV * kSubs; ++v) {
      const __m512i wv = _mm512_load_si512(at + 64 * v);
      __m512i lo = code_bytes<GRID>(_mm512_and_si512(wv, low4), grid);
      __m512i hi = code_bytes<GRID>(_mm512_and_si512(_mm512_srli_epi16(wv, 4), low4), grid);
      add_planes<PLANES>(at + kV * kSubs * 64 + 16 * PLANES * v, lo, hi);
      _mm512_store_si512(dst + 64 * v, lo);
      _mm512_store_si512(dst + 64 * (v + kV * kSubs), hi);
    }
    std::memcpy(dst + 2 * kV * kSubs * 64, at + vector_bytes, from - vector_bytes);
  }
}

// From kWidenRows rows of x a 4-bit tile is widened once (widen_tile, into the thread's buffer)
// and its row blocks take the copy's bytes as they are, instead of each block unpacking every
// byte again. The integer sums are the same, so are the results (bit for bit). One thread, Zen 4,
// Q4_0 1536 x 576 and 576 x 1536: 512 rows 0.92-0.93 of the time, 64 rows 0.96-0.97, 32 0.97.
constexpr int64_t kWidenRows = 32;

// Rows of x in blocks of `block` times one packed tile (weight rows [n, n + rows)).
template <int BITS, int GROUP, bool GRID, int PLANES, bool COMPACT, typename T, typename S>
void tile_blocks(const RowsX& X, int64_t R, int64_t block, const uint8_t* tile, bool with_mn, int32_t sym,
                 const float* bias, T* y, int64_t N, int64_t n, int rows, Fetch fetch) {
  auto blocks = [&](auto symmetric) {
    constexpr bool SYM = decltype(symmetric)::value;
    for (int64_t r0 = 0; r0 < R; r0 += block) {
      switch (std::min<int64_t>(block, R - r0)) {
        case 1: gemv_block<BITS, GROUP, GRID, PLANES, COMPACT, 1, SYM, T, S>(X, r0, tile, with_mn, sym, bias, y, N, n, rows, fetch); break;
        case 2: gemv_block<BITS, GROUP, GRID, PLANES, COMPACT, 2, SYM, T, S>(X, r0, tile, with_mn, sym, bias, y, N, n, rows, fetch); break;
        case 3: gemv_block<BITS, GROUP, GRID, PLANES, COMPACT, 3, SYM, T, S>(X, r0, tile, with_mn, sym, bias, y, N, n, rows, fetch); break;
        case 4: gemv_block<BITS, GROUP, GRID, PLANES, COMPACT, 4, SYM, T, S>(X, r0, tile, with_mn, sym, bias, y, N, n, rows, fetch); break;
        case 5: gemv_block<BITS, GROUP, GRID, PLANES, COMPACT, 5, SYM, T, S>(X, r0, tile, with_mn, sym, bias, y, N, n, rows, fetch); break;
        default: gemv_block<BITS, GROUP, GRID, PLANES, COMPACT, kGemvBlock, SYM, T, S>(X, r0, tile, with_mn, sym, bias, y, N, n, rows, fetch); break;
      }
    }
  };
  if (sym >= 0) {
    blocks(std::true_type{});
  } else {
    blocks(std::false_type{});
  }
}

// Every row of x times packed tiles [t0, t1) of W (`packed`: its first packed tile), each tile
// multiplied by every block of up to kGemvBlock (few rows) or kGemmBlock rows (from L1 / L2 after the first).
template <int BITS, int GROUP, bool GRID, int PLANES, bool COMPACT, typename T, typename S>
void gemv_rows(const RowsX& X, int64_t R, const uint8_t* packed, bool with_mn, const float* bias, T* y, int64_t N,
               int64_t t0, int64_t t1) {
  const int64_t bytes = packed_tile_bytes(X.G, BITS, GROUP, sizeof(S), with_mn, PLANES, COMPACT);
  const int64_t block = R <= kGemvFewRows ? kGemvBlock : kGemmBlock;
  const bool widen = BITS == 4 && R >= kWidenRows;
  // One row of x (a lone decode stream) and a 4-bit tile (plain, grid, narrow or compact): the
  // hardware prefetchers alone (Zen 4, `kernel_ab`-style alternation against non-temporal
  // prefetches: Q4_0 0.95, Q4_1 0.89-0.96, IQ4_XS 0.94-0.95, the default model's Q4_K_M
  // 0.97-0.98, a 100M model of true K-quants 0.95-0.99, a 1B one 0.84-0.97 of the step; at
  // 2 and 4 rows no order held: 0.97-1.08); 8-bit tiles (Q8_0 1.03-1.08 without) and more
  // rows are asked for: as read once where one row block reads each tile once. On Intel's
  // Xeon (AMX, AVX-512 VNNI) the non-temporal prefetches slowed the stream they ask for: the
  // hardware prefetchers alone wherever one row block reads each tile (`kernel_ab.py`, the
  // default model's Q8_0 at batch 1: 0.69 of the step, at batch 4 0.60).
  static const bool intel = __builtin_cpu_is("intel");
  const bool hardware_only = intel || (BITS == 4 && R == 1);
  const Fetch fetch = R > block ? Fetch::kAgain : hardware_only ? Fetch::kNone : Fetch::kOnce;
  static thread_local std::vector<uint8_t> widened;
  uint8_t* copy = nullptr;
  if (widen) {
    const int64_t room = packed_tile_bytes(X.G, 8, GROUP, sizeof(S), with_mn, 0, COMPACT) + 64;
    if (static_cast<int64_t>(widened.size()) < room) widened.resize(room);
    copy = widened.data() + (64 - reinterpret_cast<uintptr_t>(widened.data()) % 64) % 64;
  }
  if (t0 < t1) prefetch_bytes(packed + t0 * bytes, std::min<int64_t>(bytes, kPrefetch));  // the stream's start
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = packed + t * bytes;
    int32_t sym;
    std::memcpy(&sym, tile, sizeof(sym));
    const int64_t n = kTileRows * t;
    const int rows = static_cast<int>(std::min<int64_t>(kTileRows, N - n));
    if constexpr (BITS == 4) {
      if (widen) {
        widen_tile<GROUP, GRID, PLANES, COMPACT, S>(tile, X.G, with_mn, copy);
        tile_blocks<8, GROUP, false, 0, COMPACT, T, S>(X, R, block, copy, with_mn, sym, bias, y, N, n, rows, Fetch::kNone);
        continue;
      }
    }
    tile_blocks<BITS, GROUP, GRID, PLANES, COMPACT, T, S>(X, R, block, tile, with_mn, sym, bias, y, N, n, rows, fetch);
  }
}

// Whether some tile of W (scale, mn [N, G]) is not symmetric (symmetric_offset < 0): its packed
// tiles then hold the offsets.
template <typename S>
bool tiles_need_offsets(const S* scale, const S* mn, int64_t N, int64_t G) {
  std::vector<float> ws(kTileRows * G), wmn(kTileRows * G);
  for (int64_t n = 0; n < N; n += kTileRows) {
    const int64_t rows = std::min<int64_t>(kTileRows, N - n);
    for (int64_t i = 0; i < rows * G; ++i) {
      ws[i] = to_float(scale[n * G + i]);
      wmn[i] = to_float(mn[n * G + i]);
    }
    if (symmetric_offset(ws.data(), wmn.data(), rows * G) < 0) return true;
  }
  return false;
}

// Bytes of W's stored tiles (quant_tiles): its packed tiles.
inline int64_t stored_tiles_bytes(int64_t N, int64_t G, int bits, int group, int64_t scale_bytes, bool with_mn,
                                  int planes = 0, bool compact = false) {
  const int64_t count = (N + kTileRows - 1) / kTileRows;
  return count * packed_tile_bytes(G, bits, group, scale_bytes, with_mn, planes, compact);
}

// A group's 8-bit vectors (kV8 x kSubs, as gemm_tile writes them) as a narrow tile's (above):
// vector v's codes and vector v + kV8 / 2's as low and high nibbles, then the bit planes.
template <int GROUP, int PLANES>
void narrow_vectors(const __m512i* w8, uint8_t* out) {
  constexpr int kV = GROUP / 8;  // packed vectors: half the 8-bit ones
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  uint8_t* planes = out + kV * kSubs * 64;
  for (int v = 0; v < kV; ++v)
    for (int s = 0; s < kSubs; ++s) {
      const __m512i lo = w8[v * kSubs + s], hi = w8[(v + kV) * kSubs + s];
      const __m512i nibbles =
          _mm512_or_si512(_mm512_and_si512(lo, low4), _mm512_slli_epi16(_mm512_and_si512(hi, low4), 4));
      _mm512_store_si512(out + 64 * (v * kSubs + s), nibbles);
      for (int k = 0; k < PLANES; ++k) {
        const __m512i bit = _mm512_set1_epi8(static_cast<char>(0x10 << k));
        const uint64_t m[2] = {_cvtmask64_u64(_mm512_test_epi8_mask(lo, bit)),
                               _cvtmask64_u64(_mm512_test_epi8_mask(hi, bit))};
        std::memcpy(planes + (v * kSubs + s) * 16 * PLANES + 16 * k, m, 16);
      }
    }
}

// Every packed tile of W, one after another (tiles[t]: stored_tiles_bytes / tiles): its
// symmetric offset, kind (KIND: 0, or 1 + planes for a narrow tile of an 8-bit W) and whether
// its scales are compact (COMPACT: their factors `fsc`, `fmn` (the offsets', where with_mn) before
// each super-block's groups), then per group its vectors (as gemm_tile writes them, moved in place, or
// narrowed) and its scales (and offsets): back in S (exact: they came from S), or their int8s.
template <int BITS, int GROUP, int KIND, bool COMPACT, typename S>
void store_tiles(const uint8_t* q, const S* scale, const S* mn, int64_t K, int64_t N, bool with_mn, uint8_t* tiles,
                 const Factors* fsc, const Factors* fmn) {
  constexpr int kPlanes = KIND == 0 ? 0 : KIND - 1, kTileBits = KIND == 0 ? BITS : 4;
  static_assert(KIND == 0 || BITS == 8, "narrow tiles are of 8-bit weights");
  const int64_t G = K / GROUP, row_bytes = BITS == 4 ? K / 2 : K, count = (N + kTileRows - 1) / kTileRows;
  const int64_t stored_bytes = packed_tile_bytes(G, kTileBits, GROUP, sizeof(S), with_mn, kPlanes, COMPACT);
  constexpr int64_t kVectorBytes = packed_vectors(BITS, GROUP) * kSubs * 64;  // gemm_tile's, per group
  const int64_t group_bytes = packed_group_bytes(kTileBits, GROUP, sizeof(S), with_mn, kPlanes, COMPACT);
  const int64_t B = G * GROUP / kSuperCols;
  const int64_t stored_vector_bytes = packed_vectors(kTileBits, GROUP) * kSubs * 64 + plane_bytes(kTileBits, GROUP, kPlanes);
  at::parallel_for(0, count, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> flat(kTileRows * ((G + 15) / 16 * 16)), fs(2 * kTileRows * G);
    std::vector<__m512i> vectors(G * kVectorBytes / 64);
    for (int64_t t = t0; t < t1; ++t) {
      uint8_t* tile = tiles + t * stored_bytes;
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, N - kTileRows * t));
      const int32_t sym = gemm_tile<BITS, GROUP, S, true>(q, scale, mn, row_bytes, G, kTileRows * t, rows,
                                                          vectors.data(), fs.data(), fs.data() + kTileRows * G,
                                                          flat.data(), 0);
      const int32_t kind = KIND, compact = COMPACT;
      std::memset(tile, 0, stored_bytes);
      std::memcpy(tile, &sym, sizeof(sym));
      std::memcpy(tile + 4, &kind, sizeof(kind));
      std::memcpy(tile + 8, &compact, sizeof(compact));
      const int64_t n0 = kTileRows * t;
      if constexpr (COMPACT) {
        for (int64_t b = 0; b < B; ++b)
          for (int a = 0; a < (with_mn ? 2 : 1); ++a) {
            float* dst = reinterpret_cast<float*>(tile + factors_offset(b * kSuperCols / GROUP, group_bytes, GROUP,
                                                                        with_mn)) + a * kTileRows;
            const Factors& f = a == 0 ? *fsc : *fmn;
            for (int i = 0; i < rows; ++i) dst[i] = f.d[(n0 + i) * B + b];
          }
      }
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* at = tile + group_offset(g, group_bytes, GROUP, with_mn, COMPACT);
        const uint8_t* from = reinterpret_cast<const uint8_t*>(vectors.data()) + g * kVectorBytes;
        if constexpr (KIND == 0) {
          std::memcpy(at, from, kVectorBytes);
        } else {
          narrow_vectors<GROUP, kPlanes>(reinterpret_cast<const __m512i*>(from), at);
        }
        for (int a = 0; a < (with_mn ? 2 : 1); ++a) {
          if constexpr (COMPACT) {
            int8_t* dst = reinterpret_cast<int8_t*>(at + stored_vector_bytes) + a * kTileRows;
            const Factors& f = a == 0 ? *fsc : *fmn;
            for (int i = 0; i < rows; ++i) dst[i] = f.k[(n0 + i) * G + g];
          } else {
            S* dst = reinterpret_cast<S*>(at + stored_vector_bytes + a * round64(kTileRows * sizeof(S)));
            for (int i = 0; i < kTileRows; ++i) dst[i] = static_cast<S>(fs[a * kTileRows * G + kTileRows * g + i]);
          }
        }
      }
    }
  });
}
#define TANDEM_QUANT_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// ----------------------------------------------------------------------------------------------
// bfloat16 / float16 rows on AVX2 without AVX-512 VNNI (x86-64-v3 CPUs; also AVX-512 without
// VNNI): int8 activations as above, rounded the same way (the same qx and d), and integer dot
// products on 32-byte chunks of a weight row (64 columns of the 4-bit layout, 32 of the 8-bit
// ones) that give each int32 lane (4 bytes) the same exact sum VPDPBUSD gives:
// - AVX-VNNI (Alder Lake, Sapphire Rapids, Zen 5; the build has __AVXVNNI__): VPDPBUSD's VEX form;
// - otherwise VPMADDUBSW (unsigned bytes times signed bytes, adjacent products summed to int16
//   with saturation), then VPMADDWD by ones (adjacent int16 summed to int32). 4-bit weights
//   (<= 15) cannot saturate, even with the low and high nibbles' pairs added in int16
//   (2 * 2 * 15 * 127 = 7620); 8-bit weights (<= 255) could (2 * 255 * 127 > 32767), so they
//   enter as w - 128 by llama.cpp's sign trick: |w - 128| (<= 128, as unsigned) times qx
//   carrying w - 128's sign (pairs <= 2 * 128 * 127 = 32512), and the lane's 128 * sum(qx)
//   added back (Avx2X::lane_sum).
// This section is separate code from the AVX-512 VNNI one (a build has one or the other), so
// that path's float summation order, and so its results, stay as they are.

constexpr int64_t kAvx2Chunk = 32;  // weight bytes per step

// x quantized for the bytes of a weight row: per row r of x (`stride` bytes apart: a weight row's
// bytes rounded up to 32), byte b of `lo` meets byte b of a weight row (its low nibbles in the
// 4-bit layout), byte b of `hi` (4-bit only) its high nibbles; `d` one float per int32 lane
// (4 bytes): that lane's x scale (zero past K); `lane_sum` (8-bit rows without AVX-VNNI)
// 128 * the lane's sum of qx; gsum[r][g] = d * sum(qx) over weight group g.
struct Avx2X {
  int64_t stride = 0, G = 0;
  std::vector<int8_t> lo, hi;
  std::vector<float> d, gsum;
  std::vector<int32_t> lane_sum;
};

#ifdef __AVXVNNI__
constexpr bool kAvx2LaneSums = false;
#else
constexpr bool kAvx2LaneSums = true;
#endif

// 32 floats (four vectors of 8) rounded to int8 at out, as the AVX-512 VNNI path rounds them
// (d = max|x| / 127, round(x * (1 / d)) to nearest even, saturated); returns d.
inline float avx2_quantize_block(const __m256 v[4], int8_t* out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  __m256i q[4];
  for (int p = 0; p < 4; ++p) q[p] = _mm256_cvtps_epi32(_mm256_mul_ps(v[p], _mm256_set1_ps(id)));
  // The saturating packs work within 128-bit halves; the permutation puts the 32 bytes in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return d;
}

template <typename T>
inline void quantize_row(const T* row, int64_t K, int8_t* qx, float* dblock) {
  for (int64_t b = 0; 32 * b < K; ++b) {
    vec16 f[2];
    load_block32(row, K, b, f);
    __m256 v[4];
    std::memcpy(v, f, sizeof(v));
    dblock[b] = avx2_quantize_block(v, qx + 32 * b);
  }
}

template <typename T>
Avx2X avx2_quantize_x(const T* x, int64_t stride, int64_t R, int64_t K, int64_t bits, int64_t group) {
  Avx2X X;
  const int64_t row_bytes = bits == 4 ? K / 2 : K;
  X.stride = (row_bytes + kAvx2Chunk - 1) / kAvx2Chunk * kAvx2Chunk;
  X.G = K / group;
  const int64_t cols_pad = X.stride * (bits == 4 ? 2 : 1), lanes = X.stride / 4;
  const bool lane_sums = kAvx2LaneSums && bits == 8;
  X.lo.assign(R * X.stride, 0);
  if (bits == 4) X.hi.assign(R * X.stride, 0);
  X.d.assign(R * lanes, 0.f);
  if (lane_sums) X.lane_sum.assign(R * lanes, 0);
  X.gsum.assign(R * X.G, 0.f);
  std::vector<int8_t> qx(cols_pad);
  std::vector<float> dblock(cols_pad / 32);
  for (int64_t r = 0; r < R; ++r) {
    const T* row = x + r * stride;
    std::fill(qx.begin(), qx.end(), 0);
    std::fill(dblock.begin(), dblock.end(), 0.f);
    quantize_row(row, K, qx.data(), dblock.data());
    group_sums(qx.data(), dblock.data(), X.G, group, X.gsum.data() + r * X.G);
    int8_t* lo = X.lo.data() + r * X.stride;
    float* d = X.d.data() + r * lanes;
    if (bits == 4) {  // group g: bytes 16g .. 16g + 15 (lanes 4g .. 4g + 3), columns 32g + j and 32g + 16 + j
      int8_t* hi = X.hi.data() + r * X.stride;
      for (int64_t g = 0; g < X.stride / 16; ++g) {
        std::memcpy(lo + 16 * g, qx.data() + 32 * g, 16);
        std::memcpy(hi + 16 * g, qx.data() + 32 * g + 16, 16);
        for (int l = 0; l < 4; ++l) d[4 * g + l] = dblock[g];
      }
    } else {  // byte k is column k: lane l holds columns 4l .. 4l + 3, of x block l / 8
      std::memcpy(lo, qx.data(), X.stride);
      for (int64_t l = 0; l < lanes; ++l) d[l] = dblock[l / 8];
    }
    if (lane_sums) {
      int32_t* ls = X.lane_sum.data() + r * lanes;
      for (int64_t l = 0; l < lanes; ++l) ls[l] = 128 * (lo[4 * l] + lo[4 * l + 1] + lo[4 * l + 2] + lo[4 * l + 3]);
    }
  }
  return X;
}

inline __m256i avx2_load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The int32 lane sums of a chunk's operands (a, b: from avx2_operands) against x's bytes at lo,
// hi (4-bit) and its lane sums at ls (8-bit by VPMADDUBSW).
template <int BITS>
inline __m256i avx2_dot(__m256i a, __m256i b, const int8_t* lo, const int8_t* hi, const int32_t* ls) {
#ifdef __AVXVNNI__
  __m256i s = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, avx2_load(lo));
  if constexpr (BITS == 4) s = _mm256_dpbusd_avx_epi32(s, b, avx2_load(hi));
  return s;
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 4) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(a, avx2_load(lo)), _mm256_maddubs_epi16(b, avx2_load(hi)));
    return _mm256_madd_epi16(pairs, ones);
  } else {
    const __m256i pairs = _mm256_maddubs_epi16(b, _mm256_sign_epi8(avx2_load(lo), a));
    return _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), avx2_load(ls));
  }
#endif
}

// What the dot product takes from a chunk w: 4-bit, its low and high nibbles; 8-bit, the bytes
// (AVX-VNNI) or w - 128 (signed) and its magnitude (VPMADDUBSW).
template <int BITS>
inline void avx2_operands(__m256i w, __m256i& a, __m256i& b) {
  if constexpr (BITS == 4) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    a = _mm256_and_si256(w, low4);
    b = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
  } else if constexpr (kAvx2LaneSums) {
    a = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
    b = _mm256_abs_epi8(a);
  } else {
    a = b = w;
  }
}

inline __m256 avx2_load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 avx2_load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 avx2_load8_masked(const float* p, __m256i m) { return _mm256_maskload_ps(p, m); }
inline __m256 avx2_load8_masked(const c10::Half* p, int count) {
  alignas(16) uint16_t h[8] = {};
  for (int i = 0; i < count; ++i) std::memcpy(h + i, p + i, 2);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
}

// The scales of chunk i's groups over its 8 lanes (4-bit: groups 2i, 2i + 1, four lanes each).
template <int BITS, int GROUPS_PER_CHUNK>
inline __m256 avx2_chunk_scales(const float* sn, int64_t i, bool partial) {
  if constexpr (GROUPS_PER_CHUNK == 1) {
    return _mm256_set1_ps(sn[i]);
  } else {
    const __m128 pair = partial ? _mm_set_ss(sn[2 * i]) : _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(sn + 2 * i)));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  }
}
template <int BITS, int GROUPS_PER_CHUNK>
inline __m256 avx2_chunk_scales(const c10::Half* sn, int64_t i, bool partial) {
  if constexpr (GROUPS_PER_CHUNK == 1) {
    return _mm256_set1_ps(to_float(sn[i]));
  } else {
    uint16_t one = 0;
    int32_t two = 0;
    if (partial) {  // constant sizes: a memcpy of a variable size is a call
      std::memcpy(&one, sn + 2 * i, 2);
      two = one;
    } else {
      std::memcpy(&two, sn + 2 * i, 4);
    }
    const __m128 pair = _mm_cvtph_ps(_mm_cvtsi32_si128(two));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  }
}

// Weight row n times x rows r0 .. r0 + NR - 1: out[r] gets 8 lane partial sums of y[r0 + r, n],
// the mn offsets (sum_g mn[n, g] * gsum[r0 + r, g]) added into the same lanes; the caller sums
// the lanes.
template <int BITS, int GROUP, int NR, typename S>
__attribute__((always_inline)) inline void avx2_row(const Avx2X& X, int64_t r0, const uint8_t* q, const S* scale,
                                                    const S* mn, int64_t row_bytes, int64_t n, __m256* out) {
  // Groups per chunk: 2 (4-bit; 8-bit group 16: 4 lanes each) or 1 (8-bit group 32: 8 lanes).
  constexpr int kGroupsPerChunk = BITS == 4 ? 2 : kAvx2Chunk / GROUP;
  const int64_t G = X.G, lanes = X.stride / 4;
  const int64_t chunks = (row_bytes + kAvx2Chunk - 1) / kAvx2Chunk;
  const bool half_tail = row_bytes % kAvx2Chunk != 0;  // rows are whole 16-byte groups: 16 bytes left
  const uint8_t* qn = q + n * row_bytes;
  const S* sn = scale + n * G;
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  _mm_prefetch(reinterpret_cast<const char*>(sn) + kPrefetch / 8, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(mn + n * G) + kPrefetch / 8, _MM_HINT_T0);
  for (int64_t i = 0; i < chunks; ++i) {
    const bool partial = half_tail && i == chunks - 1;
    if (i % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(qn + kAvx2Chunk * i + kPrefetch), _MM_HINT_T0);
    const __m256i w = partial ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + kAvx2Chunk * i)))
                              : avx2_load(qn + kAvx2Chunk * i);
    __m256i a, b;
    avx2_operands<BITS>(w, a, b);
    const __m256 ws = avx2_chunk_scales<BITS, kGroupsPerChunk>(sn, i, partial);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const int64_t row = r0 + r, at = row * X.stride + kAvx2Chunk * i, lane = row * lanes + 8 * i;
      const __m256i s = avx2_dot<BITS>(a, b, X.lo.data() + at, BITS == 4 ? X.hi.data() + at : nullptr,
                                       kAvx2LaneSums && BITS == 8 ? X.lane_sum.data() + lane : nullptr);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(ws, _mm256_loadu_ps(X.d.data() + lane)), acc[r]);
    }
  }
  const S* mnn = mn + n * G;
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) {
    const __m256 m = avx2_load8(mnn + g);
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(X.gsum.data() + (r0 + r) * G + g), acc[r]);
  }
  if (g < G) {
    const int left = static_cast<int>(G - g);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 m;
    if constexpr (std::is_same_v<S, float>) {
      m = avx2_load8_masked(mnn + g, mask);
    } else {
      m = avx2_load8_masked(mnn + g, left);
    }
    for (int r = 0; r < NR; ++r)
      acc[r] = _mm256_fmadd_ps(m, _mm256_maskload_ps(X.gsum.data() + (r0 + r) * G + g, mask), acc[r]);
  }
  for (int r = 0; r < NR; ++r) out[r] = acc[r];
}

// Rows [r0, r0 + NR) of the quantized x times weight rows [n0, n1): y[r * N + n], the lanes of 8
// weight rows at a time summed by one transpose-and-add (lane_sums8).
template <int BITS, int GROUP, int NR, typename T, typename S>
void avx2_block(const Avx2X& X, int64_t r0, const uint8_t* q, const S* scale, const S* mn, const float* bias,
                T* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t row_bytes = BITS == 4 ? K / 2 : K;
  for (int64_t n = n0; n < n1; n += 8) {
    const int rows = static_cast<int>(std::min<int64_t>(8, n1 - n));
    __m256 lanes[8][NR], by_row[8];
    for (int j = 0; j < rows; ++j) avx2_row<BITS, GROUP, NR, S>(X, r0, q, scale, mn, row_bytes, n + j, lanes[j]);
    for (int r = 0; r < NR; ++r) {
      for (int j = 0; j < 8; ++j) by_row[j] = j < rows ? lanes[j][r] : _mm256_setzero_ps();
      alignas(32) float sums[8];
      _mm256_store_ps(sums, lane_sums8(by_row));
      for (int j = 0; j < rows; ++j) y[(r0 + r) * N + n + j] = static_cast<T>(sums[j] + (bias ? bias[n + j] : 0.f));
    }
  }
}

template <int BITS, int GROUP, typename T, typename S>
void avx2_rows(const Avx2X& X, int64_t R, const uint8_t* q, const S* scale, const S* mn, const float* bias,
               T* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t t0 = n0; t0 < n1; t0 += kTileRows) {  // a tile's weights stay in cache for every row block
    const int64_t t1 = std::min(n1, t0 + kTileRows);
    for (int64_t r0 = 0; r0 < R; r0 += kRowBlock) {
      switch (std::min<int64_t>(kRowBlock, R - r0)) {
        case 1: avx2_block<BITS, GROUP, 1, T, S>(X, r0, q, scale, mn, bias, y, K, N, t0, t1); break;
        case 2: avx2_block<BITS, GROUP, 2, T, S>(X, r0, q, scale, mn, bias, y, K, N, t0, t1); break;
        case 3: avx2_block<BITS, GROUP, 3, T, S>(X, r0, q, scale, mn, bias, y, K, N, t0, t1); break;
        default: avx2_block<BITS, GROUP, 4, T, S>(X, r0, q, scale, mn, bias, y, K, N, t0, t1); break;
      }
    }
  }
}
// ----------------------------------------------------------------------------------------------
// The AVX2 build's stored tiles (quant_tiles): W's rows in tiles of kAvx2TileRows (8), each tile
// per group of GROUP columns its vectors, then the group's 8 scales and, where W has offsets that
// are not -c * scale, its 8 offsets (in S). Vector v of a group holds bytes 4v .. 4v + 3 of each
// of the tile's rows' group bytes, row i in int32 lane i, so that every lane is one output: a
// group's integer sums need no horizontal sums, and its float work (one conversion, the scales
// times x's d, one or two FMAs) is done once for 8 outputs. The row kernel above does that work
// per 32 bytes and output, and sums 8 lanes per output.
// - 4-bit: the row's 16 bytes of the group, low nibbles columns 4v .. 4v + 3, high nibbles 16 +
//   4v ..: 8 VPMADDUBSW a group (codes <= 15, qx within +-127), summed in int16 (|sum| <= 8 * 2 *
//   15 * 127 = 30480) and widened to int32 once a group.
// - 8-bit: w - 128 by the sign trick (above), every vector's pairs widened to int32 (they reach
//   32512), 128 * sum(qx) of the group added back once.
// - narrow (kind 1 + PLANES, an 8-bit W whose codes lie below 16, 32 or 64: Q2_K, Q3_K; Q5_x;
//   Q6_K, as the AVX-512 VNNI path's narrow tiles): the 8-bit vectors v and v + GROUP / 8 as the
//   low and high nibbles of one vector (x's columns 4v .. and GROUP / 2 + 4v .., as the 4-bit
//   layout's), then the codes' higher bits in vectors of their own (ggml's Q6_K qh, in byte
//   order): nibble vector v's byte j, low nibbles (h = 0) then high (h = 1), keeps its PLANES
//   higher bits in bits [b, b + PLANES) of byte j of plane vector u / 8, b = u % 8, u = (2v + h) *
//   PLANES; one shift, one AND and one OR put them back (avx2_add_planes). Group 16 with one
//   plane (codes below 32: 4 slots, half a vector) is stored with two (kind 3). Codes < 64 sum in
//   int16 by pairs of VPMADDUBSW (2 * 2 * 63 * 127 = 32004). 4 + PLANES bits a weight instead of 8.
// A W whose every offset is -c * its scale for one integer c (symmetric_offset: Q4_0, Q8_0) keeps
// no offsets; its groups' integer sums take c * sum(qx) off instead. The integer sums are those of
// the row kernel: the results differ from it in the float summation order only.
// Compact scales (4-bit tiles, narrow ones included, whose float32 scales and offsets factor per
// row and super-block of kSuperCols columns: the K-quants; `factor_rows`): before each
// super-block's groups its 8 rows' factors (float32; then the offsets' where stored), and per
// group 8 int8s instead of 8 floats (then the offsets'): 0.625-0.75 bits a weight instead of 2-4.
// The kernel multiplies them back, which gives the float32 values exactly: the same outputs.
// - grid (IQ4_NL / IQ4_XS: the 4-bit layout's codes into the grid, kept as nibbles): each nibble
//   looked up by VPSHUFB as its signed grid value (kGridValues - 128), then multiplied by the sign
//   trick and widened to int32 as the 8-bit tiles are (128 * sum(qx) added back: the unsigned
//   values' sums). 4.5 bits a weight instead of the widened 8-bit layout's 8.5. The row kernel
//   takes no grid: a grid weight without stored tiles is widened (`takes_grid`).
// Header (64 bytes): int32 c (or -1: offsets stored), bits, group, sizeof(S), kind, compact, grid.
constexpr int64_t kAvx2TileRows = 8;
inline int64_t avx2_group_bytes(int64_t bits, int64_t group, int64_t scale_bytes, bool with_mn, int32_t kind = 0,
                                bool compact = false) {
  const int64_t codes = kind > 0 ? group / 2 + group / 8 * (kind - 1) : bits == 4 ? group / 2 : group;
  return codes * kAvx2TileRows + (with_mn ? 2 : 1) * kAvx2TileRows * (compact ? 1 : scale_bytes);
}
// A compact tile's factors of one super-block (the scales', then the offsets' where stored).
inline int64_t avx2_super_bytes(bool with_mn) { return (with_mn ? 2 : 1) * kAvx2TileRows * 4; }
inline int64_t avx2_tiles_bytes(int64_t N, int64_t G, int64_t bits, int64_t group, int64_t scale_bytes, bool with_mn,
                                int32_t kind = 0, bool compact = false) {
  const int64_t tile = G * avx2_group_bytes(bits, group, scale_bytes, with_mn, kind, compact) +
                       (compact ? G * group / kSuperCols * avx2_super_bytes(with_mn) : 0);
  return 64 + (N + kAvx2TileRows - 1) / kAvx2TileRows * tile;
}

// W's tiles; compact (S float32 only) where `fsc` (and `fmn`, where offsets are stored) are given.
template <typename S>
at::Tensor avx2_store_tiles(const at::Tensor& q, const S* scale, const S* mn, int64_t K, int64_t bits, int64_t group,
                            int32_t kind, int32_t grid, int32_t c, const Factors* fsc, const Factors* fmn) {
  const int64_t N = q.size(0), G = K / group, row_bytes = q.size(1), group_q = bits == 4 ? group / 2 : group;
  const bool with_mn = c < 0, compact = fsc != nullptr;
  const int64_t group_bytes = avx2_group_bytes(bits, group, sizeof(S), with_mn, kind, compact);
  const int64_t code_bytes = group_bytes - (with_mn ? 2 : 1) * kAvx2TileRows * (compact ? 1 : sizeof(S));
  const int64_t per_super = kSuperCols / group, B = G / per_super;
  const int64_t super_bytes = compact ? avx2_super_bytes(with_mn) : 0;
  const int64_t tile_bytes = G * group_bytes + B * super_bytes;
  const int planes = kind > 0 ? kind - 1 : 0, nibble_vectors = static_cast<int>(group / 8);
  at::Tensor tiles = at::zeros({avx2_tiles_bytes(N, G, bits, group, sizeof(S), with_mn, kind, compact)}, q.options());
  uint8_t* out = tiles.data_ptr<uint8_t>();
  const int32_t header[7] = {c,    static_cast<int32_t>(bits), static_cast<int32_t>(group), static_cast<int32_t>(sizeof(S)),
                             kind, compact, grid};
  std::memcpy(out, header, sizeof(header));
  const uint8_t* qp = q.data_ptr<uint8_t>();
  at::parallel_for(0, (N + kAvx2TileRows - 1) / kAvx2TileRows, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* at = out + 64 + t * tile_bytes + g * group_bytes + (compact ? (g / per_super + 1) * super_bytes : 0);
        if (compact && g % per_super == 0)  // the super-block's factors, just before its first group
          for (int a = 0; a < (with_mn ? 2 : 1); ++a) {
            const Factors& f = a == 0 ? *fsc : *fmn;
            float* d = reinterpret_cast<float*>(at - super_bytes) + a * kAvx2TileRows;
            for (int64_t i = 0; i < kAvx2TileRows && kAvx2TileRows * t + i < N; ++i)
              d[i] = f.d[(kAvx2TileRows * t + i) * B + g / per_super];
          }
        S* s = reinterpret_cast<S*>(at + code_bytes);
        int8_t* k = reinterpret_cast<int8_t*>(at + code_bytes);
        for (int64_t i = 0; i < kAvx2TileRows && kAvx2TileRows * t + i < N; ++i) {
          const int64_t n = kAvx2TileRows * t + i;
          const uint8_t* codes = qp + n * row_bytes + group_q * g;
          if (kind == 0) {
            for (int64_t v = 0; v < group_q / 4; ++v) std::memcpy(at + 32 * v + 4 * i, codes + 4 * v, 4);
          } else {
            for (int v = 0; v < nibble_vectors; ++v)
              for (int b = 0; b < 4; ++b) {
                const int j = 4 * static_cast<int>(i) + b;  // the byte's bit in the masks
                const uint8_t low = codes[4 * v + b], high = codes[4 * (v + nibble_vectors) + b];
                at[32 * v + j] = static_cast<uint8_t>((low & 15) | (high & 15) << 4);
                uint8_t* plane_vectors = at + 32 * nibble_vectors;
                for (int h = 0; h < 2; ++h) {
                  const int u = (2 * v + h) * planes;
                  plane_vectors[32 * (u / 8) + j] |= static_cast<uint8_t>(((h == 0 ? low : high) >> 4) << (u % 8));
                }
              }
          }
          if (compact) {
            k[i] = fsc->k[n * G + g];
            if (with_mn) k[kAvx2TileRows + i] = fmn->k[n * G + g];
          } else {
            s[i] = scale[n * G + g];
            if (with_mn) s[kAvx2TileRows + i] = mn[n * G + g];
          }
        }
      }
  });
  return tiles;
}

inline __m256i avx2_bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// f(std::integral_constant<int, i>) for i = 0 .. COUNT - 1 in order.
template <typename F, int... I>
__attribute__((always_inline)) inline void avx2_for(const F& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int COUNT, typename F>
__attribute__((always_inline)) inline void avx2_for(const F& f) {
  avx2_for(f, std::make_integer_sequence<int, COUNT>{});
}

// Bits [B, B + PLANES) of each byte of a plane vector moved to bits [4, 4 + PLANES), the rest 0.
template <int B, int PLANES>
inline __m256i avx2_high_bits(__m256i planes) {
  const __m256i mask = _mm256_set1_epi8(static_cast<char>(((1 << PLANES) - 1) << 4));
  if constexpr (B < 4) return _mm256_and_si256(_mm256_slli_epi16(planes, 4 - B), mask);
  if constexpr (B > 4) return _mm256_and_si256(_mm256_srli_epi16(planes, B - 4), mask);
  return _mm256_and_si256(planes, mask);
}
// A narrow tile's higher bits of nibble vector V (its plane vectors at p, above) put back into
// its nibbles lo and hi.
template <int PLANES, int V>
inline void avx2_add_planes(const uint8_t* p, __m256i& lo, __m256i& hi) {
  if constexpr (PLANES > 0) {
    constexpr int kLo = 2 * V * PLANES, kHi = (2 * V + 1) * PLANES;
    lo = _mm256_or_si256(lo, avx2_high_bits<kLo % 8, PLANES>(avx2_load(p + 32 * (kLo / 8))));
    hi = _mm256_or_si256(hi, avx2_high_bits<kHi % 8, PLANES>(avx2_load(p + 32 * (kHi / 8))));
  }
}

// How far ahead of its group a tile's first row block asks for the weight stream (software
// prefetch, T0): the hardware prefetchers alone left a core's compute and its reads in turn
// (one thread from memory at about half of either's rate alone).
constexpr int64_t kAvx2Prefetch = 4096;

// 8 int8s of a compact tile times their factors (float32 at d, exact; read from L1 each group:
// in registers they cost the row block's accumulators two, which then spill).
inline __m256 avx2_factored(const uint8_t* k, const float* d) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(k));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), _mm256_loadu_ps(d));
}

// Rows [r0, r0 + NR) of x times one tile (weight rows [n, n + rows)): y[r * N + n + i]. BITS: the
// tile's vectors (4: nibbles, of a 4-bit W or a narrow tile of an 8-bit one with PLANES planes);
// COMPACT: its scales (and offsets) as factors and int8s (S float32).
template <int BITS, int GROUP, int PLANES, int NR, bool SYM, bool COMPACT, bool GRID, typename T, typename S>
void avx2_tile_block(const RowsX& X, int64_t r0, const uint8_t* tile, int32_t c, const float* bias, T* y,
                     int64_t N, int64_t n, int rows) {
  static_assert(!COMPACT || (BITS == 4 && std::is_same_v<S, float>), "compact scales are 4-bit tiles' float32 ones");
  static_assert(!GRID || (BITS == 4 && PLANES == 0), "grid codes are a 4-bit tile's");
  // the grid's signed values (ggml's kvalues_iq4nl), in both 128-bit lanes for VPSHUFB
  const __m256i grid = _mm256_xor_si256(
      _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kGridValues))), _mm256_set1_epi8(static_cast<char>(0x80)));
  const bool fetch = r0 == 0;  // later row blocks read the tile from L1 / L2
  constexpr int kV = (BITS == 4 ? GROUP / 2 : GROUP) * kAvx2TileRows / 32;  // vectors a group
  constexpr int64_t kCodeBytes = kV * 32 + kV * 8 * PLANES;
  constexpr int64_t kPerSuper = kSuperCols / GROUP;
  const int64_t G = X.G, group_bytes = kCodeBytes + (SYM ? 1 : 2) * kAvx2TileRows * (COMPACT ? 1 : sizeof(S));
  const int64_t super_bytes = COMPACT ? avx2_super_bytes(!SYM) : 0;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  const float* factors = nullptr;  // a compact tile's of the group's super-block
  const uint8_t* at = tile;
  for (int64_t g = 0; g < G; ++g, at += group_bytes) {
    int64_t fetch_bytes = group_bytes;
    if constexpr (COMPACT) {
      if (g % kPerSuper == 0) {  // the super-block's factors lie before its first group
        factors = reinterpret_cast<const float*>(at);
        at += super_bytes;
        fetch_bytes += super_bytes;
      }
    }
    if (fetch)
      for (int64_t off = 0; off < fetch_bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(at + kAvx2Prefetch + off), _MM_HINT_T0);
    __m256i sum[NR];
    if constexpr (GRID) {
      // signed grid values (|v| <= 127) by the sign trick, each VPMADDUBSW's pairs widened
      for (int r = 0; r < NR; ++r) sum[r] = _mm256_set1_epi32(128 * X.isum[(r0 + r) * G + g]);
      avx2_for<kV>([&](auto vector) {
        constexpr int v = decltype(vector)::value;
        const __m256i w = avx2_load(at + 32 * v);
        const __m256i lo = _mm256_shuffle_epi8(grid, _mm256_and_si256(w, low4));
        const __m256i hi = _mm256_shuffle_epi8(grid, _mm256_and_si256(_mm256_srli_epi16(w, 4), low4));
        const __m256i lo_abs = _mm256_abs_epi8(lo), hi_abs = _mm256_abs_epi8(hi);
        for (int r = 0; r < NR; ++r) {
          const int8_t* xr = X.qx.data() + (r0 + r) * X.stride + GROUP * g + 4 * v;
          const __m256i l = _mm256_madd_epi16(_mm256_maddubs_epi16(lo_abs, _mm256_sign_epi8(avx2_bcast4(xr), lo)), ones);
          const __m256i h =
              _mm256_madd_epi16(_mm256_maddubs_epi16(hi_abs, _mm256_sign_epi8(avx2_bcast4(xr + GROUP / 2), hi)), ones);
          sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(l, h));
        }
      });
    } else if constexpr (BITS == 4) {
      // codes <= 15: the group's products summed in int16 (2 * kV <= 8 VPMADDUBSW of pairs <=
      // 3810); with planes (codes <= 63), each vector's pair of them, then widened
      constexpr bool kInt16 = PLANES == 0;
      __m256i s16[NR];
      for (int r = 0; r < NR; ++r) s16[r] = sum[r] = _mm256_setzero_si256();
      avx2_for<kV>([&](auto vector) {
        constexpr int v = decltype(vector)::value;
        const __m256i w = avx2_load(at + 32 * v);
        __m256i lo = _mm256_and_si256(w, low4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
        avx2_add_planes<PLANES, v>(at + kV * 32, lo, hi);
        for (int r = 0; r < NR; ++r) {
          const int8_t* xr = X.qx.data() + (r0 + r) * X.stride + GROUP * g + 4 * v;
          const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo, avx2_bcast4(xr)),
                                                _mm256_maddubs_epi16(hi, avx2_bcast4(xr + GROUP / 2)));
          if constexpr (kInt16) {
            s16[r] = _mm256_add_epi16(s16[r], pair);
          } else {
            sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(pair, ones));
          }
        }
      });
      if constexpr (kInt16)
        for (int r = 0; r < NR; ++r) sum[r] = _mm256_madd_epi16(s16[r], ones);
    } else {
      for (int r = 0; r < NR; ++r) sum[r] = _mm256_set1_epi32(128 * X.isum[(r0 + r) * G + g]);
#pragma GCC unroll 8
      for (int v = 0; v < kV; ++v) {
        const __m256i a = _mm256_xor_si256(avx2_load(at + 32 * v), flip), b = _mm256_abs_epi8(a);
        for (int r = 0; r < NR; ++r) {
          const __m256i xv = avx2_bcast4(X.qx.data() + (r0 + r) * X.stride + GROUP * g + 4 * v);
          sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(b, _mm256_sign_epi8(xv, a)), ones));
        }
      }
    }
    // the group's 8 scales (a = 0) or offsets (a = 1): stored, or a compact tile's int8s times factors
    auto scales = [&](int a) {
      if constexpr (COMPACT) {
        return avx2_factored(at + kCodeBytes + a * kAvx2TileRows, factors + a * kAvx2TileRows);
      } else {
        return avx2_load8(reinterpret_cast<const S*>(at + kCodeBytes) + a * kAvx2TileRows);
      }
    };
    const __m256 sc = scales(0);
    for (int r = 0; r < NR; ++r) {
      const int64_t row = r0 + r;
      if constexpr (SYM) sum[r] = _mm256_sub_epi32(sum[r], _mm256_set1_epi32(c * X.isum[row * G + g]));
      const __m256 dx = _mm256_set1_ps(X.d[row * X.blocks + GROUP * g / 32]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_mul_ps(sc, dx), acc[r]);
    }
    if constexpr (!SYM) {
      const __m256 m = scales(1);
      for (int r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(X.gsum[(r0 + r) * G + g]), acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    alignas(32) float out[kAvx2TileRows];
    _mm256_store_ps(out, acc[r]);
    for (int i = 0; i < rows; ++i) y[(r0 + r) * N + n + i] = static_cast<T>(out[i] + (bias ? bias[n + i] : 0.f));
  }
}

// Every row of x times tiles [t0, t1) of W's stored tiles (`tiles`: their header), each tile by
// every block of up to kRowBlock rows (from L1 after the first).
template <int BITS, int GROUP, int PLANES, bool GRID, typename T, typename S>
void avx2_tile_rows(const RowsX& X, int64_t R, const uint8_t* tiles, const float* bias, T* y, int64_t N, int64_t t0,
                    int64_t t1) {
  int32_t header[6];
  std::memcpy(header, tiles, sizeof(header));
  const int32_t c = header[0];
  const bool compact = header[5] == 1;
  const int64_t bytes = avx2_tiles_bytes(kAvx2TileRows, X.G, header[1], GROUP, sizeof(S), c < 0, header[4], compact) - 64;
  auto blocks = [&](auto symmetric, auto factored) {
    constexpr bool SYM = decltype(symmetric)::value, COMPACT = decltype(factored)::value;
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* tile = tiles + 64 + t * bytes;
      const int64_t n = kAvx2TileRows * t;
      const int rows = static_cast<int>(std::min<int64_t>(kAvx2TileRows, N - n));
      for (int64_t r0 = 0; r0 < R; r0 += kRowBlock) {
        switch (std::min<int64_t>(kRowBlock, R - r0)) {
          case 1: avx2_tile_block<BITS, GROUP, PLANES, 1, SYM, COMPACT, GRID, T, S>(X, r0, tile, c, bias, y, N, n, rows); break;
          case 2: avx2_tile_block<BITS, GROUP, PLANES, 2, SYM, COMPACT, GRID, T, S>(X, r0, tile, c, bias, y, N, n, rows); break;
          case 3: avx2_tile_block<BITS, GROUP, PLANES, 3, SYM, COMPACT, GRID, T, S>(X, r0, tile, c, bias, y, N, n, rows); break;
          default: avx2_tile_block<BITS, GROUP, PLANES, 4, SYM, COMPACT, GRID, T, S>(X, r0, tile, c, bias, y, N, n, rows); break;
        }
      }
    }
  };
  auto with_scales = [&](auto symmetric) {
    if constexpr (BITS == 4 && std::is_same_v<S, float>) {
      if (compact) {
        blocks(symmetric, std::true_type{});
        return;
      }
    }
    blocks(symmetric, std::false_type{});
  };
  if (c >= 0) {
    with_scales(std::true_type{});
  } else {
    with_scales(std::false_type{});
  }
}

#ifdef __AVXVNNI__
#define TANDEM_QUANT_AVX2 "avx_vnni"
#else
#define TANDEM_QUANT_AVX2 "avx2_maddubs"
#endif
#endif

// f(bits, group, grid) as compile-time constants (std::integral_constant) for the layout (bits,
// group; `grid`: the 4-bit codes index the grid): 4-bit group 32 (codes or grid), 8-bit group 32
// or 16.
template <typename F>
inline void by_layout(int64_t bits, int64_t group, bool grid, const F& f) {
  using No = std::false_type;
  if (bits == 4 && grid) {
    f(std::integral_constant<int, 4>{}, std::integral_constant<int, 32>{}, std::true_type{});
  } else if (bits == 4) {
    f(std::integral_constant<int, 4>{}, std::integral_constant<int, 32>{}, No{});
  } else if (group == 32) {
    f(std::integral_constant<int, 8>{}, std::integral_constant<int, 32>{}, No{});
  } else {
    f(std::integral_constant<int, 8>{}, std::integral_constant<int, 16>{}, No{});
  }
}

// The items of a kernel's range (output rows or tiles; `bytes`: the weight's, over all `items`)
// that a team's thread takes at least at a time (Share::run): ~32 KB of weights, a multiple of
// `multiple`, below which taking them costs more than the balance it buys.
inline int64_t steal_unit(int64_t items, int64_t bytes, int64_t multiple) {
  const int64_t per = std::max<int64_t>(1, bytes / std::max<int64_t>(items, 1));
  const int64_t unit = std::max<int64_t>(1, (int64_t{32} << 10) / per);
  return (unit + multiple - 1) / multiple * multiple;
}

// bfloat16 / float16 rows, and float32 rows with int8_x, through an int8 path where the CPU has
// one; otherwise (float32 rows without int8_x, whose results equal dequantize-then-matmul) x's
// rows in float32 and each group's sum; then every output row, split over threads.
template <typename T, typename S>
void quant_linear_impl(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& mn,
                       const uint8_t* tiles, bool tiles_mn, int32_t tiles_kind, bool compact, const float* bias,
                       int64_t bits, int64_t group, bool grid, bool int8_x, at::Tensor& y,
                       const tandem_cpu::Share& team) {
  const int64_t R = x.size(0), K = x.size(1), N = q.size(0), G = K / group;
  const T* xp = x.data_ptr<T>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const S* sp = scale.data_ptr<S>();
  const S* mp = mn.data_ptr<S>();
  T* yp = y.data_ptr<T>();
  // Output rows per task: ~64 KB of weights, below which a second thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(bits == 4 ? K / 2 : K, 1));
  // A team takes a weight of 2 MB or more in chunks, and the others' last ones (Share::taken);
  // less, each thread its fixed share (taking chunks cost more than the balance bought).
  Share share = team;
  if (q.numel() < (int64_t{2} << 20)) share.taken = nullptr;
#ifdef TANDEM_QUANT_VNNI
  if (!std::is_same_v<T, float> || int8_x) {
    if (tiles || R >= kGemmRows) {  // by tiles of 32 weight rows: stored packed ones (any rows), or transposed here
      const RowsX X = quantize_rows(xp, x.stride(0), R, K, group);
      const int64_t count = (N + kTileRows - 1) / kTileRows;
      const int64_t tile_grain = std::max<int64_t>(1, grain * kRowBlock / (kTileRows * R));
      share.run(count, tile_grain, [&](int64_t t0, int64_t t1) {
        by_layout(bits, group, grid, [&](auto b, auto g, auto c) {
          constexpr int kBits = decltype(b)::value, kGroup = decltype(g)::value;
          constexpr bool kGridded = decltype(c)::value;
          if (tiles) {
            // 4-bit tiles (a narrow tile of an 8-bit weight: nibbles and planes), compact or not
            auto nibbles = [&](auto grid_c, auto planes) {
              constexpr bool kG = decltype(grid_c)::value;
              constexpr int kP = decltype(planes)::value;
              if constexpr (std::is_same_v<S, float>) {
                if (compact) {
                  gemv_rows<4, kGroup, kG, kP, true, T, S>(X, R, tiles, tiles_mn, bias, yp, N, t0, t1);
                  return;
                }
              }
              gemv_rows<4, kGroup, kG, kP, false, T, S>(X, R, tiles, tiles_mn, bias, yp, N, t0, t1);
            };
            if (kBits == 8 && tiles_kind == 1) {
              nibbles(std::false_type{}, std::integral_constant<int, 0>{});
            } else if (kBits == 8 && tiles_kind == 2) {
              nibbles(std::false_type{}, std::integral_constant<int, 1>{});
            } else if (kBits == 8 && tiles_kind == 3) {
              nibbles(std::false_type{}, std::integral_constant<int, 2>{});
            } else if constexpr (kBits == 4) {
              nibbles(std::integral_constant<bool, kGridded>{}, std::integral_constant<int, 0>{});
            } else {
              gemv_rows<kBits, kGroup, kGridded, 0, false, T, S>(X, R, tiles, tiles_mn, bias, yp, N, t0, t1);
            }
          } else {
            gemm_rows<kBits, kGroup, kGridded, T, S>(X, R, qp, sp, mp, bias, yp, K, N, t0, t1);
          }
        });
      }, steal_unit(count, q.numel(), 1));
      return;
    }
    const QuantizedX X = quantize_x(xp, x.stride(0), R, K, bits, group);
    share.run(N, grain, [&](int64_t n0, int64_t n1) {
      by_layout(bits, group, grid, [&](auto b, auto g, auto c) {
        vnni_rows<decltype(b)::value, decltype(g)::value, decltype(c)::value, T, S>(X, R, qp, sp, mp, bias, yp, K, N,
                                                                                    n0, n1);
      });
    }, steal_unit(N, q.numel(), kTileRows));
    return;
  }
#elif defined(TANDEM_QUANT_AVX2)
  if (!std::is_same_v<T, float> || int8_x) {
    if (tiles) {
      const RowsX X = quantize_rows(xp, x.stride(0), R, K, group);
      const int64_t count = (N + kAvx2TileRows - 1) / kAvx2TileRows;
      share.run(count, std::max<int64_t>(1, grain / kAvx2TileRows), [&](int64_t t0, int64_t t1) {
        by_layout(bits, group, grid, [&](auto b, auto g, auto c) {
          constexpr int kBits = decltype(b)::value, kGroup = decltype(g)::value;
          constexpr bool kGridded = decltype(c)::value;
          switch (kBits == 8 ? tiles_kind : 0) {  // a narrow tile of an 8-bit W: nibbles and planes
            case 1: avx2_tile_rows<4, kGroup, 0, false, T, S>(X, R, tiles, bias, yp, N, t0, t1); break;
            case 2: avx2_tile_rows<4, kGroup, 1, false, T, S>(X, R, tiles, bias, yp, N, t0, t1); break;
            case 3: avx2_tile_rows<4, kGroup, 2, false, T, S>(X, R, tiles, bias, yp, N, t0, t1); break;
            default: avx2_tile_rows<kBits, kGroup, 0, kGridded, T, S>(X, R, tiles, bias, yp, N, t0, t1); break;
          }
        });
      }, steal_unit(count, q.numel(), 4));
      return;
    }
    TORCH_CHECK(!grid, "quant_linear: the AVX2 build takes the grid layout with its stored tiles only (quant_tiles; or widen it to bits 8)");
    const Avx2X X = avx2_quantize_x(xp, x.stride(0), R, K, bits, group);
    share.run(N, grain, [&](int64_t n0, int64_t n1) {
      by_layout(bits, group, false, [&](auto b, auto g, auto) {
        avx2_rows<decltype(b)::value, decltype(g)::value, T, S>(X, R, qp, sp, mp, bias, yp, K, N, n0, n1);
      });
    }, steal_unit(N, q.numel(), 32));
    return;
  }
#endif
  std::vector<float> xf(R * K), xsum(R * G);
  for (int64_t r = 0; r < R; ++r) {
    const T* row = xp + r * x.stride(0);
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
        const vec16 v = load16(row + k);
        store16(xf.data() + r * K + k, v);
        sum += lane_sum(v);
      }
      xsum[r * G + g] = sum;
    }
  }
  share.run(N, grain, [&](int64_t n0, int64_t n1) {
    by_layout(bits, group, grid, [&](auto b, auto g, auto c) {
      quant_rows<decltype(b)::value, decltype(g)::value, decltype(c)::value, T, S>(xf.data(), xsum.data(), qp, sp, mp, bias, yp, R, K, N, n0, n1);
    });
  }, steal_unit(N, q.numel(), 32));
}

}  // namespace

namespace tandem_cpu {

// A layout code (bits, or bits | kGrid) as (bits, grid); a code of no layout is refused.
std::pair<int64_t, bool> layout_bits(const char* op, int64_t code) {
  TORCH_CHECK(code == 4 || code == 8 || code == (4 | kGrid), op, ": bits must be 4, 8 or 4 | ", kGrid, " (grid)");
  return {code & ~kGrid, (code & kGrid) != 0};
}

// W's tensors checked against each other and K: q uint8 [N, K/2] (bits 4) or [N, K] (bits 8),
// scale and mn float32 or float16 (one dtype) [N, K/group].
void check_weight(const char* op, int64_t K, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& mn,
                  int64_t bits, int64_t group) {
  TORCH_CHECK(q.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK((bits == 4 && group == 32) || (bits == 8 && (group == 16 || group == 32)), op,
              ": layouts are bits 4 group 32, bits 8 group 16 or 32");
  TORCH_CHECK(K % group == 0, op, ": in (", K, ") must be a multiple of the group (", group, ")");
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 2 && q.size(1) == (bits == 4 ? K / 2 : K),
              op, ": q must be contiguous uint8 [out, in", bits == 4 ? "/2" : "", "]");
  const int64_t N = q.size(0), G = K / group;
  for (const at::Tensor* t : {&scale, &mn}) {
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kHalf) &&
                    t->scalar_type() == scale.scalar_type() && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == N && t->size(1) == G,
                op, ": scale and mn must be contiguous float32 or float16 (both one dtype) [out, in/group]");
  }
}

// Where this build multiplies rows by weight tiles (the AVX-512 VNNI path; AVX2: below): W's packed tiles
// (gemv_rows, for every row count; from kGemmRows rows the sums of the tiles gemm_rows
// transposes per call, without the transposition), one uint8 tensor [stored_tiles_bytes] for
// quant_linear's `tiles`: narrow tiles and compact scales where the weight allows them, unless
// `narrow` is false (the layout's own tiles, for comparisons: the same outputs). On the AVX2
// build its tiles of 8 rows (avx2_store_tiles: narrow ones, compact scales and grid codes too).
// Elsewhere an empty tensor.
at::Tensor quant_tiles(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& mn, int64_t code, int64_t group,
                       bool narrow) {
  TORCH_CHECK(q.dim() == 2, "quant_tiles: q must be [out, in bytes]");
  const int64_t bits = layout_bits("quant_tiles", code).first;  // a grid's tiles hold its codes as they are
  const int64_t K = bits == 4 ? 2 * q.size(1) : q.size(1), N = q.size(0);
  check_weight("quant_tiles", K, q, scale, mn, bits, group);
#ifdef TANDEM_QUANT_VNNI
  at::Tensor tiles;
  auto run = [&](auto s) {
    using S = decltype(s);
    const int64_t G = K / group;
    const bool with_mn = tiles_need_offsets(scale.data_ptr<S>(), mn.data_ptr<S>(), N, G);
    const int32_t kind = narrow ? narrow_kind(q, bits) : 0;
    const std::pair<int, int> format = tile_format(bits, kind);
    // float32 scales of a 4-bit tile: compact where they factor (`factor_rows`)
    Factors fsc, fmn;
    bool compact = false;
    if constexpr (std::is_same_v<S, float>) {
      compact = narrow && format.first == 4 && factor_rows(scale.data_ptr<float>(), N, G, kSuperCols / group, fsc) &&
                (!with_mn || factor_rows(mn.data_ptr<float>(), N, G, kSuperCols / group, fmn));
    }
    tiles = at::empty({stored_tiles_bytes(N, G, format.first, group, sizeof(S), with_mn, format.second, compact)},
                      q.options());
    TORCH_CHECK(reinterpret_cast<uintptr_t>(tiles.data_ptr()) % 64 == 0, "quant_tiles: unaligned allocation");
    by_layout(bits, group, false, [&](auto b, auto g, auto) {
      constexpr int kBits = decltype(b)::value, kGroup = decltype(g)::value;
      auto store = [&](auto k) {
        constexpr int kKind = decltype(k)::value;
        auto put = [&](auto c) {
          store_tiles<kBits, kGroup, kKind, decltype(c)::value, S>(q.data_ptr<uint8_t>(), scale.data_ptr<S>(),
                                                                    mn.data_ptr<S>(), K, N, with_mn,
                                                                    tiles.data_ptr<uint8_t>(), &fsc, &fmn);
        };
        if (compact) {  // (only 4-bit tiles are made compact)
          put(std::true_type{});
        } else {
          put(std::false_type{});
        }
      };
      if constexpr (kBits == 8) {
        switch (kind) {
          case 1: store(std::integral_constant<int, 1>{}); break;
          case 2: store(std::integral_constant<int, 2>{}); break;
          case 3: store(std::integral_constant<int, 3>{}); break;
          default: store(std::integral_constant<int, 0>{}); break;
        }
      } else {
        store(std::integral_constant<int, 0>{});
      }
    });
  };
  if (scale.scalar_type() == at::kHalf) {
    run(c10::Half{});
  } else {
    run(float{});
  }
  return tiles;
#elif defined(TANDEM_QUANT_AVX2)
  const int32_t grid = layout_bits("quant_tiles", code).second ? 1 : 0;  // grid codes: 4-bit tiles, looked up
  int32_t kind = narrow ? narrow_kind(q, bits) : 0;
  if (group == 16 && kind == 2) kind = 3;  // one plane of group 16 is half a plane vector: stored as two
  const at::Tensor ws = scale.to(at::kFloat).contiguous(), wmn = mn.to(at::kFloat).contiguous();
  const int64_t G = K / group;
  const int32_t c = symmetric_offset(ws.data_ptr<float>(), wmn.data_ptr<float>(), N * G);
  if (scale.scalar_type() == at::kHalf)
    return avx2_store_tiles(q, scale.data_ptr<c10::Half>(), mn.data_ptr<c10::Half>(), K, bits, group, kind, grid, c,
                            nullptr, nullptr);
  // float32 scales of a 4-bit tile (narrow ones too): compact where they factor
  Factors fsc, fmn;
  const bool compact = narrow && (bits == 4 || kind > 0) && factor_rows(ws.data_ptr<float>(), N, G, kSuperCols / group, fsc) &&
                       (c >= 0 || factor_rows(wmn.data_ptr<float>(), N, G, kSuperCols / group, fmn));
  return avx2_store_tiles(q, scale.data_ptr<float>(), mn.data_ptr<float>(), K, bits, group, kind, grid, c,
                          compact ? &fsc : nullptr, compact ? &fmn : nullptr);
#else
  return at::empty({0}, q.options());
#endif
}

// x [R, K] (float32, bfloat16 or float16; rows contiguous); q uint8 [N, K/2] (bits 4) or
// [N, K] (bits 8); scale, mn float32 [N, K/group]; bias float32 [N] or None; y [R, N] in x's
// dtype, contiguous: y's columns of this share = x @ W^T (the float32 sum rounded once).
// int8_x: float32 rows too take the int8 path (bfloat16 / float16 rows always do, where the
// build has one). tiles: quant_tiles of the same W (64-byte aligned), or None (or empty).
void quant_linear_into(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& mn,
                       int64_t code, int64_t group, bool int8_x, const c10::optional<at::Tensor>& bias, at::Tensor& y,
                       const Share& share, const c10::optional<at::Tensor>& tiles) {
  TORCH_CHECK(x.device().is_cpu(), "quant_linear: CPU tensors only");
  const std::pair<int64_t, bool> layout = layout_bits("quant_linear", code);
  const int64_t bits = layout.first;
  const bool grid = layout.second;
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "quant_linear: x must be [rows, in] with contiguous rows");
  const int64_t R = x.size(0), K = x.size(1);
  check_weight("quant_linear", K, q, scale, mn, bits, group);
  const int64_t N = q.size(0);
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && y.is_contiguous() && y.dim() == 2 && y.size(0) == R &&
                  y.size(1) == N,
              "quant_linear: y must be contiguous [rows, out] in x's dtype");
  const float* bias_p = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "quant_linear: bias must be contiguous float32 [out]");
    bias_p = bias->data_ptr<float>();
  }
  const uint8_t* tiles_p = nullptr;
  bool tiles_mn = false;  // the packed tiles hold offsets (told by their size: tiles_need_offsets)
  int32_t tiles_kind = 0;  // their kind (the first tile's header: narrow tiles of an 8-bit weight)
  int32_t compact = 0;     // and whether their scales are compact (float32 scales of 4-bit tiles)
  if (tiles.has_value() && tiles->numel() > 0) {
#ifdef TANDEM_QUANT_VNNI
    const int64_t G = K / group, sb = scale.element_size();
    const bool bytes_ok = tiles->scalar_type() == at::kByte && tiles->is_contiguous() && tiles->dim() == 1 &&
                          tiles->numel() >= 64;
    if (bytes_ok) {
      std::memcpy(&tiles_kind, tiles->data_ptr<uint8_t>() + 4, sizeof(tiles_kind));
      std::memcpy(&compact, tiles->data_ptr<uint8_t>() + 8, sizeof(compact));
    }
    const bool kind_ok = (tiles_kind == 0 || (bits == 8 && tiles_kind >= 1 && tiles_kind <= 3)) &&
                         (compact == 0 || (compact == 1 && sb == 4 && (bits == 4 || tiles_kind > 0)));
    const std::pair<int, int> format = tile_format(bits, kind_ok ? tiles_kind : 0);
    const bool c = kind_ok && compact == 1;
    tiles_mn = tiles->numel() == stored_tiles_bytes(N, G, format.first, group, sb, true, format.second, c);
    TORCH_CHECK(bytes_ok && kind_ok &&
                    (tiles_mn || tiles->numel() == stored_tiles_bytes(N, G, format.first, group, sb, false,
                                                                      format.second, c)) &&
                    reinterpret_cast<uintptr_t>(tiles->data_ptr()) % 64 == 0,
                "quant_linear: tiles must be quant_tiles of this weight (contiguous, 64-byte aligned)");
    tiles_p = tiles->data_ptr<uint8_t>();
#elif defined(TANDEM_QUANT_AVX2)
    int32_t header[7] = {0, 0, 0, 0, 0, 0, 0};
    const bool bytes_ok = tiles->scalar_type() == at::kByte && tiles->is_contiguous() && tiles->dim() == 1 &&
                          tiles->numel() >= 64;
    if (bytes_ok) std::memcpy(header, tiles->data_ptr<uint8_t>(), sizeof(header));
    tiles_kind = header[4];
    const bool factored = header[5] == 1;
    TORCH_CHECK(bytes_ok && header[6] == (grid ? 1 : 0) && header[1] == bits && header[2] == group && header[3] == scale.element_size() &&
                    (tiles_kind == 0 || (bits == 8 && tiles_kind >= 1 && tiles_kind <= 3)) &&
                    (header[5] == 0 || (factored && scale.element_size() == 4 && (bits == 4 || tiles_kind > 0))) &&
                    tiles->numel() == avx2_tiles_bytes(N, K / group, bits, group, scale.element_size(), header[0] < 0,
                                                       tiles_kind, factored),
                "quant_linear: tiles must be quant_tiles of this weight (contiguous)");
    tiles_p = tiles->data_ptr<uint8_t>();
#else
    TORCH_CHECK(false, "quant_linear: this build has no tiled path (quant_tiles gives an empty tensor)");
#endif
  }
  const bool half_scales = scale.scalar_type() == at::kHalf;
  auto run = [&](auto t) {
    using T = decltype(t);
    if (half_scales) {
      quant_linear_impl<T, c10::Half>(x, q, scale, mn, tiles_p, tiles_mn, tiles_kind, false, bias_p, bits, group, grid,
                                      int8_x, y, share);
    } else {
      quant_linear_impl<T, float>(x, q, scale, mn, tiles_p, tiles_mn, tiles_kind, compact == 1, bias_p, bits, group,
                                  grid, int8_x, y, share);
    }
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "quant_linear: unsupported dtype ", x.scalar_type());
  }
}

// quant_linear_into a new y, split over PyTorch's threads.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& mn,
                        int64_t bits, int64_t group, const c10::optional<at::Tensor>& bias, bool int8_x,
                        const c10::optional<at::Tensor>& tiles) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "quant_linear: x must be [rows, in] with contiguous rows");
  auto y = at::empty({x.size(0), q.dim() > 0 ? q.size(0) : 0}, x.options());
  quant_linear_into(x, q, scale, mn, bits, group, int8_x, bias, y, Share{}, tiles);
  return y;
}

// Rows `ids` of W (float32 scales and offsets) dequantized as gguf_repack.Packed.dequantize
// does (scale * q + mn, two float32 roundings), then rounded to `dtype`: an embedding lookup
// from the quantized table.
at::Tensor quant_rows(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& mn, int64_t code, int64_t group,
                      const at::Tensor& ids, at::ScalarType dtype) {
  const auto [bits, grid] = layout_bits("quant_rows", code);
  const int64_t K = q.dim() == 2 ? q.size(1) * (bits == 4 ? 2 : 1) : 0;
  check_weight("quant_rows", K, q, scale, mn, bits, group);
  TORCH_CHECK(scale.scalar_type() == at::kFloat, "quant_rows: scale and mn must be float32");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "quant_rows: ids must be int64 [n]");
  const at::Tensor rows = ids.contiguous();
  const int64_t n = rows.size(0), N = q.size(0), G = K / group;
  at::Tensor out = at::empty({n, K}, q.options().dtype(at::kFloat));
  const int64_t* id = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(0 <= id[i] && id[i] < N, "quant_rows: id ", id[i], " out of range [0, ", N, ")");
  by_layout(bits, group, grid, [&](auto b, auto g, auto c) {  // the float path's group_weights, plus mn
    constexpr int kBits = decltype(b)::value, kGroup = decltype(g)::value;
    constexpr int64_t kGroupBytes = kBits == 4 ? kGroup / 2 : kGroup;
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const uint8_t* qr = q.data_ptr<uint8_t>() + id[i] * q.size(1);
        const float* sr = scale.data_ptr<float>() + id[i] * G;
        const float* mr = mn.data_ptr<float>() + id[i] * G;
        float* o = out.data_ptr<float>() + i * K;
        for (int64_t k = 0; k < G; ++k) {
          vec16 w[2];
          group_weights<kBits, kGroup, decltype(c)::value>(qr + k * kGroupBytes, sr[k], w);
          for (int part = 0; part < kGroup / 16; ++part) {
            const vec16 v = w[part] + mr[k];
            std::memcpy(o + k * kGroup + 16 * part, &v, sizeof(v));
          }
        }
      }
    });
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

// Bytes that quant_linear reads of W (q, scale, mn and its stored tiles, or None) for a few
// bfloat16 / float16 rows: the stored tiles where it has them (the AVX-512 VNNI and AVX2 builds), else the
// row layout's q, scales and offsets.
int64_t quant_decode_bytes(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& mn, int64_t bits,
                           int64_t group, const c10::optional<at::Tensor>& tiles) {
#if defined(TANDEM_QUANT_VNNI) || defined(TANDEM_QUANT_AVX2)
  if (tiles.has_value() && tiles->numel() > 0) return tiles->numel();
#endif
  return q.numel() + (scale.numel() + mn.numel()) * scale.element_size();
}

// The path this build takes for bfloat16 / float16 rows and int8_x (int8 activations multiplied
// by "avx512_vnni", "avx_vnni" or "avx2_maddubs"; "float" without AVX2) and, after a comma, the
// widening of the float path (float32 rows without int8_x, and every row without AVX2).
std::string quant_linear_isa() {
#ifdef TANDEM_QUANT_VNNI
  std::string half = "avx512_vnni";
#elif defined(TANDEM_QUANT_AVX2)
  std::string half = TANDEM_QUANT_AVX2;
#else
  std::string half = "float";
#endif
#if defined(__AVX512F__)
  return half + ",avx512f";
#elif defined(__AVX2__)
  return half + ",avx2";
#else
  return half + ",portable";
#endif
}

}  // namespace tandem_cpu

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def(
      "quant_linear(Tensor x, Tensor q, Tensor scale, Tensor mn, int bits, int group, Tensor? bias=None, "
      "bool int8_x=False, Tensor? tiles=None) -> Tensor");
  m.impl("quant_linear", c10::DispatchKey::CPU, &tandem_cpu::quant_linear);
  m.def("quant_tiles(Tensor q, Tensor scale, Tensor mn, int bits, int group, bool narrow=True) -> Tensor");
  m.impl("quant_tiles", c10::DispatchKey::CPU, &tandem_cpu::quant_tiles);
  m.def("quant_rows(Tensor q, Tensor scale, Tensor mn, int bits, int group, Tensor ids, ScalarType dtype) -> Tensor");
  m.impl("quant_rows", c10::DispatchKey::CPU, &tandem_cpu::quant_rows);
  m.def("quant_linear_isa() -> str", &tandem_cpu::quant_linear_isa);
  m.def("quant_decode_bytes(Tensor q, Tensor scale, Tensor mn, int bits, int group, Tensor? tiles) -> int",
        &tandem_cpu::quant_decode_bytes);
}
