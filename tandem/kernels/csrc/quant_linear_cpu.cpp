// y = x @ W.T with W kept quantized: the decode-time matmul of GGUF weights on CPU.
//
// W [N, K] is in one of Tandem's two layouts (tandem/layers/quantization/gguf_repack.py),
// in which every supported GGUF block type is exact: per group of `group` columns a
// scale and offset (float32, or float16 where that holds them exactly: 2 bytes fewer a
// group, for the types whose scales are float16 in the file), W[n, k] = scale[n, k / group] * q[n, k] + mn[n, k / group], with
//   bits 4 (group 32): q packed two to a byte, ggml's Q4 order: byte 16g + j of a row holds
//                      column 32g + j in its low nibble and column 32g + 16 + j in its high;
//   bits 8 (group 16 or 32): one uint8 q per column.
// Two paths, chosen when the library is built for the machine (-march=native):
// - float32 rows (and every row where the CPU lacks AVX-512 VNNI) are multiplied in float32:
//   y[r, n] = sum_g (sum_k (scale * q) * x[r, k]) + sum_g mn * (sum_k x[r, k]), the products
//   scale * q rounded as a dequantized weight is, so a result differs from
//   dequantize-then-matmul only by the summation order (widening by AVX-512F, AVX2 or plain
//   loops);
// - bfloat16 / float16 rows with AVX-512 VNNI: x quantized per 32 columns to int8 and integer
//   dot products (llama.cpp's recipe; the VNNI section below says what it computes).
// Output rows (N) are split over PyTorch's OpenMP threads; a step reads each weight byte once
// for up to four rows of x at a time. `quant_linear_isa()` names the paths of this build.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cstdint>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstring>
#include <string>
#include <vector>

namespace {

using namespace tandem_cpu;

typedef uint8_t u8x16 __attribute__((vector_size(16)));

constexpr int kRowBlock = 4;  // rows of x sharing one read of a weight row

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

// The 16-column slices of one weight group, scaled: `parts` vectors (2 for 32 columns, 1 for 16).
template <int BITS, int GROUP>
inline void group_weights(const uint8_t* q, float scale, vec16* w) {
  if constexpr (BITS == 4) {
    const u8x16 b = load_bytes(q);
    w[0] = bytes_to_floats(b & 15) * scale;
    w[1] = bytes_to_floats(b >> 4) * scale;
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
template <int BITS, int GROUP, int NR, typename T, typename S>
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
      group_weights<BITS, GROUP>(qn + g * group_bytes, to_float(sn[g]), w);
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
template <int BITS, int GROUP, typename T, typename S>
void quant_rows(const float* x, const float* xsum, const uint8_t* q, const S* scale, const S* mn,
                const float* bias, T* y, int64_t R, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = K / GROUP;
  for (int64_t r0 = 0; r0 < R; r0 += kRowBlock) {
    const float* xr = x + r0 * K;
    const float* xs = xsum + r0 * G;
    T* yr = y + r0 * N;
    switch (std::min<int64_t>(kRowBlock, R - r0)) {
      case 1: quant_block<BITS, GROUP, 1, T, S>(xr, xs, q, scale, mn, bias, yr, K, N, n0, n1); break;
      case 2: quant_block<BITS, GROUP, 2, T, S>(xr, xs, q, scale, mn, bias, yr, K, N, n0, n1); break;
      case 3: quant_block<BITS, GROUP, 3, T, S>(xr, xs, q, scale, mn, bias, yr, K, N, n0, n1); break;
      default: quant_block<BITS, GROUP, 4, T, S>(xr, xs, q, scale, mn, bias, yr, K, N, n0, n1); break;
    }
  }
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
    const T* row = x + r * stride;
    std::fill(qx.begin(), qx.end(), 0);
    std::fill(dblock.begin(), dblock.end(), 0.f);
    for (int64_t b = 0; 32 * b < K; ++b) {
      const int parts = K - 32 * b >= 32 ? 2 : 1;  // K is a multiple of 16
      __m512 v[2];
      for (int p = 0; p < 2; ++p) {
        const vec16 f = p < parts ? load16(row + 32 * b + 16 * p) : vec16{};
        std::memcpy(&v[p], &f, sizeof(f));
      }
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
      const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
      for (int p = 0; p < parts; ++p) {
        const __m128i q8 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v[p], _mm512_set1_ps(id))));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qx.data() + 32 * b + 16 * p), q8);
      }
      dblock[b] = d;
    }
    for (int64_t g = 0; g < X.G; ++g) {
      int sum = 0;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) sum += qx[k];
      X.gsum[r * X.G + g] = dblock[g * group / 32] * static_cast<float>(sum);
    }
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

