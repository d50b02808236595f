// One Llama-family decoder layer of a small decode batch, in one call: the same kernels in the
// same order as the Python layer (tandem/models/llama.py) runs them one op call each, so the
// result is the same bit for bit, without the ~50 us a layer of Python and dispatch between
// them (a 30-layer model's decode step makes ~400 such calls). Used on CPU where every linear
// layer of the decoder layer runs quantized, the pool's dtype is the model's (or a narrower pool,
// ops.h kv_dtype_pairs: kv_write rounds its rows, decode attention widens them) and the
// attention backend reads through the C++ decode kernel (`LlamaModel.forward` decides).
//
//   h = rms_norm(hidden [+= residual]); qkv = h @ Wqkv (+ b); rotate q, k; k, v into the pool;
//   o = attention(q) @ Wo; h2 = rms_norm(o += residual); out = silu_and_mul(h2 @ Wgu) @ Wdown
// Returns (out, o): the MLP output and the next residual, as LlamaDecoderLayer.forward does.
// `decode_layers` runs every layer of the model so, one after another, in one call (the
// Python loop over the layers and 30 op calls' argument handling, ~1 ms of a step, gone).
// Both run their layers in one OpenMP region (run_layers): the threads fork and join once a
// call, not once a kernel (a step of the default model: 2-3% faster at batch 1 on 2 cores).

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

#include <omp.h>

#include <atomic>
#include <exception>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

namespace {

using tandem_cpu::Share;

// A linear layer's quantized weight, [q, scale, mn], then its quant_tiles where `tiled`, then its
// bias if it has one, and its format (bits, group, int8_x, tiled: quant_linear's arguments).
struct Linear {
  at::TensorList w;
  int64_t bits = 0, group = 0;
  bool int8_x = false, tiled = false;

  int64_t out() const { return w[0].size(0); }
  void into(const at::Tensor& x, at::Tensor& y, const Share& share) const {
    const size_t b = tiled ? 4 : 3;
    const c10::optional<at::Tensor> bias = w.size() > b ? c10::optional<at::Tensor>(w[b]) : c10::nullopt;
    const c10::optional<at::Tensor> tiles = tiled ? c10::optional<at::Tensor>(w[3]) : c10::nullopt;
    tandem_cpu::quant_linear_into(x, w[0], w[1], w[2], bits, group, int8_x, bias, y, share, tiles);
  }
};

constexpr int64_t kFormat = 4;  // ints of a linear's format

struct Layer {
  at::Tensor input_norm, post_norm, k_cache, v_cache;
  Linear qkv, o, gate_up, down;
};

// What every layer of a step shares.
struct Step {
  double eps, scale;
  int64_t num_heads, num_kv_heads;
  at::Tensor cos_sin, slots, req_to_token, req_pool_indices, seq_lens;
};

Linear linear_of(at::TensorList w, const int64_t* format) {
  const bool tiled = format[3] != 0;
  TORCH_CHECK(w.size() == (tiled ? 4u : 3u) || w.size() == (tiled ? 5u : 4u),
              "decode_layer: a linear layer is [q, scale, mn], its tiles where the format says so, then its bias if any");
  TORCH_CHECK(w[0].dim() == 2, "decode_layer: a linear layer's q must be [out, in bytes]");
  return Linear{w, format[0], format[1], format[2] != 0, tiled};
}

// The first error any thread of the region met. Every thread still passes every barrier (the
// phases after a failure do nothing), so that no thread leaves the region while another waits.
struct Failure {
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex lock;

