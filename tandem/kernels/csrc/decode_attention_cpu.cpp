// One-token (decode) attention per request, reading the paged KV pool in place, on CPU.
//
// Each task takes one request and some of its KV heads (all of them when there are requests
// enough for every thread, else one): the query heads sharing each KV head are scored
// against the request's keys (slots req_to_token[req_pool_indices[b], 0:seq_len]), 16 keys
// at a time, softmaxed and applied to its values, all in float32, without copying any key
// or value. Tasks run in parallel with at::parallel_for (PyTorch's OpenMP threads). Loops
// are written for the compiler to vectorize (built with -O3 -march=native by cpu.py); with
// AVX-512, bfloat16 keys are scored by VDPBF16PS where the CPU has it and bfloat16 values are
// widened 32 at a time (DecodeTask::kPairs: 1.4-1.6x the generic code's speed on Zen 4).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops.h"
#include "vec.h"

#include <cmath>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using namespace tandem_cpu;

// Asks for a key or value row ahead of its use: a request's decode-time slots are spread
// over the pool (one per step, interleaved with the other requests'), which the hardware
// prefetchers do not follow. To L2 (__builtin_prefetch's locality 2).
template <typename T>
inline void prefetch_row(const T* row, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < elems * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off, 0, 2);
}

// Scores si[0, len) to exp(s - peak) in place; their peak and the exps' sum. Vector reductions
// over whole blocks (a scalar loop's chain of dependent maxes and adds took a quarter of the
// kernel's time), the rest one by one. On AVX2 one register (8 scores) at a time: GCC took the
// vec16 loops through the stack there (a fifth of the kernel's time with its keys in cache).
inline void softmax_scores(float* si, int64_t len, float& peak_out, float& total_out) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  const int64_t whole = len / 8 * 8;
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < whole; t += 8) m = _mm256_max_ps(_mm256_loadu_ps(si + t), m);
  float peak = max_lanes8(m);
  for (int64_t t = whole; t < len; ++t) peak = si[t] > peak ? si[t] : peak;
  const vec8 top = vec8{} + peak;
  __m256 sums = _mm256_setzero_ps();
  for (int64_t t = 0; t < whole; t += 8) {
    const __m256 e = exp_nonpositive_lanes<vec8, ivec8>(_mm256_loadu_ps(si + t) - top);
    _mm256_storeu_ps(si + t, e);
    sums = _mm256_add_ps(sums, e);
  }
  float total = sum_lanes8(sums);
#else
  const int64_t whole = len / 16 * 16;
  vec16 peaks16 = vec16{} - INFINITY;
  for (int64_t t = 0; t < whole; t += 16) {
    const vec16 v = load16(si + t);
    peaks16 = v > peaks16 ? v : peaks16;
  }
  float peak = halving_max16(peaks16);
  for (int64_t t = whole; t < len; ++t) peak = si[t] > peak ? si[t] : peak;
  vec16 sums16{};
  for (int64_t t = 0; t < whole; t += 16) {
    const vec16 e = exp_nonpositive16(load16(si + t) - peak);
    store16(si + t, e);
    sums16 += e;
  }
  float total = halving_sum16(sums16);
#endif
  for (int64_t t = whole; t < len; ++t) total += si[t] = exp_nonpositive(si[t] - peak);
  peak_out = peak;
  total_out = total;
}