// sum_g mn[g] * gsum[g]
template <typename S>
inline float offsets(const S* mn, const float* gsum, int64_t G) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 m = G - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (G - g)) - 1);
    acc = _mm512_fmadd_ps(load16_masked(mn + g, m), _mm512_maskz_loadu_ps(m, gsum + g), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// Rows [r0, r0 + NR) of the quantized x times weight rows [n0, n1): y[r * N + n].
template <int BITS, int GROUP, int NR, typename T, typename S>
void vnni_block(const QuantizedX& X, int64_t r0, const uint8_t* q, const S* scale, const S* mn, const float* bias,
                T* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int kGroupsPerChunk = BITS == 4 ? 4 : kChunk / GROUP;
  const int64_t row_bytes = BITS == 4 ? K / 2 : K, G = X.G, chunks = X.chunks;
  const int64_t tail = row_bytes - (chunks - 1) * kChunk;  // bytes in the last chunk, 1..64
  const __mmask64 tail_mask = tail == kChunk ? ~0ull : (1ull << tail) - 1;
  const int tail_groups = static_cast<int>(G - (chunks - 1) * kGroupsPerChunk);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = q + n * row_bytes;
    const S* sn = scale + n * G;
    __m512 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < chunks; ++i) {
      const bool last = i == chunks - 1;
      const __m512i w = _mm512_maskz_loadu_epi8(last ? tail_mask : ~0ull, qn + kChunk * i);
      const __m512 ws = lane_scales<16 / kGroupsPerChunk>(sn + kGroupsPerChunk * i, last ? tail_groups : kGroupsPerChunk);
      const __m512i lo = BITS == 4 ? _mm512_and_si512(w, low4) : w;
      const __m512i hi = BITS == 4 ? _mm512_and_si512(_mm512_srli_epi16(w, 4), low4) : w;
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const int64_t at = (r0 + r) * chunks + i;
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(X.lo.data() + at * kChunk));
        if constexpr (BITS == 4) s = _mm512_dpbusd_epi32(s, hi, _mm512_loadu_si512(X.hi.data() + at * kChunk));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(ws, _mm512_loadu_ps(X.d.data() + at * 16)), acc[r]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const float off = offsets(mn + n * G, X.gsum.data() + (r0 + r) * G, G);
      y[(r0 + r) * N + n] = static_cast<T>(_mm512_reduce_add_ps(acc[r]) + off + (bias ? bias[n] : 0.f));
    }
  }
}

template <int BITS, int GROUP, typename T, typename S>
void vnni_rows(const QuantizedX& X, int64_t R, const uint8_t* q, const S* scale, const S* mn, const float* bias,
               T* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t r0 = 0; r0 < R; r0 += kRowBlock) {
    switch (std::min<int64_t>(kRowBlock, R - r0)) {
      case 1: vnni_block<BITS, GROUP, 1, T, S>(X, r0, q, scale, mn, bias, y, K, N, n0, n1); break;
      case 2: vnni_block<BITS, GROUP, 2, T, S>(X, r0, q, scale, mn, bias, y, K, N, n0, n1); break;
      case 3: vnni_block<BITS, GROUP, 3, T, S>(X, r0, q, scale, mn, bias, y, K, N, n0, n1); break;
      default: vnni_block<BITS, GROUP, 4, T, S>(X, r0, q, scale, mn, bias, y, K, N, n0, n1); break;
    }
  }
}
#define TANDEM_QUANT_VNNI 1
#endif

