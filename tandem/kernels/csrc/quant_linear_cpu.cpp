// y = x @ W.T with W kept quantized: the decode-time matmul of GGUF weights on CPU.
//
// W [N, K] is in one of Tandem's two layouts (tandem/layers/quantization/gguf_repack.py),
// in which every supported GGUF block type is exact: per group of `group` columns a
// float32 scale and offset, W[n, k] = scale[n, k / group] * q[n, k] + mn[n, k / group], with
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

// NR rows of x (float32 [.., K], from `x`) times output rows [n0, n1) (+ bias[n]): y[r * N + n],
// rounded to T.
template <int BITS, int GROUP, int NR, typename T>
void quant_block(const float* x, const float* xsum, const uint8_t* q, const float* scale, const float* mn,
                 const float* bias, T* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int kParts = GROUP / 16;
  const int64_t G = K / GROUP;
  const int64_t row_bytes = BITS == 4 ? K / 2 : K;
  constexpr int64_t group_bytes = BITS == 4 ? GROUP / 2 : GROUP;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = q + n * row_bytes;
    const float* sn = scale + n * G;
    vec16 acc[NR] = {};
    for (int64_t g = 0; g < G; ++g) {
      vec16 w[kParts];
      group_weights<BITS, GROUP>(qn + g * group_bytes, sn[g], w);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const float* xg = x + r * K + g * GROUP;
#pragma GCC unroll 2
        for (int p = 0; p < kParts; ++p) acc[r] += w[p] * load16(xg + 16 * p);
      }
    }
    const float* mnn = mn + n * G;
    for (int r = 0; r < NR; ++r) {
      const float* xs = xsum + r * G;
      float offset = 0.f;
      for (int64_t g = 0; g < G; ++g) offset += mnn[g] * xs[g];
      y[r * N + n] = static_cast<T>(lane_sum(acc[r]) + offset + (bias ? bias[n] : 0.f));
    }
  }
}

// Every row of x (float32 [R, K]) times output rows [n0, n1), up to kRowBlock rows of x per
// read of the weights.
template <int BITS, int GROUP, typename T>
void quant_rows(const float* x, const float* xsum, const uint8_t* q, const float* scale, const float* mn,
                const float* bias, T* y, int64_t R, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = K / GROUP;
  for (int64_t r0 = 0; r0 < R; r0 += kRowBlock) {
    const float* xr = x + r0 * K;
    const float* xs = xsum + r0 * G;
    T* yr = y + r0 * N;
    switch (std::min<int64_t>(kRowBlock, R - r0)) {
      case 1: quant_block<BITS, GROUP, 1>(xr, xs, q, scale, mn, bias, yr, K, N, n0, n1); break;
      case 2: quant_block<BITS, GROUP, 2>(xr, xs, q, scale, mn, bias, yr, K, N, n0, n1); break;
      case 3: quant_block<BITS, GROUP, 3>(xr, xs, q, scale, mn, bias, yr, K, N, n0, n1); break;
      default: quant_block<BITS, GROUP, 4>(xr, xs, q, scale, mn, bias, yr, K, N, n0, n1); break;
    }
  }
}

// x's rows in float32, and each group's sum; then every output row, split over threads.
template <typename T>
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
  const float* sp = scale.data_ptr<float>();
  const float* mp = mn.data_ptr<float>();
  T* yp = y.data_ptr<T>();
  // Output rows per task: ~64 KB of weights, below which a second thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(bits == 4 ? K / 2 : K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (bits == 4) {
      quant_rows<4, 32>(xf.data(), xsum.data(), qp, sp, mp, bias, yp, R, K, N, n0, n1);
    } else if (group == 32) {
      quant_rows<8, 32>(xf.data(), xsum.data(), qp, sp, mp, bias, yp, R, K, N, n0, n1);
    } else {
      quant_rows<8, 16>(xf.data(), xsum.data(), qp, sp, mp, bias, yp, R, K, N, n0, n1);
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
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == G,
                "quant_linear: scale and mn must be contiguous float32 [out, in/group]");
  }
  const float* bias_p = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "quant_linear: bias must be contiguous float32 [out]");
    bias_p = bias->data_ptr<float>();
  }
  auto y = at::empty({R, N}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: quant_linear_impl<float>(x, q, scale, mn, bias_p, bits, group, y); break;
    case at::kBFloat16: quant_linear_impl<c10::BFloat16>(x, q, scale, mn, bias_p, bits, group, y); break;
    case at::kHalf: quant_linear_impl<c10::Half>(x, q, scale, mn, bias_p, bits, group, y); break;
    default: TORCH_CHECK(false, "quant_linear: unsupported dtype ", x.scalar_type());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor q, Tensor scale, Tensor mn, int bits, int group, Tensor? bias=None) -> Tensor");
  m.impl("quant_linear", c10::DispatchKey::CPU, &quant_linear);
}
