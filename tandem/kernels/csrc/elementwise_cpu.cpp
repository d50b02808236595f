// The per-layer elementwise work of a Llama-family model, one pass over memory each, on CPU:
// RMSNorm (with the residual add folded in), SiLU-and-mul and the rotary embedding; and the
// greedy pick of each row of logits (argmax).
//
// Each computes in float32 and rounds where Hugging Face's formulas round (each PyTorch op
// of theirs stores its result in the model's dtype), so that the rotary embedding equals
// theirs bit for bit and SiLU-and-mul up to exp's last bit; RMSNorm sums its squares in
// another order than PyTorch's reduction (float32 ulps). Rows (tokens, or (token, head)
// pairs) are split over PyTorch's OpenMP threads when there are enough of them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using namespace tandem_cpu;

// Up to 16 elements (the tail of a row) as a vector, zeros beyond `n`; and back.
template <typename T>
inline vec16 load_n(const T* p, int64_t n) {
  if (n == 16) return load16(p);
  T tmp[16] = {};
  std::memcpy(tmp, p, n * sizeof(T));
  return load16(tmp);
}
template <typename T>
inline void store_n(T* p, vec16 v, int64_t n) {
  if (n == 16) return store16(p, v);
  T tmp[16];
  store16(tmp, v);
  std::memcpy(p, tmp, n * sizeof(T));
}

inline float lane_sum(vec16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// The rows of a [A, B, width] tensor (2-D: B = 1) whose last axis is contiguous.
template <typename T>
struct Rows {
  T* base;
  int64_t a_stride, b_stride, b_size, count, width;

  static Rows of(const at::Tensor& x) {
    TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1,
                "expected a 2-D or 3-D tensor with a contiguous last axis");
    const bool three = x.dim() == 3;
    return {x.data_ptr<T>(), x.stride(0), three ? x.stride(1) : 0, three ? x.size(1) : 1,
            three ? x.size(0) * x.size(1) : x.size(0), x.size(-1)};
  }
  T* operator[](int64_t r) const { return base + (r / b_size) * a_stride + (r % b_size) * b_stride; }
};

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof(v)); }

// Float32 rows on an AVX2 build without AVX-512 take 8-lane loops (vec8, one register) where the
// width allows; the same operations in each lane as the vec16 loops (the same results: for
// float, round_to is no rounding, and no product below is followed by an add it could fuse with).
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool kLanes8 = true;
#else
constexpr bool kLanes8 = false;
#endif

// out = round(round(x * rsqrt(mean(x^2) + eps)) * weight), Hugging Face's LlamaRMSNorm.
template <typename T>
inline void norm_row(const T* x, const T* weight, T* out, int64_t width, float eps) {
  if constexpr (kLanes8 && std::is_same_v<T, float>) {
    if (width % 16 == 0) {  // the squares in two vec8 as in one vec16's halves, summed in its lane order
      vec8 lo{}, hi{};
      for (int64_t i = 0; i < width; i += 16) {
        const vec8 a = load8(x + i), b = load8(x + i + 8);
        lo += a * a;
        hi += b * b;
      }
      float sum = 0.f;
      for (int i = 0; i < 8; ++i) sum += lo[i];
      for (int i = 0; i < 8; ++i) sum += hi[i];
      const float r = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
      for (int64_t i = 0; i < width; i += 8) store8(out + i, load8(x + i) * r * load8(weight + i));
      return;
    }
  }
  vec16 acc{};
  for (int64_t i = 0; i < width; i += 16) {
    const vec16 v = load_n(x + i, std::min<int64_t>(16, width - i));
    acc += v * v;
  }
  const float r = 1.f / std::sqrt(lane_sum(acc) / static_cast<float>(width) + eps);
  for (int64_t i = 0; i < width; i += 16) {
    const int64_t n = std::min<int64_t>(16, width - i);
    store_n(out + i, round_to<T>(load_n(x + i, n) * r) * load_n(weight + i, n), n);
  }
}

