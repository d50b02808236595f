// The entry points of Tandem's C++ CPU kernels (each registered as torch.ops.tandem_cpu.<name>
// by its source file), declared for the kernels that call others directly (decode_layer_cpu.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <tuple>
#include <utility>

namespace tandem_cpu {

// Rows of `width` elements per parallel task: at least ~16K elements, below which a second
// thread costs more than it saves.
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// A team thread's share of one kernel's range, as taken so far: (from its front << 32) | (from
// its back); zero before the kernel. One cache line each, so that taking from one's own front
// does not contend with the others' fronts.
struct alignas(64) Taken {
  std::atomic<uint64_t> v{0};
};

// Where a kernel's range of work runs: split over PyTorch's threads by at::parallel_for (the
// default), or, for a kernel called by every thread of one OpenMP region (decode_layers: one
// region for a whole decode step instead of a fork and join per kernel), this thread's
// contiguous share of the range; with `taken` (one per thread of the team, zero) each thread
// takes its share from the front a chunk at a time and, its own done, the others' last
// chunks from their backs: a thread slowed (another process on its core, a slower stream)
// no longer keeps the others waiting at the barrier. Only for work whose every item's result
// does not depend on which thread computes it (a quantized linear's output columns).
struct Share {
  int tid = 0, threads = 1;
  bool team = false;
  Taken* taken = nullptr;

  // `unit`: the items taken together at least (where an item alone is too small to take).
  template <typename F>
  void run(int64_t n, int64_t grain, const F& f, int64_t unit = 1) const {
    if (!team) {
      at::parallel_for(0, n, grain, f);
      return;
    }
    const int64_t per = (n + threads - 1) / threads;
    auto bounds = [&](int t) {
      const int64_t begin = std::min<int64_t>(n, t * per);
      return std::pair<int64_t, int64_t>{begin, std::min<int64_t>(n, begin + per)};
    };
    const auto [begin, end] = bounds(tid);
    if (taken == nullptr) {
      if (begin < end) f(begin, end);
      return;
    }
    // own share from the front (chunks of half of what is left, at least a unit), then
    // the others' from their backs, a unit at a time
    while (take(taken[tid], begin, end, true, unit, f)) {
    }
    for (int o = 1; o < threads; ++o) {
      const int t = (tid + o) % threads;
      const auto [b, e] = bounds(t);
      while (take(taken[t], b, e, false, unit, f)) {
      }
    }
  }

 private:
  template <typename F>
  static bool take(Taken& slot, int64_t begin, int64_t end, bool front, int64_t unit, const F& f) {
    uint64_t v = slot.v.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t from_front = static_cast<int64_t>(v >> 32), from_back = static_cast<int64_t>(v & 0xffffffffu);
      const int64_t left = end - begin - from_front - from_back;
      if (left <= 0) return false;
      const int64_t count = std::min(left, front ? std::max(unit, left / 2 / unit * unit) : unit);
      const uint64_t next = front ? v + (static_cast<uint64_t>(count) << 32) : v + static_cast<uint64_t>(count);
      if (slot.v.compare_exchange_weak(v, next, std::memory_order_relaxed)) {
        if (front) {
          f(begin + from_front, begin + from_front + count);
        } else {
          f(end - from_back - count, end - from_back);
        }
        return true;
      }
    }
  }
};

// The (activations, KV pool) dtypes the attention kernels and kv_write take: one dtype, a
// bfloat16 / float16 pool beside float32 activations, or an fp8 pool (e5m2, e4m3fn) beside
// float32 or bfloat16 ones (--kv-cache-dtype).
inline bool is_fp8(at::ScalarType kv) { return kv == at::kFloat8_e5m2 || kv == at::kFloat8_e4m3fn; }
// What the kernels' checks say where kv_dtype_pairs refuses a pair.
constexpr const char* kKvDtypePairs =
    "k and v in q's dtype, or bfloat16 / float16 beside float32 q, or fp8 (e5m2, e4m3fn) beside float32 "
    "or bfloat16 q";
inline bool kv_dtype_pairs(at::ScalarType act, at::ScalarType kv) {
  const bool known = act == at::kFloat || act == at::kBFloat16 || act == at::kHalf;
  return known && (kv == act || (act == at::kFloat && (kv == at::kBFloat16 || kv == at::kHalf)) ||
                   ((act == at::kFloat || act == at::kBFloat16) && is_fp8(kv)));
}

// f(Q{}, T{}) with Q the activations' C++ type and T the pool's, for a pair kv_dtype_pairs takes.
template <typename F>
void dispatch_kv_dtypes(at::ScalarType act, at::ScalarType kv, const char* name, const F& f) {
  TORCH_CHECK(kv_dtype_pairs(act, kv), name, ": unsupported dtypes ", act, " (activations) and ", kv, " (KV)");
  if (is_fp8(kv)) {
    auto pool = [&](auto q) {
      if (kv == at::kFloat8_e5m2) return f(q, c10::Float8_e5m2{});
      return f(q, c10::Float8_e4m3fn{});
    };
    if (act == at::kBFloat16) return pool(c10::BFloat16{});
    return pool(float{});
  }
  if (act == at::kBFloat16) return f(c10::BFloat16{}, c10::BFloat16{});
  if (act == at::kHalf) return f(c10::Half{}, c10::Half{});
  if (kv == at::kBFloat16) return f(float{}, c10::BFloat16{});
  if (kv == at::kHalf) return f(float{}, c10::Half{});
  return f(float{}, float{});
}

// Rows [begin, end) of rms_norm (residual null) or fused_add_rms_norm into out, on this thread.
void rms_norm_rows_into(at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
                        at::Tensor& out, int64_t begin, int64_t end);
// Rows [r0, r1) x columns [c0, c1) of silu_and_mul, on this thread.
void silu_and_mul_part(const at::Tensor& x, at::Tensor& out, int64_t r0, int64_t r1, int64_t c0, int64_t c1);
void rotary_embedding(at::Tensor& x, const at::Tensor& cos_sin);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                            const at::Tensor& seq_lens, double scale, int64_t window = 0, double softcap = 0.0);
// decode_attention into out [bs, num_heads, head_dim] (q's dtype), the share of its tasks given.
// Where it splits the keys of few tasks (decode_attention_partial_floats > 0) every thread of a
// team must call it, with one buffer of that many floats (it waits for the others before merging).
void decode_attention_into(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                           const at::Tensor& seq_lens, double scale, int64_t window, double softcap, at::Tensor& out,
                           const Share& share, float* partial = nullptr);
int64_t decode_attention_partial_floats(int64_t bs, int64_t num_heads, const at::Tensor& k_cache,
                                        const at::Tensor& seq_lens, const Share& share);
void kv_write(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& mn,
                        int64_t bits, int64_t group, const c10::optional<at::Tensor>& bias, bool int8_x,
                        const c10::optional<at::Tensor>& tiles);
// quant_linear into y [R, N] (x's dtype), the share of its output columns given.
void quant_linear_into(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& mn,
                       int64_t bits, int64_t group, bool int8_x, const c10::optional<at::Tensor>& bias, at::Tensor& y,
                       const Share& share, const c10::optional<at::Tensor>& tiles = c10::nullopt);

}  // namespace tandem_cpu
