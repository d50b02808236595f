// The entry points of Tandem's C++ CPU kernels (each registered as torch.ops.tandem_cpu.<name>
// by its source file), declared for the kernels that call others directly (decode_layer_cpu.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

namespace tandem_cpu {

// Rows of `width` elements per parallel task: at least ~16K elements, below which a second
// thread costs more than it saves.
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// Where a kernel's range of work runs: split over PyTorch's threads by at::parallel_for (the
// default), or, for a kernel called by every thread of one OpenMP region (decode_layers: one
// region for a whole decode step instead of a fork and join per kernel), this thread's
// contiguous share of the range.
struct Share {
  int tid = 0, threads = 1;
  bool team = false;

  template <typename F>
  void run(int64_t n, int64_t grain, const F& f) const {
    if (!team) {
      at::parallel_for(0, n, grain, f);
      return;
    }
    const int64_t per = (n + threads - 1) / threads;
    const int64_t begin = std::min<int64_t>(n, tid * per), end = std::min<int64_t>(n, begin + per);
    if (begin < end) f(begin, end);
  }
};

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