// One task: one request, KV heads [h0, h0 + kv_count) and their `group` query heads each
// (queries `kv_count * group`, query head i reads KV head h0 + i / group). Per key slot the
// task reads the rows of all its KV heads, which lie side by side in the pool, so a
// request's keys and values stream from memory once. Q: the queries' and output's dtype, T:
// the pool's (Q itself, or a narrower pool: kv_dtype_pairs, --kv-cache-dtype), each row
// widened to float32 as it is read. C: head_dim / 16 when a compile-time constant, else 0 and
// `chunks` says it.
template <typename Q, typename T, int C>
struct DecodeTask {
  // bfloat16 rows of whole 32-element pairs of vectors
  static constexpr bool kPairs = std::is_same_v<T, c10::BFloat16> && C > 0 && C % 2 == 0;
#if defined(__AVX512BF16__)
  // keys scored by VDPBF16PS (pairs of products summed in float32: the same products, exact in
  // float32, summed in another order), the query unscaled and the sums scaled after
  static constexpr bool kDotPairs = kPairs && std::is_same_v<Q, c10::BFloat16>;
#else
  static constexpr bool kDotPairs = false;
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
  // rows the AVX2 loops below widen 8 at a time (float16 by F16C)
  static constexpr bool kAvx2Rows = C > 0 && (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>
#if defined(__F16C__)
                                               || std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::Float8_e5m2>
                                               || std::is_same_v<T, c10::Float8_e4m3fn>
#endif
                                               );
#endif
  int64_t group, chunks;
  float scale;
  float softcap;  // > 0: scores = softcap * tanh(scores / softcap) (Gemma 2's attn_logit_softcapping)

#if defined(__AVX2__) && !defined(__AVX512F__)
  // AVX2 (a vec16 is two registers there, and GCC spilled the generic loops' vec16 arrays to the
  // stack): the keys 8 at a time per query, one register of products a key (the query's vectors
  // read from L1 as operands; a 16-bit key widened as it is loaded), the 8 sums by one
  // lane_sums8; scores of keys past `len` in the last block of 8 are computed from the last key
  // and never read. The same products as the generic loop, summed in another order.
  void avx2_scores(const float* qf, const T* k, const T* v, int64_t k_stride_s, int64_t v_stride_s,
                   int64_t stride_h, int64_t kv_count, const int64_t* slots, int64_t len, int64_t max_len,
                   float* scores, int64_t row_elems, bool values_early) const {
    constexpr int kV = 2 * C;  // registers of one head's row
    for (int64_t t0 = 0; t0 < len; t0 += 8) {
      const int64_t n = std::min<int64_t>(8, len - t0);
      for (int64_t j = t0; j < t0 + n; ++j) {  // keys 32 ahead, this block's values (see run)
        if (j + 32 < len) prefetch_row(k + slots[j + 32] * k_stride_s, row_elems);
        if (values_early) prefetch_row(v + slots[j] * v_stride_s, row_elems);
      }
      const T* rows[8];
      for (int j = 0; j < 8; ++j) rows[j] = k + slots[t0 + std::min<int64_t>(j, n - 1)] * k_stride_s;
      for (int64_t h = 0; h < kv_count; ++h)
        for (int64_t i = h * group; i < (h + 1) * group; ++i) {
          const float* qi = qf + i * 16 * C;
          __m256 sum[8];
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) sum[j] = _mm256_mul_ps(load8f(rows[j] + h * stride_h), _mm256_loadu_ps(qi));
#pragma GCC unroll 16
          for (int c = 1; c < kV; ++c)
#pragma GCC unroll 8
            for (int j = 0; j < 8; ++j)
              sum[j] = _mm256_fmadd_ps(load8f(rows[j] + h * stride_h + 8 * c), _mm256_loadu_ps(qi + 8 * c), sum[j]);
          _mm256_storeu_ps(scores + i * max_len + t0, lane_sums8(sum));
        }
    }
  }

  // AVX2 values (16-bit ones widened as they are loaded): the G queries of one KV head at a time,
  // P registers of its dims a pass: per key the G weights broadcast once, then each value
  // vector loaded once and met by the G weights, so that G * P accumulators, G weights and one
  // vector fit the 16 registers (P = 4 at G = 3: 2 passes over the keys instead of 4; with the
  // vectors loaded first, 12 accumulators at G = 3 spilled one, and 384 keys took 1.2x the
  // time). Where the values were not asked for with the keys (too many for L2), each block of 8
  // keys asks for the rows of the block 3 ahead. The same sums in the same order as the generic
  // loop.
  template <int G>
  void avx2_values(const T* v, int64_t v_stride_s, int64_t stride_h, int64_t kv_count, const int64_t* slots,
                   int64_t len, int64_t max_len, const float* scores, int64_t row_elems, vec16* acc) const {
    constexpr int kV = 2 * C;
    constexpr int P = (kV % 8 == 0 && 9 * G + 1 <= 16) ? 8 : (kV % 4 == 0 && 5 * G + 1 <= 16) ? 4 : 2;
    const bool ahead = len * row_elems * static_cast<int64_t>(sizeof(T)) > (256 << 10);
    for (int64_t h = 0; h < kv_count; ++h) {
      const float* p = scores + h * G * max_len;
      for (int d0 = 0; d0 < kV; d0 += P) {
        __m256 a[G][P];
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
          for (int d = 0; d < P; ++d) a[g][d] = _mm256_setzero_ps();
        for (int64_t t0 = 0; t0 < len; t0 += 8) {
          if (ahead && h == 0 && d0 == 0)
            for (int64_t j = t0 + 24; j < std::min<int64_t>(t0 + 32, len); ++j)
              prefetch_row(v + slots[j] * v_stride_s, row_elems);
          const int64_t t1 = std::min<int64_t>(t0 + 8, len);
          for (int64_t t = t0; t < t1; ++t) {
            const T* vrow = v + slots[t] * v_stride_s + h * stride_h + 8 * d0;
            __m256 pg[G];
#pragma GCC unroll 8
            for (int g = 0; g < G; ++g) pg[g] = _mm256_broadcast_ss(p + g * max_len + t);
#pragma GCC unroll 8
            for (int d = 0; d < P; ++d) {
              const __m256 vd = load8f(vrow + 8 * d);
#pragma GCC unroll 8
              for (int g = 0; g < G; ++g) a[g][d] = _mm256_fmadd_ps(pg[g], vd, a[g][d]);
            }
          }
        }
        float* out = reinterpret_cast<float*>(acc);
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
          for (int d = 0; d < P; ++d) _mm256_storeu_ps(out + (h * G + g) * 16 * C + 8 * (d0 + d), a[g][d]);
      }
    }
  }