// Rows [begin, end) of x: x += residual first where there is one (in place, x's dtype), then
// out = norm(x) (out contiguous, x's width).
template <typename T>
void norm_rows(const Rows<T>& x, const Rows<T>* residual, const T* weight, T* out, float eps, int64_t begin,
               int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    T* s = x[r];
    if (residual != nullptr) {
      const T* rr = (*residual)[r];
      int64_t i = 0;
      if constexpr (kLanes8 && std::is_same_v<T, float>)
        for (; i + 8 <= x.width; i += 8) store8(s + i, load8(s + i) + load8(rr + i));
      for (; i < x.width; i += 16) {
        const int64_t n = std::min<int64_t>(16, x.width - i);
        store_n(s + i, load_n(s + i, n) + load_n(rr + i, n), n);
      }
    }
    norm_row(s, weight, out + r * x.width, x.width, eps);
  }
}

// rms_norm (no residual) or fused_add_rms_norm of x's rows into out, split over PyTorch's
// threads, or rows [begin, end) only on the calling thread where begin >= 0.
template <typename T>
void norm_impl(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps, at::Tensor& out,
               int64_t begin = -1, int64_t end = -1) {
  const Rows<T> rows = Rows<T>::of(x);
  const Rows<T> res = residual != nullptr ? Rows<T>::of(*residual) : rows;
  const Rows<T>* added = residual != nullptr ? &res : nullptr;
  T* out_ptr = out.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  if (begin >= 0) return norm_rows(rows, added, w, out_ptr, eps, begin, end);
  at::parallel_for(0, rows.count, tandem_cpu::row_grain(rows.width),
                   [&](int64_t b, int64_t e) { norm_rows(rows, added, w, out_ptr, eps, b, e); });
}

// silu(g) = g / (1 + exp(-g)), as PyTorch's vectorized SiLU.
inline vec16 silu16(vec16 g) { return g / (1.f + exp16(-g)); }
inline vec8 silu8(vec8 g) { return g / (1.f + exp_lanes<vec8, ivec8>(-g)); }

// Rows [r0, r1) x columns [c0, c1) of silu_and_mul (out contiguous [rows, d]). Each value is
// computed alone, so any split of the rows or columns gives the same values.
template <typename T>
void silu_part(const Rows<T>& in, T* out, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  const int64_t d = in.width / 2;
  for (int64_t r = r0; r < r1; ++r) {
    const T* gate = in[r];
    const T* up = gate + d;
    int64_t i = c0;
    if constexpr (kLanes8 && std::is_same_v<T, float>)
      for (; i + 8 <= c1; i += 8) store8(out + r * d + i, silu8(load8(gate + i)) * load8(up + i));
    for (; i < c1; i += 16) {
      const int64_t n = std::min<int64_t>(16, c1 - i);
      store_n(out + r * d + i, round_to<T>(silu16(load_n(gate + i, n))) * load_n(up + i, n), n);
    }
  }
}

template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const Rows<T> in = Rows<T>::of(x);
  T* out_ptr = out.data_ptr<T>();
  at::parallel_for(0, in.count, tandem_cpu::row_grain(in.width),
                   [&](int64_t begin, int64_t end) { silu_part(in, out_ptr, begin, end, 0, in.width / 2); });
}

// Rotates the first `rot` elements of each row: with halves x1, x2 and the table's cos and
// signed sin ([-sin, sin]), x1' = round(round(x1 cos) + round(x2 -sin)) and
// x2' = round(round(x2 cos) + round(x1 sin)): `x * cos + rotate_half(x) * sin`.
template <typename T>
void rotary_impl(at::Tensor& x, const at::Tensor& cos_sin) {
  const Rows<T> rows = Rows<T>::of(x);
  const int64_t rot = cos_sin.size(2), half = rot / 2, heads = rows.b_size;
  const T* table = cos_sin.data_ptr<T>();
  at::parallel_for(0, rows.count, tandem_cpu::row_grain(rot), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = rows[r];
      const T* cos = table + (r / heads) * 2 * rot;
      const T* sin = cos + rot;
      for (int64_t i = 0; i < half; i += 16) {
        const int64_t n = std::min<int64_t>(16, half - i);
        const vec16 x1 = load_n(row + i, n), x2 = load_n(row + half + i, n);
        const vec16 a = round_to<T>(x1 * load_n(cos + i, n)) + round_to<T>(x2 * load_n(sin + i, n));
        const vec16 b = round_to<T>(x2 * load_n(cos + half + i, n)) + round_to<T>(x1 * load_n(sin + half + i, n));
        store_n(row + i, a, n);
        store_n(row + half + i, b, n);
      }
    }
  });
}