  void record() {
    std::lock_guard<std::mutex> guard(lock);
    if (!error) error = std::current_exception();
    failed = true;
  }
};

// Layers [0, L) of a decode batch in one OpenMP region: each kernel runs on every thread (its
// Share of the output columns, attention tasks or rows: the norms, rotation, KV write and SiLU),
// with a barrier after each, so the threads fork and join once per call instead of once per
// kernel; the buffers every layer writes are allocated once, before the region (the layers
// are one model's: one set of shapes), so no thread waits while another allocates. Each output
// element is computed by one thread by the same code as the separate kernel calls, so the
// result is theirs bit for bit.
std::tuple<at::Tensor, at::Tensor> run_layers(const at::Tensor& hidden, const c10::optional<at::Tensor>& residual,
                                              const std::vector<Layer>& layers, const Step& step) {
  TORCH_CHECK(!layers.empty(), "decode_layers: no layers");
  const int64_t n = hidden.size(0), width = hidden.size(1);
  const Layer& first = layers.front();
  const int64_t head_dim = first.k_cache.size(2);
  const int64_t q_size = step.num_heads * head_dim, kv_size = step.num_kv_heads * head_dim;
  for (const Layer& layer : layers)
    TORCH_CHECK(layer.k_cache.size(2) == head_dim && layer.qkv.out() == q_size + 2 * kv_size &&
                    layer.o.out() == width && layer.gate_up.out() == first.gate_up.out() && layer.down.out() == width,
                "decode_layers: the layers' shapes differ (or do not match the heads and the hidden size)");
  Failure failure;
  const auto opts = hidden.options();
  // h: the normed input; o: the attention's projection, then the residual stream after it;
  // out: the MLP's output, then (the next layer's norm adds the residual to it in place) the
  // residual stream before the next attention. Each is read by the layer's later phases only.
  at::Tensor h = at::empty({n, width}, opts), qkv = at::empty({n, q_size + 2 * kv_size}, opts),
             attn = at::empty({n, step.num_heads, head_dim}, opts), o = at::empty({n, width}, opts),
             h2 = at::empty({n, width}, opts), gu = at::empty({n, first.gate_up.out()}, opts),
             act = at::empty({n, first.gate_up.out() / 2}, opts), out = at::empty({n, width}, opts);
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({n, step.num_heads, head_dim});
  const int threads = static_cast<int>(std::max<int64_t>(1, at::get_num_threads()));
  // Room for decode attention's split keys, the same for every layer (one pool shape, one
  // batch).
  const at::Tensor partial = at::empty(
      {tandem_cpu::decode_attention_partial_floats(n, step.num_heads, first.k_cache, step.seq_lens,
                                                   Share{0, threads, threads > 1})},
      opts.dtype(at::kFloat));
  // The linears' shares as taken (Share::taken): per layer and linear, one slot per thread.
  std::unique_ptr<tandem_cpu::Taken[]> taken(new tandem_cpu::Taken[layers.size() * 4 * threads]);
  // Every layer's phases: phase(work) runs work on this thread, then waits for the others.
  auto each_layer = [&](const Share& share, auto&& phase) {
    // This thread's rows (the row-wise phases), and with fewer rows than threads its columns
    // of the SiLU; their views, made once.
    int64_t r0 = 0, r1 = 0, c0 = 0, c1 = 0;
    const int64_t d = act.size(1);
    share.run(n, 1, [&](int64_t b, int64_t e) { r0 = b, r1 = e; });
    if (n >= share.threads) {
      c1 = d;
    } else {
      r0 = 0, r1 = n;
      share.run(d, 1, [&](int64_t b, int64_t e) { c0 = b, c1 = e; });
    }
    const int64_t rows = std::max<int64_t>(r1 - r0, 0);
    at::Tensor mine = qkv.narrow(0, r0, rows);
    at::Tensor qk = mine.narrow(1, 0, q_size + kv_size).view({rows, step.num_heads + step.num_kv_heads, head_dim});
    at::Tensor k_new = qk.narrow(1, step.num_heads, step.num_kv_heads);
    const at::Tensor v_new = mine.narrow(1, q_size + kv_size, kv_size).view({rows, step.num_kv_heads, head_dim});
    const at::Tensor cos_sin = step.cos_sin.narrow(0, r0, rows), slots = step.slots.narrow(0, r0, rows);
    const bool norm_rows = n >= share.threads ? rows > 0 : share.tid == 0;
    for (size_t l = 0; l < layers.size(); ++l) {
      const Layer& layer = layers[l];
      auto linear = [&](int i) {
        Share s = share;
        if (share.team) s.taken = taken.get() + (4 * l + i) * share.threads;
        return s;
      };
      // The layer's input (the first: the caller's, which receives hidden + residual in place
      // as the fused norm does) and the residual added to it.
      at::Tensor x = l == 0 ? hidden : out;
      const at::Tensor* res = l == 0 ? (residual.has_value() ? &*residual : nullptr) : &o;
      phase([&] {
        if (norm_rows) tandem_cpu::rms_norm_rows_into(x, res, layer.input_norm, step.eps, h, r0, r1);
      });
      phase([&] { layer.qkv.into(h, qkv, linear(0)); });
      phase([&] {  // each thread rotates and writes its share of the rows
        if (!norm_rows || rows == 0) return;
        tandem_cpu::rotary_embedding(qk, cos_sin);
        at::Tensor k_cache = layer.k_cache, v_cache = layer.v_cache;
        tandem_cpu::kv_write(k_cache, v_cache, slots, k_new, v_new);
      });
      phase([&] {
        TORCH_CHECK(partial.numel() == tandem_cpu::decode_attention_partial_floats(n, step.num_heads, layer.k_cache,
                                                                                    step.seq_lens, share),
                    "decode_layer: the region has other threads than asked for");
        tandem_cpu::decode_attention_into(q, layer.k_cache, layer.v_cache, step.req_to_token, step.req_pool_indices,
                                          step.seq_lens, step.scale, 0, 0.0, attn, share,
                                          partial.numel() > 0 ? partial.data_ptr<float>() : nullptr);
      });
      phase([&] { layer.o.into(attn.view({n, q_size}), o, linear(1)); });
      phase([&] {
        if (norm_rows) tandem_cpu::rms_norm_rows_into(o, &x, layer.post_norm, step.eps, h2, r0, r1);
      });
      phase([&] { layer.gate_up.into(h2, gu, linear(2)); });
      phase([&] {
        if (rows > 0 && c1 > c0) tandem_cpu::silu_and_mul_part(gu, act, r0, r1, c0, c1);
      });
      phase([&] { layer.down.into(act, out, linear(3)); });
    }
  };
  if (threads == 1) {  // no region
    each_layer(Share{0, 1, true}, [](auto&& fn) { fn(); });
  } else {
#pragma omp parallel num_threads(threads)
    {
      const Share share{omp_get_thread_num(), omp_get_num_threads(), true};
      // fn, then a barrier; nothing once any thread failed (a failure is seen by all after the
      // barrier that follows it).
      each_layer(share, [&](auto&& fn) {
        if (!failure.failed) {
          try {
            fn();
          } catch (...) {
            failure.record();
          }
        }
#pragma omp barrier
      });
    }
  }
  if (failure.error) std::rethrow_exception(failure.error);
  return {out, o};
}

}  // namespace

