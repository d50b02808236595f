// One Llama-family decoder layer of a small decode batch, in one call: the same kernels in the
// same order as the Python layer (tandem/models/llama.py) runs them one op call each, so the
// result is the same bit for bit, without the ~50 us a layer of Python and dispatch between
// them (a 30-layer model's decode step makes ~400 such calls). Used on CPU where every linear
// layer of the decoder layer runs quantized, the pool's dtype is the model's and the attention
// backend reads through the C++ decode kernel (`LlamaModel.forward` decides).
//
//   h = rms_norm(hidden [+= residual]); qkv = h @ Wqkv (+ b); rotate q, k; k, v into the pool;
//   o = attention(q) @ Wo; h2 = rms_norm(o += residual); out = silu_and_mul(h2 @ Wgu) @ Wdown
// Returns (out, o): the MLP output and the next residual, as LlamaDecoderLayer.forward does.
// `decode_layers` runs every layer of the model so, one after another, in one call (the
// Python loop over the layers and 30 op calls' argument handling, ~1 ms of a step, gone).

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

#include <tuple>

namespace {

// A linear layer's quantized weight: [q, scale, mn] or [q, scale, mn, bias].
at::Tensor linear(const at::Tensor& x, at::TensorList w, int64_t bits, int64_t group) {
  TORCH_CHECK(w.size() == 3 || w.size() == 4, "decode_layer: a linear layer is [q, scale, mn] or [q, scale, mn, bias]");
  const c10::optional<at::Tensor> bias = w.size() == 4 ? c10::optional<at::Tensor>(w[3]) : c10::nullopt;
  return tandem_cpu::quant_linear(x, w[0], w[1], w[2], bits, group, bias);
}

}  // namespace

namespace tandem_cpu {

// hidden [bs, hidden] (this layer's input; with a residual it receives hidden + residual in
// place, as the fused norm does); formats: (bits, group) of qkv, o, gate_up, down.
std::tuple<at::Tensor, at::Tensor> decode_layer(at::Tensor& hidden, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
                                                at::TensorList qkv_w, at::TensorList o_w, at::TensorList gate_up_w,
                                                at::TensorList down_w, at::IntArrayRef formats, const at::Tensor& cos_sin,
                                                at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                                                const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                                                const at::Tensor& seq_lens, double scale, int64_t num_heads,
                                                int64_t num_kv_heads) {
  TORCH_CHECK(formats.size() == 8, "decode_layer: formats are (bits, group) of qkv, o, gate_up and down");
  TORCH_CHECK(hidden.dim() == 2, "decode_layer: hidden must be [batch, hidden]");
  const at::Tensor h = residual.has_value() ? fused_add_rms_norm(hidden, *residual, input_norm, eps)
                                            : rms_norm(hidden, input_norm, eps);
  const at::Tensor qkv = linear(h, qkv_w, formats[0], formats[1]);
  const int64_t n = qkv.size(0), head_dim = k_cache.size(2);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "decode_layer: the QKV output does not match the heads");
  at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({n, num_heads + num_kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads, head_dim});
  rotary_embedding(qk, cos_sin);
  kv_write(k_cache, v_cache, slots, qk.narrow(1, num_heads, num_kv_heads), v);
  const at::Tensor attn = decode_attention(qk.narrow(1, 0, num_heads), k_cache, v_cache, req_to_token,
                                           req_pool_indices, seq_lens, scale);
  at::Tensor o = linear(attn, o_w, formats[2], formats[3]);
  const at::Tensor h2 = fused_add_rms_norm(o, hidden, post_norm, eps);
  const at::Tensor out = linear(silu_and_mul(linear(h2, gate_up_w, formats[4], formats[5])), down_w, formats[6], formats[7]);
  return {out, o};
}

// Every decoder layer of a decode batch: decode_layer for layer l = 0 .. L - 1, each taking the
// previous one's (out, o) as its (hidden, residual) (the first: hidden, no residual), so the
// result is the per-layer calls' bit for bit. weights: per layer its input and post-attention
// norms, then the tensors of its qkv, o, gate_up and down linears; layout: per layer 12 ints,
// the four linears' tensor counts (3, or 4 with a bias) and their 8 formats; k_caches /
// v_caches: the pool's buffer of each layer. Returns the last layer's (out, o).
std::tuple<at::Tensor, at::Tensor> decode_layers(const at::Tensor& hidden, at::TensorList weights,
                                                 at::IntArrayRef layout, double eps, const at::Tensor& cos_sin,
                                                 at::TensorList k_caches, at::TensorList v_caches,
                                                 const at::Tensor& slots, const at::Tensor& req_to_token,
                                                 const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                                                 double scale, int64_t num_heads, int64_t num_kv_heads) {
  constexpr int64_t kPerLayer = 12;
  TORCH_CHECK(layout.size() % kPerLayer == 0, "decode_layers: layout holds 12 ints a layer");
  const int64_t layers = static_cast<int64_t>(layout.size()) / kPerLayer;
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == layers && static_cast<int64_t>(v_caches.size()) == layers,
              "decode_layers: one k and one v buffer a layer");
  at::Tensor h = hidden;
  c10::optional<at::Tensor> residual;
  size_t at = 0;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t* lay = layout.data() + l * kPerLayer;
    int64_t count = 2;
    for (int i = 0; i < 4; ++i) count += lay[i];
    TORCH_CHECK(at + count <= weights.size(), "decode_layers: fewer weights than the layout says");
    at::TensorList w = weights.slice(at, count);
    size_t next = 2;
    at::TensorList linears[4];
    for (int i = 0; i < 4; ++i) {
      linears[i] = w.slice(next, lay[i]);
      next += lay[i];
    }
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    auto [out, o] = decode_layer(h, residual, w[0], w[1], eps, linears[0], linears[1], linears[2], linears[3],
                                 at::IntArrayRef(lay + 4, 8), cos_sin, k_cache, v_cache, slots, req_to_token,
                                 req_pool_indices, seq_lens, scale, num_heads, num_kv_heads);
    h = out;
    residual = o;
    at += count;
  }
  TORCH_CHECK(at == weights.size(), "decode_layers: more weights than the layout says");
  TORCH_CHECK(residual.has_value(), "decode_layers: no layers");
  return {h, *residual};
}

}  // namespace tandem_cpu

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("decode_layer(Tensor(a!) hidden, Tensor? residual, Tensor input_norm, Tensor post_norm, float eps, "
        "Tensor[] qkv, Tensor[] o, Tensor[] gate_up, Tensor[] down, int[] formats, Tensor cos_sin, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, Tensor req_to_token, Tensor req_pool_indices, "
        "Tensor seq_lens, float scale, int num_heads, int num_kv_heads) -> (Tensor, Tensor)");
  m.impl("decode_layer", c10::DispatchKey::CPU, &tandem_cpu::decode_layer);
  m.def("decode_layers(Tensor hidden, Tensor[] weights, int[] layout, float eps, Tensor cos_sin, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, Tensor req_to_token, Tensor req_pool_indices, "
        "Tensor seq_lens, float scale, int num_heads, int num_kv_heads) -> (Tensor, Tensor)");
  m.impl("decode_layers", c10::DispatchKey::CPU, &tandem_cpu::decode_layers);
}