#endif

  // acc[i * nc + c] = sum over keys t (in order) of p[i][t] * v[t]: with G > 0 (G * C <= 16
  // vectors: the group of one KV head in registers) one KV head at a time, else all at once
  // from memory. The same sums in the same order either way.
  template <int G>
  void weigh_values(const T* v, int64_t v_stride_s, int64_t stride_h, int64_t kv_count, const int64_t* slots,
                    int64_t len, int64_t max_len, const float* scores, int64_t row_elems, vec16* acc) const {
    const int64_t nc = C > 0 ? C : chunks, queries = kv_count * group;
#if defined(__AVX512F__)
    if constexpr (G > 0 && kPairs) {  // a row of 32 bfloat16 widened by two operations (even, odd lanes)
      const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
      for (int64_t h = 0; h < kv_count; ++h) {
        vec16 a[G][C] = {};  // [g][2c]: dims 32c + 2l, [g][2c + 1]: dims 32c + 2l + 1
        const float* p = scores + h * G * max_len;
        for (int64_t t = 0; t < len; ++t) {
          if (h == 0 && t + 24 < len) prefetch_row(v + slots[t + 24] * v_stride_s, row_elems);
          const T* vrow = v + slots[t] * v_stride_s + h * stride_h;
          vec16 vc[C];
          for (int c = 0; c < C / 2; ++c) {
            const __m512i w = _mm512_loadu_si512(vrow + c * 32);
            vc[2 * c] = (vec16)_mm512_slli_epi32(w, 16);
            vc[2 * c + 1] = (vec16)_mm512_and_si512(w, high);
          }
          for (int g = 0; g < G; ++g)
            for (int c = 0; c < C; ++c) a[g][c] += p[g * max_len + t] * vc[c];
        }
        const ivec16 lo = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
        const ivec16 hi = lo + 8;
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < C / 2; ++c) {
            acc[(h * G + g) * nc + 2 * c] = __builtin_shuffle(a[g][2 * c], a[g][2 * c + 1], lo);
            acc[(h * G + g) * nc + 2 * c + 1] = __builtin_shuffle(a[g][2 * c], a[g][2 * c + 1], hi);
          }
      }
      return;
    }
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
    if constexpr (G > 0 && kAvx2Rows) {
      avx2_values<G>(v, v_stride_s, stride_h, kv_count, slots, len, max_len, scores, row_elems, acc);
      return;
    }
