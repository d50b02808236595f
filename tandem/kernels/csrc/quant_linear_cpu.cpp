// y = x @ W.T with W kept quantized: the decode-time matmul of GGUF weights on CPU.
//
// W [N, K] is in one of Tandem's two layouts (tandem/layers/quantization/gguf_repack.py),
// in which every supported GGUF block type is exact: per group of `group` columns a
// scale and offset (float32, or float16 where that holds them exactly: 2 bytes fewer a
// group, for the types whose scales are float16 in the file), W[n, k] = scale[n, k / group] * q[n, k] + mn[n, k / group], with
//   bits 4 (group 32): q packed two to a byte, ggml's Q4 order: byte 16g + j of a row holds
//                      column 32g + j in its low nibble and column 32g + 16 + j in its high;
//   bits 8 (group 16 or 32): one uint8 q per column.
// Each row of x is multiplied in float32: y[r, n] = sum_g (sum_k (scale * q) * x[r, k])
// + sum_g mn * (sum_k x[r, k]), the products scale * q rounded as a dequantized weight is,
// so a result differs from dequantize-then-matmul only by the summation order. Output rows
// (N) are split over PyTorch's OpenMP threads; a step reads each weight byte once for up to
// four rows of x at a time.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cstdint>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstring>
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

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The 4-bit layout times bfloat16 rows with AVX-512 BF16's dot product (32 products a
// step): a group's 32 values (0..15) become exact bfloat16 by a table lookup, and the
// products of two bfloat16 are exact in float32, so this sums the same terms as the
// float32 path (x is bfloat16 already), in another order.
template <int NR, typename S>
void quant4_bf16_block(const uint16_t* xb, const float* xsum, const uint8_t* q, const S* scale, const S* mn,
                       const float* bias, c10::BFloat16* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = K / 32;
  // bfloat16 bit patterns of 0..15 (and 16 unused entries).
  const __m512i table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
                                         0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = q + n * (K / 2);
    const S* sn = scale + n * G;
    __m512 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + 16 * g));
      const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
      const __m512i words = _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo));  // columns 32g .. 32g + 31
      const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(words, table);
      const __m512 s = _mm512_set1_ps(to_float(sn[g]));
      for (int r = 0; r < NR; ++r) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + r * K + 32 * g);
        acc[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w, xv), s, acc[r]);
      }
    }
    const S* mnn = mn + n * G;
    for (int r = 0; r < NR; ++r) {
      const float* xs = xsum + r * G;
      float offset = 0.f;
      for (int64_t g = 0; g < G; ++g) offset += to_float(mnn[g]) * xs[g];
      y[r * N + n] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(acc[r]) + offset + (bias ? bias[n] : 0.f));
    }
  }
}

template <typename S>
void quant4_bf16_rows(const uint16_t* xb, const float* xsum, const uint8_t* q, const S* scale, const S* mn,
                      const float* bias, c10::BFloat16* y, int64_t R, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = K / 32;
  for (int64_t r0 = 0; r0 < R; r0 += kRowBlock) {
    const uint16_t* xr = xb + r0 * K;
    const float* xs = xsum + r0 * G;
    c10::BFloat16* yr = y + r0 * N;
    switch (std::min<int64_t>(kRowBlock, R - r0)) {
      case 1: quant4_bf16_block<1, S>(xr, xs, q, scale, mn, bias, yr, K, N, n0, n1); break;
      case 2: quant4_bf16_block<2, S>(xr, xs, q, scale, mn, bias, yr, K, N, n0, n1); break;
      case 3: quant4_bf16_block<3, S>(xr, xs, q, scale, mn, bias, yr, K, N, n0, n1); break;
      default: quant4_bf16_block<4, S>(xr, xs, q, scale, mn, bias, yr, K, N, n0, n1); break;
    }
  }
}
#define TANDEM_QUANT4_BF16_DOT 1
#endif

// x's rows in float32, and each group's sum; then every output row, split over threads.
template <typename T, typename S>
void quant_linear_impl(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& mn,
                       const float* bias, int64_t bits, int64_t group, at::Tensor& y) {
  const int64_t R = x.size(0), K = x.size(1), N = q.size(0), G = K / group;
  std::vector<float> xf(R * K), xsum(R * G);
  const T* xp = x.data_ptr<T>();
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
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const S* sp = scale.data_ptr<S>();
  const S* mp = mn.data_ptr<S>();
  T* yp = y.data_ptr<T>();
  // Output rows per task: ~64 KB of weights, below which a second thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(bits == 4 ? K / 2 : K, 1));
#ifdef TANDEM_QUANT4_BF16_DOT
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (bits == 4) {
      std::vector<uint16_t> xb(R * K);  // x's rows, contiguous
      for (int64_t r = 0; r < R; ++r) std::memcpy(xb.data() + r * K, xp + r * x.stride(0), K * sizeof(uint16_t));
      at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
        quant4_bf16_rows<S>(xb.data(), xsum.data(), qp, sp, mp, bias, yp, R, K, N, n0, n1);
      });
      return;
    }
  }
#endif
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor q, Tensor scale, Tensor mn, int bits, int group, Tensor? bias=None) -> Tensor");
  m.impl("quant_linear", c10::DispatchKey::CPU, &quant_linear);
}