template <typename F>
void dispatch(const at::Tensor& x, const char* op, F&& f) {
  switch (x.scalar_type()) {
    case at::kFloat:
      return f(float{});
    case at::kBFloat16:
      return f(c10::BFloat16{});
    case at::kHalf:
      return f(c10::Half{});
    default:
      TORCH_CHECK(false, op, ": unsupported dtype ", x.scalar_type());
  }
}

// The index of row x[0, n)'s largest value, the first where it repeats; the first NaN where
// there is one (torch.argmax's answers). Two passes of W-lane vectors (one register: vec8 on
// AVX2 without AVX-512, else vec16): the largest (NaNs noted apart), then the first lane equal
// to it.
template <typename V, typename IV, int W>
inline int64_t argmax_lanes(const float* x, int64_t n) {
  const int64_t whole = n / W * W;
  V peak_v = V{} - INFINITY;
  IV nan_v{};
  for (int64_t i = 0; i < whole; i += W) {
    V v;
    std::memcpy(&v, x + i, sizeof(v));
    nan_v |= v != v;
    peak_v = v > peak_v ? v : peak_v;
  }
  bool nan = false;
  float peak = -INFINITY;
  for (int j = 0; j < W; ++j) {
    nan |= nan_v[j] != 0;
    peak = peak_v[j] > peak ? peak_v[j] : peak;
  }
  for (int64_t i = whole; i < n; ++i) {
    nan |= x[i] != x[i];
    peak = x[i] > peak ? x[i] : peak;
  }
  for (int64_t i = 0; i < whole; i += W) {
    V v;
    std::memcpy(&v, x + i, sizeof(v));
    const IV hit = nan ? v != v : v == peak;
    int found = 0;
    for (int j = 0; j < W; ++j) found |= hit[j];
    if (found)
      for (int j = 0; j < W; ++j)
        if (hit[j]) return i + j;
  }
  for (int64_t i = whole; i < n; ++i)
    if (nan ? x[i] != x[i] : x[i] == peak) return i;
  return 0;  // every value -inf: the first, as torch.argmax
}
inline int64_t argmax_row(const float* x, int64_t n) {
  if constexpr (kLanes8) return argmax_lanes<vec8, ivec8, 8>(x, n);
  return argmax_lanes<vec16, ivec16, 16>(x, n);
}

void check(const at::Tensor& x, const at::Tensor& other, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && other.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == other.scalar_type(), op, ": tensors must share a dtype");
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1, op,
              ": expected a 2-D or 3-D tensor with a contiguous last axis");
}

// x [rows, 2 * d] and out [rows, d] of silu_and_mul.
void check_silu(const at::Tensor& x, const at::Tensor& out) {
  check(x, x, "silu_and_mul");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: expected [rows, 2 * d]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == x.size(0) && out.size(1) == x.size(1) / 2,
              "silu_and_mul: out must be contiguous [rows, d] in x's dtype");
}

}  // namespace

namespace tandem_cpu {

// x [rows, width] or [tokens, heads, width]; weight [width], x's dtype. A new contiguous tensor.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight, "rms_norm");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1),
              "rms_norm: weight must be [width], contiguous");
  auto out = at::empty(x.sizes(), x.options());
  dispatch(x, "rms_norm", [&](auto t) { norm_impl<decltype(t)>(x, nullptr, weight, eps, out); });
  return out;
}

// x += residual in place (x's dtype), then returns rms_norm(x, weight, eps).
at::Tensor fused_add_rms_norm(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check(x, residual, "fused_add_rms_norm");
  check(residual, weight, "fused_add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes(), "fused_add_rms_norm: x and residual must have one shape");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1),
              "fused_add_rms_norm: weight must be [width], contiguous");
  auto out = at::empty(x.sizes(), x.options());
  dispatch(x, "fused_add_rms_norm", [&](auto t) { norm_impl<decltype(t)>(x, &residual, weight, eps, out); });
  return out;
}