namespace tandem_cpu {

// hidden [bs, hidden] (this layer's input; with a residual it receives hidden + residual in
// place, as the fused norm does); formats: (bits, group, int8_x, tiled) of qkv, o, gate_up, down.
std::tuple<at::Tensor, at::Tensor> decode_layer(at::Tensor& hidden, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
                                                at::TensorList qkv_w, at::TensorList o_w, at::TensorList gate_up_w,
                                                at::TensorList down_w, at::IntArrayRef formats, const at::Tensor& cos_sin,
                                                at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                                                const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                                                const at::Tensor& seq_lens, double scale, int64_t num_heads,
                                                int64_t num_kv_heads) {
  TORCH_CHECK(formats.size() == 4 * kFormat, "decode_layer: formats are (bits, group, int8_x, tiled) of qkv, o, gate_up and down");
  TORCH_CHECK(hidden.dim() == 2, "decode_layer: hidden must be [batch, hidden]");
  const int64_t* f = formats.data();
  const std::vector<Layer> layers{{input_norm, post_norm, k_cache, v_cache, linear_of(qkv_w, f), linear_of(o_w, f + kFormat),
                                   linear_of(gate_up_w, f + 2 * kFormat), linear_of(down_w, f + 3 * kFormat)}};
  const Step step{eps, scale, num_heads, num_kv_heads, cos_sin, slots, req_to_token, req_pool_indices.contiguous(),
                  seq_lens.contiguous()};
  return run_layers(hidden, residual, layers, step);
}

// Every decoder layer of a decode batch: decode_layer for layer l = 0 .. L - 1, each taking the
// previous one's (out, o) as its (hidden, residual) (the first: hidden, no residual), so the
// result is the per-layer calls' bit for bit. weights: per layer its input and post-attention
// norms, then the tensors of its qkv, o, gate_up and down linears; layout: per layer 20 ints,
// the four linears' tensor counts (3, +1 with tiles, +1 with a bias) and their formats (4 ints each); k_caches /
// v_caches: the pool's buffer of each layer. Returns the last layer's (out, o).
std::tuple<at::Tensor, at::Tensor> decode_layers(const at::Tensor& hidden, at::TensorList weights,
                                                 at::IntArrayRef layout, double eps, const at::Tensor& cos_sin,
                                                 at::TensorList k_caches, at::TensorList v_caches,
                                                 const at::Tensor& slots, const at::Tensor& req_to_token,
                                                 const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                                                 double scale, int64_t num_heads, int64_t num_kv_heads) {
  constexpr int64_t kPerLayer = 4 + 4 * kFormat;
  TORCH_CHECK(layout.size() % kPerLayer == 0, "decode_layers: layout holds 20 ints a layer");
  TORCH_CHECK(hidden.dim() == 2, "decode_layer: hidden must be [batch, hidden]");
  const int64_t count = static_cast<int64_t>(layout.size()) / kPerLayer;
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == count && static_cast<int64_t>(v_caches.size()) == count,
              "decode_layers: one k and one v buffer a layer");
  std::vector<Layer> layers;
  size_t at = 0;
  for (int64_t l = 0; l < count; ++l) {
    const int64_t* lay = layout.data() + l * kPerLayer;
    int64_t tensors = 2;
    for (int i = 0; i < 4; ++i) tensors += lay[i];
    TORCH_CHECK(at + tensors <= weights.size(), "decode_layers: fewer weights than the layout says");
    at::TensorList w = weights.slice(at, tensors);
    Linear linears[4];
    size_t next = 2;
    for (int i = 0; i < 4; ++i) {
      linears[i] = linear_of(w.slice(next, lay[i]), lay + 4 + kFormat * i);
      next += lay[i];
    }
    layers.push_back({w[0], w[1], k_caches[l], v_caches[l], linears[0], linears[1], linears[2], linears[3]});
    at += tensors;
  }
  TORCH_CHECK(at == weights.size(), "decode_layers: more weights than the layout says");
  TORCH_CHECK(!layers.empty(), "decode_layers: no layers");
  const Step step{eps, scale, num_heads, num_kv_heads, cos_sin, slots, req_to_token, req_pool_indices.contiguous(),
                  seq_lens.contiguous()};
  return run_layers(hidden, c10::nullopt, layers, step);
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