#endif
    if constexpr (G > 0 && C > 0) {
      for (int64_t h = 0; h < kv_count; ++h) {
        vec16 a[G][C] = {};
        const float* p = scores + h * G * max_len;
        for (int64_t t = 0; t < len; ++t) {
          if (h == 0 && t + 24 < len) prefetch_row(v + slots[t + 24] * v_stride_s, row_elems);
          const T* vrow = v + slots[t] * v_stride_s + h * stride_h;
          vec16 vc[C];
          for (int c = 0; c < C; ++c) vc[c] = load16(vrow + c * 16);
          for (int g = 0; g < G; ++g)
            for (int c = 0; c < C; ++c) a[g][c] += p[g * max_len + t] * vc[c];
        }
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < C; ++c) acc[(h * G + g) * nc + c] = a[g][c];
      }
      return;
    }
    for (int64_t i = 0; i < queries * nc; ++i) acc[i] = vec16{};
    for (int64_t t = 0; t < len; ++t) {
      if (t + 24 < len) prefetch_row(v + slots[t + 24] * v_stride_s, row_elems);
      for (int64_t h = 0; h < kv_count; ++h) {
        const T* vrow = v + slots[t] * v_stride_s + h * stride_h;
        vec16 vc[C > 0 ? C : 16];
        for (int64_t c = 0; c < nc; ++c) vc[c] = load16(vrow + c * 16);
        for (int64_t i = h * group; i < (h + 1) * group; ++i) {
          const float p = scores[i * max_len + t];
          for (int64_t c = 0; c < nc; ++c) acc[i * nc + c] += p * vc[c];
        }
      }
    }
  }

  // `scores`: queries * max_len floats; `work`: queries * (2 * chunks + 16) vectors. With
  // `partial` (a part of the keys, merged by merge_parts): per query its weighted values before
  // the division (head_dim floats), then all queries' score peaks and exp sums, instead of out.
  void run(const Q* q, int64_t q_stride_h, const T* k, const T* v, int64_t k_stride_s, int64_t v_stride_s,
           int64_t stride_h, int64_t kv_count, const int64_t* slots, int64_t len, int64_t max_len, float* scores,
           vec16* work, Q* out, float* partial = nullptr) const {
    const int64_t nc = C > 0 ? C : chunks, head_dim = nc * 16, queries = kv_count * group;
    const int64_t row_elems = (kv_count - 1) * stride_h + head_dim;  // the task's part of a slot
    vec16* qv = work;                  // [queries][nc] the queries, scaled
    vec16* acc = qv + queries * nc;    // [queries][nc] the weighted values
    vec16* part = acc + queries * nc;  // [queries][16] partial dot products of 16 keys
    if constexpr (!kDotPairs)
      for (int64_t i = 0; i < queries; ++i)
        for (int64_t c = 0; c < nc; ++c) qv[i * nc + c] = load16(q + i * q_stride_h + c * 16) * scale;
#if defined(__AVX512BF16__)
    // The bfloat16 queries as they are, in pairs, over qv's room (the scale goes on the sums).
    __m512bh* qb = reinterpret_cast<__m512bh*>(qv);
    if constexpr (kDotPairs)
      for (int64_t i = 0; i < queries; ++i)
        for (int c = 0; c < C / 2; ++c) qb[i * (C / 2) + c] = (__m512bh)_mm512_loadu_si512(q + i * q_stride_h + c * 32);
#endif
    // Keys 32 ahead to L2 (measured: one block ahead to L1, with this block's values to L2, was
    // 15-18% slower on the 100m model's shapes at 64 requests): a task of whole slots (every KV
    // head: 6 lines a key and more) asks for one key's rows with each key it scores, evenly,
    // a task of one head's rows for 16 keys a block (in cache, fewer prefetches cost less).
    // Values, where the task's fit in L2 (256 KB: 1 MB per core on Zen 4, 2 MB on recent Xeons),
    // are asked for with the keys of the same slots, a pass before theirs (after the softmax)
    // instead of as it starts. Measured against keys alone, two blocks ahead (2 Zen 4
    // threads, 9 / 3 heads of 64 in bfloat16, 2 MB streamed between layers): 16 requests of 175
    // keys 0.86, 64 of 175 0.82, 4 of 300 0.82 of the time; one request of 400 0.93.
    const bool spread = kv_count > 1;
    const bool values_early = len * row_elems * static_cast<int64_t>(sizeof(T)) <= (256 << 10);
    for (int64_t j = 0; j < std::min<int64_t>(32, len); ++j) prefetch_row(k + slots[j] * k_stride_s, row_elems);
#if defined(__AVX2__) && !defined(__AVX512F__)
    constexpr bool kAvx2Scores = kAvx2Rows;
    if constexpr (kAvx2Scores)
      avx2_scores(reinterpret_cast<const float*>(qv), k, v, k_stride_s, v_stride_s, stride_h, kv_count, slots, len,
                  max_len, scores, row_elems, values_early);
#else
    constexpr bool kAvx2Scores = false;
#endif
    for (int64_t t0 = 0; t0 < (kAvx2Scores ? 0 : len); t0 += 16) {
      const int64_t n = std::min<int64_t>(16, len - t0);
      if (!spread) {
        for (int64_t j = t0 + 32; j < std::min<int64_t>(t0 + 48, len); ++j)
          prefetch_row(k + slots[j] * k_stride_s, row_elems);
        if (values_early)
          for (int64_t j = t0; j < t0 + n; ++j) prefetch_row(v + slots[j] * v_stride_s, row_elems);
      }
      for (int64_t j = 0; j < 16; ++j) {
        if (spread && j < n) {
          if (t0 + j + 32 < len) prefetch_row(k + slots[t0 + j + 32] * k_stride_s, row_elems);
          if (values_early) prefetch_row(v + slots[t0 + j] * v_stride_s, row_elems);
        }
        if (j >= n) {
          for (int64_t i = 0; i < queries; ++i) part[i * 16 + j] = vec16{};
          continue;
        }
        for (int64_t h = 0; h < kv_count; ++h) {
          const T* krow = k + slots[t0 + j] * k_stride_s + h * stride_h;
#if defined(__AVX512BF16__)
          if constexpr (kDotPairs) {  // bfloat16 pairs: 32 products an instruction, no widening
            __m512bh kc[C / 2];
            for (int c = 0; c < C / 2; ++c) kc[c] = (__m512bh)_mm512_loadu_si512(krow + c * 32);
            for (int64_t i = h * group; i < (h + 1) * group; ++i) {
              __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[i * (C / 2)], kc[0]);
              for (int c = 1; c < C / 2; ++c) s = _mm512_dpbf16_ps(s, qb[i * (C / 2) + c], kc[c]);
              std::memcpy(part + i * 16 + j, &s, sizeof(s));
            }
            continue;
          }
#endif
          vec16 kc[C > 0 ? C : 16];
          for (int64_t c = 0; c < nc; ++c) kc[c] = load16(krow + c * 16);
          for (int64_t i = h * group; i < (h + 1) * group; ++i) {
            vec16 s = qv[i * nc] * kc[0];
            for (int64_t c = 1; c < nc; ++c) s += qv[i * nc + c] * kc[c];
            part[i * 16 + j] = s;
          }
        }
      }
      for (int64_t i = 0; i < queries; ++i)
        store16(scores + i * max_len + t0, kDotPairs ? lane_sums16(part + i * 16) * scale : lane_sums16(part + i * 16));
    }
    float inv[256], peaks[256], totals[256];
    for (int64_t i = 0; i < queries; ++i) {
      float* si = scores + i * max_len;
      if (softcap > 0.f) {
        const float inv_cap = 1.f / softcap;
        for (int64_t t = 0; t < len; ++t) si[t] = softcap * std::tanh(si[t] * inv_cap);
      }
      float peak, total;
      softmax_scores(si, len, peak, total);
      inv[i] = 1.f / total;
      peaks[i] = peak;
      totals[i] = total;
    }
