// The entry points of Tandem's C++ CPU kernels (each registered as torch.ops.tandem_cpu.<name>
// by its source file), declared for the kernels that call others directly (decode_layer_cpu.cpp).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace tandem_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor fused_add_rms_norm(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
void rotary_embedding(at::Tensor& x, const at::Tensor& cos_sin);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                            const at::Tensor& seq_lens, double scale, int64_t window = 0, double softcap = 0.0);
void kv_write(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& mn,
                        int64_t bits, int64_t group, const c10::optional<at::Tensor>& bias);

}  // namespace tandem_cpu
