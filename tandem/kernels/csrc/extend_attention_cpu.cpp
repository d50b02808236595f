// Prefill (extend) attention per request, reading the paged KV pool in place, on CPU.
//
// Query i of a request with a cached prefix of P tokens sits at position P + i and sees the
// keys at positions 0 .. P + i (with a sliding window W only the last W of them) through the
// request's row of req_to_token: the prefix's keys and the new ones alike, written to the
// pool before this runs. A task takes up to kMaxRows query rows (queries x the query heads
// that share one KV head) of one request and walks that KV head's keys in blocks of kKeys at
// absolute positions (multiples of kKeys), each block read, widened to float32 and its keys
// transposed once for all the task's rows. Four rows at a time then take the block: their
// scores (lane j: key j, no horizontal sums), the mask, and an online softmax (a running peak
// and exp sum per row, its weighted values rescaled when the peak rises). A row skips the
// blocks it sees no key of, and a seen block's unseen keys weigh exactly 0, so each row's
// result depends only on its own position and keys: the same whether its prompt came in one
// chunk or several, with a cached prefix or without, beside whatever rows. Float32
// throughout; tasks (costliest first) spread over PyTorch's threads. Against PyTorch's SDPA
// on the gathered keys (bfloat16, 9 query / 3 KV heads of 64, 2 Zen 4 threads): 96 tokens
// 0.15 against 0.21 ms a layer, 1024 tokens 11.0 against 12.1 ms.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>
#include <torch/library.h>

#include "ops.h"
#include "vec.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace tandem_cpu;

constexpr int64_t kKeys = 16;     // keys per block: one vector of scores per row
constexpr int64_t kMaxRows = 64;  // query rows per task