#if defined(__AVX2__) && !defined(__AVX512F__)
    constexpr bool kAnyGroup = kAvx2Rows;  // avx2_values takes groups up to 4 at any head size
#else
    constexpr bool kAnyGroup = false;
#endif
    if constexpr (C > 0) {
      switch (group * C <= 16 || kAnyGroup ? group : 0) {  // common GQA groups: a KV head's weighted values in registers
        case 1: weigh_values<1>(v, v_stride_s, stride_h, kv_count, slots, len, max_len, scores, row_elems, acc); break;
        case 2: weigh_values<2>(v, v_stride_s, stride_h, kv_count, slots, len, max_len, scores, row_elems, acc); break;
        case 3: weigh_values<3>(v, v_stride_s, stride_h, kv_count, slots, len, max_len, scores, row_elems, acc); break;
        case 4: weigh_values<4>(v, v_stride_s, stride_h, kv_count, slots, len, max_len, scores, row_elems, acc); break;
        default: weigh_values<0>(v, v_stride_s, stride_h, kv_count, slots, len, max_len, scores, row_elems, acc); break;
      }
    } else {
      weigh_values<0>(v, v_stride_s, stride_h, kv_count, slots, len, max_len, scores, row_elems, acc);
    }
    if (partial != nullptr) {
      for (int64_t i = 0; i < queries; ++i)
        for (int64_t c = 0; c < nc; ++c) store16(partial + i * head_dim + c * 16, acc[i * nc + c]);
      std::memcpy(partial + queries * head_dim, peaks, queries * sizeof(float));
      std::memcpy(partial + queries * (head_dim + 1), totals, queries * sizeof(float));
      return;
    }
    for (int64_t i = 0; i < queries; ++i)
      for (int64_t c = 0; c < nc; ++c) store16(out + i * head_dim + c * 16, acc[i * nc + c] * inv[i]);
  }
};