// bfloat16 / float16 rows through the VNNI path where the CPU has it; otherwise (and for float32
// rows, whose results equal dequantize-then-matmul) x's rows in float32 and each group's sum;
// then every output row, split over threads.
template <typename T, typename S>
void quant_linear_impl(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& mn,
                       const float* bias, int64_t bits, int64_t group, at::Tensor& y) {
  const int64_t R = x.size(0), K = x.size(1), N = q.size(0), G = K / group;
  const T* xp = x.data_ptr<T>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const S* sp = scale.data_ptr<S>();
  const S* mp = mn.data_ptr<S>();
  T* yp = y.data_ptr<T>();
  // Output rows per task: ~64 KB of weights, below which a second thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(bits == 4 ? K / 2 : K, 1));
#ifdef TANDEM_QUANT_VNNI
  if constexpr (!std::is_same_v<T, float>) {
    const QuantizedX X = quantize_x(xp, x.stride(0), R, K, bits, group);
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      if (bits == 4) {
        vnni_rows<4, 32, T, S>(X, R, qp, sp, mp, bias, yp, K, N, n0, n1);
      } else if (group == 32) {
        vnni_rows<8, 32, T, S>(X, R, qp, sp, mp, bias, yp, K, N, n0, n1);
      } else {
        vnni_rows<8, 16, T, S>(X, R, qp, sp, mp, bias, yp, K, N, n0, n1);
      }
    });
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
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (bits == 4) {
      quant_rows<4, 32, T, S>(xf.data(), xsum.data(), qp, sp, mp, bias, yp, R, K, N, n0, n1);
    } else if (group == 32) {
      quant_rows<8, 32, T, S>(xf.data(), xsum.data(), qp, sp, mp, bias, yp, R, K, N, n0, n1);
    } else {
      quant_rows<8, 16, T, S>(xf.data(), xsum.data(), qp, sp, mp, bias, yp, R, K, N, n0, n1);
    }
  });
}

}  // namespace

namespace tandem_cpu {

// x [R, K] (float32, bfloat16 or float16; rows contiguous); q uint8 [N, K/2] (bits 4) or
// [N, K] (bits 8); scale, mn float32 [N, K/group]; bias float32 [N] or None. Returns
// y [R, N] in x's dtype (the float32 sum rounded once).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& mn,
                        int64_t bits, int64_t group, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu(), "quant_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "quant_linear: x must be [rows, in] with contiguous rows");
  TORCH_CHECK((bits == 4 && group == 32) || (bits == 8 && (group == 16 || group == 32)),
              "quant_linear: layouts are bits 4 group 32, bits 8 group 16 or 32");
  const int64_t R = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(K % group == 0, "quant_linear: in (", K, ") must be a multiple of the group (", group, ")");
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 2 && q.size(1) == (bits == 4 ? K / 2 : K),
              "quant_linear: q must be contiguous uint8 [out, in", bits == 4 ? "/2" : "", "]");
  const int64_t G = K / group;
  for (const at::Tensor* t : {&scale, &mn}) {
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kHalf) &&
                    t->scalar_type() == scale.scalar_type() && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == N && t->size(1) == G,
                "quant_linear: scale and mn must be contiguous float32 or float16 (both one dtype) [out, in/group]");
  }
  const float* bias_p = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "quant_linear: bias must be contiguous float32 [out]");
    bias_p = bias->data_ptr<float>();
  }
  auto y = at::empty({R, N}, x.options());
  const bool half_scales = scale.scalar_type() == at::kHalf;
  auto run = [&](auto t) {
    using T = decltype(t);
    if (half_scales) {
      quant_linear_impl<T, c10::Half>(x, q, scale, mn, bias_p, bits, group, y);
    } else {
      quant_linear_impl<T, float>(x, q, scale, mn, bias_p, bits, group, y);
    }
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "quant_linear: unsupported dtype ", x.scalar_type());
  }
  return y;
}

// The path this build takes for bfloat16 / float16 rows ("avx512_vnni": int8 activations) and,
// after a comma, the widening of the float path (float32 rows, and the others without VNNI).
std::string quant_linear_isa() {
#ifdef TANDEM_QUANT_VNNI
  std::string half = "avx512_vnni";
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
  m.def("quant_linear(Tensor x, Tensor q, Tensor scale, Tensor mn, int bits, int group, Tensor? bias=None) -> Tensor");
  m.impl("quant_linear", c10::DispatchKey::CPU, &tandem_cpu::quant_linear);
  m.def("quant_linear_isa() -> str", &tandem_cpu::quant_linear_isa);
}