struct Task {
  int64_t b, h, q0, nq, cost;
};

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: a vec16 is two registers, and GCC broadcast each query float by 16 scalar stores (and
// spilled the value sums), so ExtendTask::block's products and sums go by explicit halves
// here: always four rows (rows past NR repeat the last and are not stored), each in named
// registers. With arrays of registers indexed by row GCC kept the sums on the stack (a load
// and a store around every FMA): 128 tokens took 0.83 ms a layer on 2 Zen 3 threads, 0.34
// now. The same operations in the same order as the generic loops.

// The first NR of four rows' halves stored at out + i * stride (as whole registers: a vec16
// built from them went through the stack, and GCC then kept the sums there all along).
template <int NR>
inline void store_rows(float* out, int64_t stride, __m256 lo0, __m256 hi0, __m256 lo1, __m256 hi1, __m256 lo2,
                       __m256 hi2, __m256 lo3, __m256 hi3) {
  _mm256_storeu_ps(out, lo0), _mm256_storeu_ps(out + 8, hi0);
  if (NR > 1) _mm256_storeu_ps(out + stride, lo1), _mm256_storeu_ps(out + stride + 8, hi1);
  if (NR > 2) _mm256_storeu_ps(out + 2 * stride, lo2), _mm256_storeu_ps(out + 2 * stride + 8, hi2);
  if (NR > 3) _mm256_storeu_ps(out + 3 * stride, lo3), _mm256_storeu_ps(out + 3 * stride + 8, hi3);
}

// s[i] (lane j: key j) = row i's query (qf + i * head_dim) times the block's keys kt
// ([head_dim][kKeys], transposed), for rows [0, NR).
template <int NR>
void avx2_block_scores(const float* qf, int64_t head_dim, const vec16* kt, vec16* s) {
  const float* q[4];
  for (int i = 0; i < 4; ++i) q[i] = qf + std::min(i, NR - 1) * head_dim;
  __m256 lo0 = _mm256_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0, lo3 = lo0, hi3 = lo0;
  for (int64_t d = 0; d < head_dim; ++d) {
    const float* key = reinterpret_cast<const float*>(kt + d);
    const __m256 klo = _mm256_loadu_ps(key), khi = _mm256_loadu_ps(key + 8);
    __m256 qd = _mm256_broadcast_ss(q[0] + d);
    lo0 = _mm256_fmadd_ps(qd, klo, lo0), hi0 = _mm256_fmadd_ps(qd, khi, hi0);
    qd = _mm256_broadcast_ss(q[1] + d);
    lo1 = _mm256_fmadd_ps(qd, klo, lo1), hi1 = _mm256_fmadd_ps(qd, khi, hi1);
    qd = _mm256_broadcast_ss(q[2] + d);
    lo2 = _mm256_fmadd_ps(qd, klo, lo2), hi2 = _mm256_fmadd_ps(qd, khi, hi2);
    qd = _mm256_broadcast_ss(q[3] + d);
    lo3 = _mm256_fmadd_ps(qd, klo, lo3), hi3 = _mm256_fmadd_ps(qd, khi, hi3);
  }
  store_rows<NR>(reinterpret_cast<float*>(s), 16, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3);
}

// Rows [0, NR)'s weighted values (acc: [rows][nc], row 0 first) rescaled by rescale[i], plus
// the block's values vf ([kKeys][nc]) weighed by w[i][j]: one chunk of the head at a time.
template <int NR>
void avx2_block_values(const float (*w)[kKeys], const float* rescale, const vec16* vf, int64_t nc, vec16* acc) {
  int row[4];
  for (int i = 0; i < 4; ++i) row[i] = std::min(i, NR - 1);
  for (int64_t c = 0; c < nc; ++c) {
    __m256 lo[4], hi[4];
    for (int i = 0; i < 4; ++i) {
      const float* a = reinterpret_cast<const float*>(acc + row[i] * nc + c);
      const __m256 scale_i = _mm256_set1_ps(rescale[row[i]]);
      lo[i] = _mm256_mul_ps(_mm256_loadu_ps(a), scale_i);
      hi[i] = _mm256_mul_ps(_mm256_loadu_ps(a + 8), scale_i);
    }
    __m256 lo0 = lo[0], hi0 = hi[0], lo1 = lo[1], hi1 = hi[1], lo2 = lo[2], hi2 = hi[2], lo3 = lo[3], hi3 = hi[3];
    for (int64_t j = 0; j < kKeys; ++j) {
      const float* value = reinterpret_cast<const float*>(vf + j * nc + c);
      const __m256 vlo = _mm256_loadu_ps(value), vhi = _mm256_loadu_ps(value + 8);
      __m256 wj = _mm256_broadcast_ss(&w[row[0]][j]);
      lo0 = _mm256_fmadd_ps(wj, vlo, lo0), hi0 = _mm256_fmadd_ps(wj, vhi, hi0);
      wj = _mm256_broadcast_ss(&w[row[1]][j]);
      lo1 = _mm256_fmadd_ps(wj, vlo, lo1), hi1 = _mm256_fmadd_ps(wj, vhi, hi1);
      wj = _mm256_broadcast_ss(&w[row[2]][j]);
      lo2 = _mm256_fmadd_ps(wj, vlo, lo2), hi2 = _mm256_fmadd_ps(wj, vhi, hi2);
      wj = _mm256_broadcast_ss(&w[row[3]][j]);
      lo3 = _mm256_fmadd_ps(wj, vlo, lo3), hi3 = _mm256_fmadd_ps(wj, vhi, hi3);
    }
    store_rows<NR>(reinterpret_cast<float*>(acc + c), 16 * nc, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3);
  }
}

// One row's online-softmax update for a block of keys at positions k0 .. k0 + 15 (its scores
// sc, 16 floats), of which it sees lo .. pos: its weights w (exp(score - new peak) where seen,
// else 0), its peak and exp sum updated; returns the factor its weighted values are rescaled
// by. The generic code's operations, its sums in halving16's order.
inline float avx2_softmax_row(const float* sc, int64_t k0, int64_t lo, int64_t pos, float& peak, float& total,
                              float* w) {
  const __m256 idx = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  const __m256 lane_lo = _mm256_add_ps(_mm256_set1_ps(static_cast<float>(k0)), idx);
  const __m256 lane_hi = _mm256_add_ps(_mm256_set1_ps(static_cast<float>(k0 + 8)), idx);
  const __m256 first = _mm256_set1_ps(static_cast<float>(lo)), last = _mm256_set1_ps(static_cast<float>(pos));
  const __m256 seen_lo = _mm256_and_ps(_mm256_cmp_ps(lane_lo, first, _CMP_GE_OQ), _mm256_cmp_ps(lane_lo, last, _CMP_LE_OQ));
  const __m256 seen_hi = _mm256_and_ps(_mm256_cmp_ps(lane_hi, first, _CMP_GE_OQ), _mm256_cmp_ps(lane_hi, last, _CMP_LE_OQ));
  const __m256 s_lo = _mm256_loadu_ps(sc), s_hi = _mm256_loadu_ps(sc + 8), none = _mm256_set1_ps(-INFINITY);
  const float block_peak = max_lanes8(_mm256_max_ps(_mm256_blendv_ps(none, s_lo, seen_lo), _mm256_blendv_ps(none, s_hi, seen_hi)));
  if (block_peak == -INFINITY) {  // the row sees no key of this block: nothing changes
    std::memset(w, 0, kKeys * sizeof(float));
    return 1.f;
  }
  const float new_peak = std::max(peak, block_peak);
  const vec8 top = vec8{} + new_peak;
  const __m256 p_lo = _mm256_and_ps(exp_nonpositive_lanes<vec8, ivec8>(s_lo - top), seen_lo);
  const __m256 p_hi = _mm256_and_ps(exp_nonpositive_lanes<vec8, ivec8>(s_hi - top), seen_hi);
  _mm256_storeu_ps(w, p_lo), _mm256_storeu_ps(w + 8, p_hi);
  const float sum = sum_lanes8(_mm256_add_ps(p_lo, p_hi));
  const float rescale = peak == -INFINITY || new_peak == peak ? 1.f : exp_nonpositive(peak - new_peak);
  total = total * rescale + sum;
  peak = new_peak;
  return rescale;
}
#endif

// Rows [queries q0 .. q0 + nq of request b] x [the query heads of KV head h]: row r is query
// q0 + r / group, head h * group + r % group. Q: the queries' and output's dtype, T: the pool's
// (Q, or a narrower pool: kv_dtype_pairs). C: head_dim / 16 (a compile-time constant where
// common, else 0 and `chunks` says it).
template <typename Q, typename T, int C>
struct ExtendTask {
  int64_t group, chunks, window;
  float scale, softcap;

  // Rows [r0, r0 + NR) against one block of keys (kt: the keys transposed, [head_dim][kKeys];
  // vf: the values, [kKeys][nc]) at positions k0 ..: per row its scores (lane j: key k0 + j),
  // then the online softmax's update of its peak, exp sum and weighted values (acc).
  template <int NR>
  void block(int64_t r0, int64_t pos0, int64_t k0, const float* qf, const vec16* kt, const vec16* vf, vec16* acc,
             float* peak, float* total) const {
    const int64_t nc = C > 0 ? C : chunks, head_dim = nc * 16;
    vec16 s[NR] = {};
#if defined(__AVX2__) && !defined(__AVX512F__)
    avx2_block_scores<NR>(qf + r0 * head_dim, head_dim, kt, s);
    float w[NR][kKeys], rescale[NR];
    for (int i = 0; i < NR; ++i) {
      const int64_t r = r0 + i, pos = pos0 + r / group, lo = window > 0 ? pos - window + 1 : 0;
      cap(s[i]);
      rescale[i] = avx2_softmax_row(reinterpret_cast<const float*>(s + i), k0, lo, pos, peak[r], total[r], w[i]);
    }
    avx2_block_values<NR>(w, rescale, vf, nc, acc + r0 * nc);
#else
    for (int64_t d = 0; d < head_dim; ++d)
      for (int i = 0; i < NR; ++i) s[i] += qf[(r0 + i) * head_dim + d] * kt[d];
    vec16 lane;
    for (int j = 0; j < 16; ++j) lane[j] = static_cast<float>(k0 + j);
    vec16 p[NR];
    float rescale[NR];
    for (int i = 0; i < NR; ++i) {
      const int64_t r = r0 + i, pos = pos0 + r / group, lo = window > 0 ? pos - window + 1 : 0;
      cap(s[i]);
      const auto seen = (lane >= static_cast<float>(lo)) & (lane <= static_cast<float>(pos));  // -1 where seen
      const vec16 masked = seen ? s[i] : vec16{} - INFINITY;
      const float block_peak = halving_max16(masked);
      if (block_peak == -INFINITY) {  // the row sees no key of this block: nothing changes
        p[i] = vec16{};
        rescale[i] = 1.f;
        continue;
      }
      const float new_peak = std::max(peak[r], block_peak);
      p[i] = seen ? exp_nonpositive16(s[i] - new_peak) : vec16{};
      const float sum = halving_sum16(p[i]);
      rescale[i] = peak[r] == -INFINITY || new_peak == peak[r] ? 1.f : exp_nonpositive(peak[r] - new_peak);
      total[r] = total[r] * rescale[i] + sum;
      peak[r] = new_peak;
    }
    float w[NR][kKeys];  // the weights as floats: each meets the values as a broadcast
    std::memcpy(w, p, sizeof(w));
    if constexpr (C > 0 && NR * C <= 16) {  // all NR rows' weighted values in registers
      vec16 a[NR][C];
      for (int i = 0; i < NR; ++i)
        for (int c = 0; c < C; ++c) a[i][c] = acc[(r0 + i) * C + c] * rescale[i];
      for (int64_t j = 0; j < kKeys; ++j)
        for (int i = 0; i < NR; ++i)
          for (int c = 0; c < C; ++c) a[i][c] += w[i][j] * vf[j * C + c];
      for (int i = 0; i < NR; ++i)
        for (int c = 0; c < C; ++c) acc[(r0 + i) * C + c] = a[i][c];
    } else {  // one chunk of the head at a time (the same sums in the same order)
      for (int64_t c = 0; c < nc; ++c) {
        vec16 a[NR];
        for (int i = 0; i < NR; ++i) a[i] = acc[(r0 + i) * nc + c] * rescale[i];
        for (int64_t j = 0; j < kKeys; ++j)
          for (int i = 0; i < NR; ++i) a[i] += w[i][j] * vf[j * nc + c];
        for (int i = 0; i < NR; ++i) acc[(r0 + i) * nc + c] = a[i];
      }
    }
#endif
  }

  // Soft-capped scores (softcap * tanh(s / softcap)) where the model asks for them.
  void cap(vec16& s) const {
    if (softcap <= 0.f) return;
    const float inv_cap = 1.f / softcap;
    for (int j = 0; j < 16; ++j) s[j] = softcap * std::tanh(s[j] * inv_cap);
  }

  // q, out: the task's first query's row at its first head; pos0: that query's position;
  // slots: the request's KV slots by position. work: (rows + 2 * kKeys) * nc vectors; stats:
  // (2 + head_dim) * rows floats.
  void run(const Q* q, int64_t q_stride_t, int64_t q_stride_h, const T* k, const T* v, int64_t k_stride_s,
           int64_t v_stride_s, const int64_t* slots, int64_t pos0, int64_t nq, Q* out, int64_t out_stride_t,
           vec16* work, float* stats) const {
    const int64_t nc = C > 0 ? C : chunks, head_dim = nc * 16, rows = nq * group;
    vec16* acc = work;             // [rows][nc] the weighted values so far
    vec16* kt = acc + rows * nc;   // [head_dim][kKeys] the block's keys, transposed
    vec16* vf = kt + kKeys * nc;   // [kKeys][nc] its values
    float* peak = stats;           // [rows]
    float* total = peak + rows;    // [rows]
    float* qf = total + rows;      // [rows][head_dim] the queries, scaled
    for (int64_t r = 0; r < rows; ++r) {
      const Q* qr = q + (r / group) * q_stride_t + (r % group) * q_stride_h;
      for (int64_t c = 0; c < nc; ++c) {
        store16(qf + r * head_dim + c * 16, load16(qr + c * 16) * scale);
        acc[r * nc + c] = vec16{};
      }
      peak[r] = -INFINITY;
      total[r] = 0.f;
    }
    const int64_t last = pos0 + nq - 1;  // the last query's position: keys 0 .. last at most
    const int64_t first = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
    for (int64_t k0 = first / kKeys * kKeys; k0 <= last; k0 += kKeys) {
      const int64_t n = std::min<int64_t>(kKeys, last + 1 - k0);
      for (int64_t c = 0; c < nc; ++c) {
        vec16* tile = kt + c * 16;  // dims c * 16 .. + 15 of the 16 keys, then transposed
        for (int64_t j = 0; j < kKeys; ++j) {
          tile[j] = j < n ? load16(k + slots[k0 + j] * k_stride_s + c * 16) : vec16{};
          vf[j * nc + c] = j < n ? load16(v + slots[k0 + j] * v_stride_s + c * 16) : vec16{};
        }
        transpose16(tile);
      }
      int64_t r0 = 0;
      for (; r0 + 4 <= rows; r0 += 4) block<4>(r0, pos0, k0, qf, kt, vf, acc, peak, total);
      switch (rows - r0) {
        case 3: block<3>(r0, pos0, k0, qf, kt, vf, acc, peak, total); break;
        case 2: block<2>(r0, pos0, k0, qf, kt, vf, acc, peak, total); break;
        case 1: block<1>(r0, pos0, k0, qf, kt, vf, acc, peak, total); break;
        default: break;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      Q* o = out + (r / group) * out_stride_t + (r % group) * head_dim;
      const float inv = 1.f / total[r];
      for (int64_t c = 0; c < nc; ++c) store16(o + c * 16, acc[r * nc + c] * inv);
    }
  }
};

template <typename Q, typename T, int C>
void extend_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                           const at::Tensor& prefix_lens, const at::Tensor& extend_lens, double scale, int64_t window,
                           double softcap, at::Tensor& out) {
  const int64_t bs = req_pool_indices.numel(), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), group = num_heads / kv_heads;
  const int64_t queries_per_task = std::max<int64_t>(1, kMaxRows / group);
  const int64_t* rows_of = req_pool_indices.data_ptr<int64_t>();
  const int64_t* prefix = prefix_lens.data_ptr<int64_t>();
  const int64_t* extend = extend_lens.data_ptr<int64_t>();
  std::vector<int64_t> start(bs + 1, 0);  // each request's first row of q
  for (int64_t b = 0; b < bs; ++b) start[b + 1] = start[b] + extend[b];
  TORCH_CHECK(start[bs] == q.size(0), "extend_attention: the extend lengths must sum to q's tokens");
  std::vector<Task> tasks;
  for (int64_t b = 0; b < bs; ++b) {
    TORCH_CHECK(prefix[b] >= 0 && extend[b] >= 0 && prefix[b] + extend[b] <= req_to_token.size(1),
                "extend_attention: a request's length exceeds its req_to_token row");
    for (int64_t q0 = 0; q0 < extend[b]; q0 += queries_per_task) {
      const int64_t nq = std::min(queries_per_task, extend[b] - q0), keys = prefix[b] + q0 + nq;
      const int64_t seen = window > 0 ? std::min(keys, window + nq) : keys;
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({b, h, q0, nq, nq * seen});
    }
  }
  // Costliest first, so that the last tasks taken are short ones (the threads finish together).
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const ExtendTask<Q, T, C> task{group, head_dim / 16, window, static_cast<float>(scale), static_cast<float>(softcap)};
  const Q* q_ptr = q.data_ptr<Q>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  Q* out_ptr = out.data_ptr<Q>();
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  const int64_t count = static_cast<int64_t>(tasks.size());
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count)));
  const int64_t max_rows = queries_per_task * group;