// The `parts` partial results of one task (DecodeTask::run's `partial`, each over its part of
// the keys) as the whole: each part's weighted values and exp sum rescaled to the largest peak.
template <typename T>
void merge_parts(const float* partial, int64_t parts, int64_t queries, int64_t head_dim, T* out) {
  const int64_t stride = queries * (head_dim + 2);
  for (int64_t i = 0; i < queries; ++i) {
    float peak = -INFINITY;
    for (int64_t p = 0; p < parts; ++p) peak = std::max(peak, partial[p * stride + queries * head_dim + i]);
    float total = 0.f, weight[64];
    for (int64_t p = 0; p < parts; ++p) {
      const float part_peak = partial[p * stride + queries * head_dim + i];
      weight[p] = part_peak == -INFINITY ? 0.f : exp_nonpositive(part_peak - peak);  // a part with no keys: 0
      total += weight[p] * partial[p * stride + queries * (head_dim + 1) + i];
    }
    for (int64_t c = 0; c < head_dim; c += 16) {
      vec16 sum{};
      for (int64_t p = 0; p < parts; ++p) sum += weight[p] * load16(partial + p * stride + i * head_dim + c);
      store16(out + i * head_dim + c, sum * (1.f / total));
    }
  }
}

// How a decode batch's attention is cut into tasks: a task per request and all its KV heads
// (one stream through its slots) while there are requests enough to keep every thread busy,
// else a task per (request, KV head); and, where those tasks are too few to share evenly among
// the threads (one request's 3 KV heads on 2 threads: 2 against 1), each task's keys in `parts`
// ranges of at least kMinPartKeys, their partial softmax sums merged after (merge_parts).
constexpr int64_t kMinPartKeys = 64;

// The threads a share's tasks are spread over.
inline int64_t threads_of(const Share& share) { return share.team ? share.threads : at::get_num_threads(); }

struct AttentionSplit {
  int64_t kv_per_task, splits, queries, tasks, parts, max_len;

  AttentionSplit(int64_t bs, int64_t num_heads, int64_t kv_heads, const int64_t* lens, int64_t threads) {
    const int64_t group = num_heads / kv_heads;
    max_len = 0;
    for (int64_t b = 0; b < bs; ++b) max_len = std::max(max_len, lens[b]);
    max_len = (max_len + 15) / 16 * 16;  // whole blocks of 16 scores are stored
    kv_per_task = (bs >= 2 * threads && kv_heads * group <= 256) ? kv_heads : 1;
    splits = kv_heads / kv_per_task;
    queries = kv_per_task * group;
    tasks = bs * splits;
    parts = 1;
    if (threads > 1 && tasks < 2 * threads)
      parts = std::max<int64_t>(1, std::min<int64_t>({(2 * threads + tasks - 1) / tasks, max_len / kMinPartKeys, 64}));
  }
  // floats of the parts' results (DecodeTask::run's `partial`), 0 when the keys are not split
  int64_t partial_floats(int64_t head_dim) const { return parts > 1 ? tasks * parts * queries * (head_dim + 2) : 0; }
};

template <typename Q, typename T, int C>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                           const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
                           at::Tensor& out, const Share& share, float* partial) {
  const int64_t bs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), group = num_heads / kv_heads;
  const DecodeTask<Q, T, C> task{group, head_dim / 16, static_cast<float>(scale), static_cast<float>(softcap)};
  const Q* q_ptr = q.data_ptr<Q>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  Q* out_ptr = out.data_ptr<Q>();
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  const int64_t table_stride = req_to_token.stride(0);
  const int64_t* rows = req_pool_indices.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const AttentionSplit split(bs, num_heads, kv_heads, lens, threads_of(share));
  const int64_t kv_per_task = split.kv_per_task, splits = split.splits, queries = split.queries;
  const int64_t tasks = split.tasks, parts = split.parts, max_len = split.max_len;
  std::vector<float> own;  // the parts' results, when the caller gave no room for them
  if (parts > 1 && partial == nullptr) {
    TORCH_CHECK(!share.team, "decode_attention: split keys inside a team need the caller's partial buffer");
    own.resize(split.partial_floats(head_dim));
    partial = own.data();
  }
  auto run_task = [&](int64_t i, float* scores, vec16* work) {
    const int64_t t = i / parts, part = i % parts, b = t / splits, h0 = (t % splits) * kv_per_task;
    // A sliding window: the query (position lens[b] - 1) sees the last `window` keys only.
    const int64_t first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0, len = lens[b] - first;
    const int64_t k0 = len * part / parts, k1 = len * (part + 1) / parts;
    task.run(q_ptr + b * q.stride(0) + h0 * group * q.stride(1), q.stride(1), k_ptr + h0 * k_cache.stride(1),
             v_ptr + h0 * v_cache.stride(1), k_cache.stride(0), v_cache.stride(0), k_cache.stride(1), kv_per_task,
             table + rows[b] * table_stride + first + k0, k1 - k0, max_len, scores, work,
             out_ptr + (b * num_heads + h0 * group) * head_dim,
             parts > 1 ? partial + i * queries * (head_dim + 2) : nullptr);
  };
  share.run(tasks * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(queries * max_len);
    std::vector<vec16> work(queries * (2 * (head_dim / 16) + 16));
    for (int64_t i = begin; i < end; ++i) run_task(i, scores.data(), work.data());
  });
  if (parts == 1) return;
  if (share.team) {
#pragma omp barrier
  }
  share.run(tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / splits, h0 = (t % splits) * kv_per_task;
      merge_parts(partial + t * parts * queries * (head_dim + 2), parts, queries, head_dim,
                  out_ptr + (b * num_heads + h0 * group) * head_dim);
    }
  });
}