// silu_and_mul into out [rows, d] (x's dtype, contiguous).
void silu_and_mul_into(const at::Tensor& x, at::Tensor& out) {
  check_silu(x, out);
  dispatch(x, "silu_and_mul", [&](auto t) { silu_and_mul_impl<decltype(t)>(x, out); });
}

// x [rows, 2 * d] (gate then up); returns silu(gate) * up, [rows, d], contiguous.
at::Tensor silu_and_mul(const at::Tensor& x) {
  auto out = at::empty({x.dim() == 2 ? x.size(0) : 0, x.dim() == 2 ? x.size(1) / 2 : 0}, x.options());
  silu_and_mul_into(x, out);
  return out;
}

// Rows [begin, end) of rms_norm(x) (no residual) or of fused_add_rms_norm(x, residual) into out
// (contiguous, x's shape and dtype), on the calling thread: a share of the norm for a thread of a
// team (decode_layers).
void rms_norm_rows_into(at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
                        at::Tensor& out, int64_t begin, int64_t end) {
  check(x, weight, "rms_norm");
  TORCH_CHECK(residual == nullptr || residual->sizes() == x.sizes(), "fused_add_rms_norm: x and residual must have one shape");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "rms_norm: out must be contiguous, x's shape and dtype");
  TORCH_CHECK(0 <= begin && begin <= end && end <= x.size(0) && x.dim() == 2, "rms_norm: rows out of range");
  dispatch(x, "rms_norm", [&](auto t) { norm_impl<decltype(t)>(x, residual, weight, eps, out, begin, end); });
}

// Rows [r0, r1) x columns [c0, c1) of silu_and_mul_into, on the calling thread.
void silu_and_mul_part(const at::Tensor& x, at::Tensor& out, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  check_silu(x, out);
  TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= x.size(0) && 0 <= c0 && c0 <= c1 && c1 <= out.size(1),
              "silu_and_mul: part out of range");
  dispatch(x, "silu_and_mul", [&](auto t) { silu_part<decltype(t)>(Rows<decltype(t)>::of(x), out.data_ptr<decltype(t)>(), r0, r1, c0, c1); });
}

// logits [rows, vocab] float32 with a contiguous last axis; each row's argmax (int64 [rows]), as
// torch.argmax(logits, -1) picks it (the first of equal maxima; the first NaN): one row of
// 49K logits in ~17 us with the op call, where torch's took 53-75 us (2 Zen 3 cores).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.stride(1) == 1 && logits.size(1) > 0,
              "argmax_rows: expected float32 CPU logits [rows, vocab] with a contiguous last axis");
  auto out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* ids = out.data_ptr<int64_t>();
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) ids[r] = argmax_row(x + r * logits.stride(0), logits.size(1));
  });
  return out;
}

// x [tokens, heads, head_dim] (any strides but the last), rotated in place by cos_sin
// [tokens, 2, rot] (each token's cos and signed sin, rot even and <= head_dim, x's dtype).
void rotary_embedding(at::Tensor& x, const at::Tensor& cos_sin) {
  check(x, cos_sin, "rotary_embedding");
  TORCH_CHECK(x.dim() == 3 && cos_sin.dim() == 3 && cos_sin.is_contiguous() && cos_sin.size(0) == x.size(0) &&
                  cos_sin.size(1) == 2 && cos_sin.size(2) % 2 == 0 && cos_sin.size(2) <= x.size(2),
              "rotary_embedding: expected x [tokens, heads, head_dim] and cos_sin [tokens, 2, rot], rot even");
  dispatch(x, "rotary_embedding", [&](auto t) { rotary_impl<decltype(t)>(x, cos_sin); });
}

}  // namespace tandem_cpu

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_embedding(Tensor(a!) x, Tensor cos_sin) -> ()");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, &tandem_cpu::argmax_rows);
  m.impl("rms_norm", c10::DispatchKey::CPU, &tandem_cpu::rms_norm);
  m.impl("fused_add_rms_norm", c10::DispatchKey::CPU, &tandem_cpu::fused_add_rms_norm);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &tandem_cpu::silu_and_mul);
  m.impl("rotary_embedding", c10::DispatchKey::CPU, &tandem_cpu::rotary_embedding);
}