#pragma omp parallel num_threads(threads)
  {
    std::vector<vec16> work((max_rows + 2 * kKeys) * (head_dim / 16));
    std::vector<float> stats((2 + head_dim) * max_rows);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i) {
      const Task& t = tasks[i];
      const int64_t token = start[t.b] + t.q0;
      task.run(q_ptr + token * q.stride(0) + t.h * group * q.stride(1), q.stride(0), q.stride(1),
               k_ptr + t.h * k_cache.stride(1), v_ptr + t.h * v_cache.stride(1), k_cache.stride(0), v_cache.stride(0),
               table + rows_of[t.b] * req_to_token.stride(0), prefix[t.b] + t.q0, t.nq,
               out_ptr + token * num_heads * head_dim + t.h * group * head_dim, num_heads * head_dim, work.data(),
               stats.data());
    }
  }
}

template <typename Q, typename T>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                       const at::Tensor& prefix_lens, const at::Tensor& extend_lens, double scale, int64_t window,
                       double softcap, at::Tensor& out) {
  switch (q.size(2)) {
    case 32: return extend_attention_impl<Q, T, 2>(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens, scale, window, softcap, out);
    case 64: return extend_attention_impl<Q, T, 4>(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens, scale, window, softcap, out);
    case 128: return extend_attention_impl<Q, T, 8>(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens, scale, window, softcap, out);
    default: return extend_attention_impl<Q, T, 0>(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens, scale, window, softcap, out);
  }
}

}  // namespace