template <typename Q, typename T>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                       const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
                       at::Tensor& out, const Share& share, float* partial) {
  switch (q.size(2)) {
    case 32: return decode_attention_impl<Q, T, 2>(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale, window, softcap, out, share, partial);
    case 64: return decode_attention_impl<Q, T, 4>(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale, window, softcap, out, share, partial);
    case 128: return decode_attention_impl<Q, T, 8>(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale, window, softcap, out, share, partial);
    default: return decode_attention_impl<Q, T, 0>(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale, window, softcap, out, share, partial);
  }
}

}  // namespace

namespace tandem_cpu {

// q [bs, num_heads, head_dim]; k_cache/v_cache [slots, kv_heads, head_dim] (one layer of the
// pool, q's dtype or a narrower one: kv_dtype_pairs); req_to_token [rows, max_context] int64; req_pool_indices, seq_lens [bs]
// int64. `window` > 0: each query sees only the last `window` keys of its request (keys at
// positions (p - window, p] for the query at p, transformers' sliding window); `softcap` > 0:
// the scaled scores are soft-capped, softcap * tanh(s / softcap), before the softmax.
// Returns [bs, num_heads * head_dim] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                            const at::Tensor& seq_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3, "decode_attention: q, k, v must be 3-D");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  decode_attention_into(q, k_cache, v_cache, req_to_token, req_pool_indices.contiguous(), seq_lens.contiguous(), scale,
                        window, softcap, out, Share{});
  return out.view({q.size(0), q.size(1) * q.size(2)});
}

// decode_attention into out, this share of its tasks (ops.h).
void decode_attention_into(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                           const at::Tensor& seq_lens, double scale, int64_t window, double softcap, at::Tensor& out,
                           const Share& share, float* partial) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "decode_attention: q, k, v must be 3-D");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "decode_attention: CPU tensors only");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && kv_dtype_pairs(q.scalar_type(), k_cache.scalar_type()),
              "decode_attention: ", kKvDtypePairs);
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1 &&
                  k_cache.stride(1) == v_cache.stride(1),
              "decode_attention: the head dimension must be contiguous, K and V laid out alike");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0 && q.size(1) / k_cache.size(1) <= 64,
              "decode_attention: query heads must be 1-64 times the KV heads");
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(2) <= 256, "decode_attention: head_dim must be a multiple of 16, <= 256");
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_pool_indices.scalar_type() == at::kLong &&
                  seq_lens.scalar_type() == at::kLong && req_to_token.stride(1) == 1,
              "decode_attention: index tensors must be int64 (req_to_token rows contiguous)");
  TORCH_CHECK(req_pool_indices.is_contiguous() && seq_lens.is_contiguous(), "decode_attention: req_pool_indices and seq_lens must be contiguous");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.is_contiguous() && out.numel() == q.numel(),
              "decode_attention: out must be contiguous [bs, num_heads, head_dim] in q's dtype");
  dispatch_kv_dtypes(q.scalar_type(), k_cache.scalar_type(), "decode_attention", [&](auto q_type, auto kv_type) {
    dispatch_head_dim<decltype(q_type), decltype(kv_type)>(q, k_cache, v_cache, req_to_token, req_pool_indices,
                                                           seq_lens, scale, window, softcap, out, share, partial);
  });
}