namespace tandem_cpu {

// q [tokens, num_heads, head_dim] (the extend tokens of every request, request after request;
// any strides but the last); k_cache/v_cache [slots, kv_heads, head_dim] (one layer of the
// pool, q's dtype or a narrower one: kv_dtype_pairs, holding the new tokens' keys
// already); req_to_token [rows, max_context] int64; req_pool_indices, prefix_lens, extend_lens [bs] int64 (CPU): request b's tokens are
// q's rows sum(extend_lens[:b]) .. + extend_lens[b], at positions prefix_lens[b] + i. `window`
// > 0: a query at position p sees the keys at (p - window, p]; `softcap` > 0: scores are
// soft-capped (softcap * tanh(s / softcap)). Returns [tokens, num_heads * head_dim].
at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                            const at::Tensor& prefix_lens, const at::Tensor& extend_lens, double scale, int64_t window,
                            double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "extend_attention: q, k, v must be 3-D");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "extend_attention: CPU tensors only");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && kv_dtype_pairs(q.scalar_type(), k_cache.scalar_type()),
              "extend_attention: ", kKvDtypePairs);
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1 && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == q.size(2) && v_cache.size(2) == q.size(2),
              "extend_attention: the head dimension must be contiguous, K and V of q's head_dim");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "extend_attention: query heads must be a multiple of the KV heads");
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(2) <= 256, "extend_attention: head_dim must be a multiple of 16, <= 256");
  const auto rows = req_pool_indices.contiguous(), prefix = prefix_lens.contiguous(), extend = extend_lens.contiguous();
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && rows.scalar_type() == at::kLong &&
                  prefix.scalar_type() == at::kLong && extend.scalar_type() == at::kLong &&
                  req_to_token.stride(1) == 1 && prefix.device().is_cpu() && extend.device().is_cpu(),
              "extend_attention: index tensors must be int64 on the CPU (req_to_token rows contiguous)");
  TORCH_CHECK(rows.numel() == prefix.numel() && rows.numel() == extend.numel(),
              "extend_attention: req_pool_indices, prefix_lens and extend_lens must have one entry per request");
  auto out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  dispatch_kv_dtypes(q.scalar_type(), k_cache.scalar_type(), "extend_attention", [&](auto q_type, auto kv_type) {
    dispatch_head_dim<decltype(q_type), decltype(kv_type)>(q, k_cache, v_cache, req_to_token, rows, prefix, extend,
                                                           scale, window, softcap, out);
  });
  return out;
}

}  // namespace tandem_cpu

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("extend_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, Tensor req_pool_indices, "
        "Tensor prefix_lens, Tensor extend_lens, float scale, int window=0, float softcap=0.) -> Tensor");
  m.impl("extend_attention", c10::DispatchKey::CPU, &tandem_cpu::extend_attention);
}