// Floats of room decode_attention_into needs for its parts' results (0: none) with this share,
// for `bs` queries of `num_heads` heads on k_cache [slots, kv_heads, head_dim], seq_lens [bs].
int64_t decode_attention_partial_floats(int64_t bs, int64_t num_heads, const at::Tensor& k_cache,
                                        const at::Tensor& seq_lens, const Share& share) {
  TORCH_CHECK(k_cache.dim() == 3 && seq_lens.is_contiguous() && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.numel() == bs,
              "decode_attention: k must be 3-D and seq_lens contiguous int64 [bs]");
  const AttentionSplit split(bs, num_heads, k_cache.size(1), seq_lens.data_ptr<int64_t>(), threads_of(share));
  return split.partial_floats(k_cache.size(2));
}

// k_cache[slots[i]] = k[i] and v_cache[slots[i]] = v[i]: the step's new keys and values into
// one layer of the pool, one call for both (two index_copy_ cost ~10 us a layer at decode).
// k, v [n, kv_heads, head_dim] (any strides with the head dim contiguous: views of the QKV
// output), the caches' dtype, or rounded into a narrower cache (a pair kv_dtype_pairs takes:
// to nearest even, as PyTorch's cast); slots [n] int64, each a slot of the cache.
void kv_write(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v) {
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() &&
                  slots.device().is_cpu(), "kv_write: CPU tensors only");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k.dim() == 3 && v.dim() == 3 && k.size(0) == slots.numel() && v.size(0) == slots.numel() &&
                  k.size(1) == k_cache.size(1) && v.size(1) == v_cache.size(1) && k.size(2) == k_cache.size(2) &&
                  v.size(2) == v_cache.size(2) && k.stride(2) == 1 && v.stride(2) == 1,
              "kv_write: k, v [n, kv_heads, head_dim] (head dim contiguous) into contiguous caches of that shape");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  kv_dtype_pairs(k.scalar_type(), k_cache.scalar_type()),
              "kv_write (its rows k, v as q, its caches as k and v): ", kKvDtypePairs);
  TORCH_CHECK(slots.scalar_type() == at::kLong, "kv_write: slots must be int64");
  const auto idx = slots.contiguous();
  const int64_t* sp = idx.data_ptr<int64_t>();
  const int64_t n = slots.numel(), capacity = k_cache.size(0);
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < capacity, "kv_write: slot ", sp[i], " out of range");
  if (k.scalar_type() != k_cache.scalar_type()) {  // rows rounded into the narrower cache
    dispatch_kv_dtypes(k.scalar_type(), k_cache.scalar_type(), "kv_write", [&](auto q_type, auto kv_type) {
      using Q = decltype(q_type);
      using T = decltype(kv_type);
      auto convert = [&](at::Tensor& cache, const at::Tensor& src) {
        const int64_t heads = src.size(1), dim = src.size(2), whole = dim / 16 * 16;
        T* dst = static_cast<T*>(cache.data_ptr());
        const Q* from = static_cast<const Q*>(src.data_ptr());
        for (int64_t i = 0; i < n; ++i)
          for (int64_t h = 0; h < heads; ++h) {
            const Q* s = from + i * src.stride(0) + h * src.stride(1);
            T* d = dst + (sp[i] * heads + h) * dim;
            for (int64_t c = 0; c < whole; c += 16) store16(d + c, load16(s + c));
            for (int64_t c = whole; c < dim; ++c) d[c] = static_cast<T>(static_cast<float>(s[c]));
          }
      };
      convert(k_cache, k);
      convert(v_cache, v);
    });
    return;
  }
  auto copy = [&](at::Tensor& cache, const at::Tensor& src) {
    const int64_t heads = src.size(1), row = src.size(2) * src.element_size();
    char* dst = static_cast<char*>(cache.data_ptr());
    const char* from = static_cast<const char*>(src.data_ptr());
    const int64_t s0 = src.stride(0) * src.element_size(), s1 = src.stride(1) * src.element_size();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < heads; ++h) std::memcpy(dst + (sp[i] * heads + h) * row, from + i * s0 + h * s1, row);
  };
  copy(k_cache, k);
  copy(v_cache, v);
}

}  // namespace tandem_cpu

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("kv_write(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor k, Tensor v) -> ()");
  m.impl("kv_write", c10::DispatchKey::CPU, &tandem_cpu::kv_write);
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float scale, int window=0, float softcap=0.) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, &tandem_cpu::decode_attention);
}
