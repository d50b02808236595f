// Helpers shared by Tandem's C++ CPU kernels: 16-float vectors (GCC/Clang vector
// extensions, lowered to the machine's widest registers: one AVX-512 register, two AVX2
// ones, four NEON ones), loads and stores of 16 elements of each dtype, and exp.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cstdint>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstring>
#include <type_traits>

namespace tandem_cpu {

typedef float vec16 __attribute__((vector_size(64)));
typedef int32_t ivec16 __attribute__((vector_size(64)));
typedef uint32_t uvec16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
// 8 floats: one AVX2 register (elementwise kernels' float32 loops on AVX2, where a vec16 passed
// by value goes through memory).
typedef float vec8 __attribute__((vector_size(32)));
typedef int32_t ivec8 __attribute__((vector_size(32)));

// Cephes' expf (relative error ~2e-7, as the vectorized exp PyTorch's own kernels use):
// e^x = 2^n e^r with n = round(x / ln 2); this is e^r by its polynomial, for a float or a
// vector of them (V), branch-free so that loops calling it vectorize.
template <typename V>
inline V exp_reduced(V x, V n) {
  V r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) for x <= 0 (softmax after subtracting the max); below -87 as at -87 (~1.6e-38).
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return exp_reduced(x, n) * scale;
}

// exp_nonpositive of 16 floats (V: vec16; on AVX2 also vec8, one register): the same
// operations in each lane (the same results).
template <typename V, typename IV>
inline V exp_nonpositive_lanes(V x) {
  x = x < -87.0f ? V{} - 87.0f : x;
  const V t = x * 1.44269504088896341f + 0.5f;
  IV ni = __builtin_convertvector(t, IV);      // toward zero, then down to floor(t)
  ni += __builtin_convertvector(ni, V) > t;    // a true comparison is -1
  const IV bits = (ni + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return exp_reduced(x, __builtin_convertvector(ni, V)) * scale;
}
inline vec16 exp_nonpositive16(vec16 x) { return exp_nonpositive_lanes<vec16, ivec16>(x); }

// exp of 16 floats (V: vec16; on AVX2 also vec8, one register, the same operations in each
// lane), for inputs from -87 (below: as at -87) to 88.72 (above: +inf, as float's exp overflows).
template <typename V, typename IV>
inline V exp_lanes(V x) {
  const V in = x;
  x = x < -87.0f ? V{} - 87.0f : x;
  x = x > 88.72f ? V{} + 88.72f : x;
  const V t = x * 1.44269504088896341f + 0.5f;
  IV ni = __builtin_convertvector(t, IV);  // toward zero, then down to floor(t)
  ni += __builtin_convertvector(ni, V) > t;  // a true comparison is -1
  const IV bits = (ni + 126) << 23;          // 2^(n-1): n reaches 128 near the top
  V half_scale;
  std::memcpy(&half_scale, &bits, sizeof(half_scale));
  const V result = exp_reduced(x, __builtin_convertvector(ni, V)) * half_scale * 2.0f;
  return in > 88.72f ? V{} + __builtin_inff() : result;
}
inline vec16 exp16(vec16 x) { return exp_lanes<vec16, ivec16>(x); }

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vec16 load16(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  // one widening load and a shift (the generic form below compiled to six instructions)
  const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const uvec16 bits = __builtin_convertvector(h, uvec16) << 16;
#endif
  vec16 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
inline vec16 load16(const c10::Half* p) {
#if defined(__AVX512F__)
  return (vec16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));  // exact, as the cast
#elif defined(__F16C__)
  // two F16C conversions (the scalar loop below made float16 rows 3x slower than float32 ones)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  vec16 v;
  std::memcpy(&v, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
  return v;
#else
  vec16 v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

// fp8 KV pools (--kv-cache-dtype fp8_e5m2 / fp8_e4m3) widen through float16 bit patterns, which
// hold every fp8 value exactly: an e5m2 byte is a float16's high byte (infinities and NaNs
// included); an e4m3fn byte's exponent and mantissa, 7 bits up, are a float16 of its value / 256
// (its subnormals become float16 normals), the sign on top, and its NaN (S.1111.111, no
// infinities) stays a NaN. `fp8_half_bits` does that on the lanes of an integer vector holding
// one byte each (16-bit lanes, so that the results are float16 patterns).
inline bool is_fp8_e4m3(const c10::Float8_e4m3fn*) { return true; }
inline bool is_fp8_e4m3(const c10::Float8_e5m2*) { return false; }
template <typename B>
inline B fp8_half_bits(B b, bool e4m3) {
  if (!e4m3) return b << 8;
  // (b + sign) << 7: the magnitude 7 bits up and the sign, carried, on top
  return ((b + (b & 0x80)) << 7) | ((B)((b & 0x7F) == 0x7F) & 0x7E00);  // NaN: float16 0x7F.. stays NaN
}
#if defined(__AVX2__)
inline __m256i fp8_half_bits(__m256i b, bool e4m3) {  // 16 bytes in 16-bit lanes
  if (!e4m3) return _mm256_slli_epi16(b, 8);
  const __m256i h = _mm256_slli_epi16(_mm256_add_epi16(b, _mm256_and_si256(b, _mm256_set1_epi16(0x80))), 7);
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi16(0x7F));
  return _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7F)), _mm256_set1_epi16(0x7E00)));
}
#endif
// The scale an e4m3fn byte's float16 pattern is off by (2^8), else 1.
inline float fp8_scale(bool e4m3) { return e4m3 ? 256.0f : 1.0f; }
template <typename F8>
inline vec16 load16_fp8(const F8* p) {
  const bool e4m3 = is_fp8_e4m3(p);
#if defined(__AVX2__) && (defined(__AVX512F__) || defined(__F16C__))
  const __m256i h = fp8_half_bits(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), e4m3);
#if defined(__AVX512F__)
  return (vec16)_mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(fp8_scale(e4m3)));
#else
  const __m256 scale = _mm256_set1_ps(fp8_scale(e4m3));
  const __m256 lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), scale);
  const __m256 hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), scale);
  vec16 v;
  std::memcpy(&v, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
  return v;
#endif
#else
  u16x16 b;
  uint8_t bytes[16];
  std::memcpy(bytes, p, 16);
  for (int i = 0; i < 16; ++i) b[i] = bytes[i];
  const u16x16 h = fp8_half_bits(b, e4m3);
  c10::Half halves[16];
  std::memcpy(halves, &h, sizeof(h));
  return load16(halves) * fp8_scale(e4m3);
#endif
}
inline vec16 load16(const c10::Float8_e5m2* p) { return load16_fp8(p); }
inline vec16 load16(const c10::Float8_e4m3fn* p) { return load16_fp8(p); }
// Rounded as PyTorch's cast rounds (c10's conversion: to nearest even; e4m3fn's out-of-range
// values become its NaN, as the cast's).
inline void store16(c10::Float8_e5m2* p, vec16 v) {
  for (int i = 0; i < 16; ++i) p[i] = static_cast<c10::Float8_e5m2>(v[i]);
}
inline void store16(c10::Float8_e4m3fn* p, vec16 v) {
  for (int i = 0; i < 16; ++i) p[i] = static_cast<c10::Float8_e4m3fn>(v[i]);
}

// bfloat16 bit patterns (in 32-bit lanes) of 16 floats, rounded as PyTorch rounds: to
// nearest even, a NaN kept a NaN.
inline uvec16 bf16_bits(vec16 v) {
  uvec16 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uvec16 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uvec16 nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;  // all ones where NaN
  return (rounded & ~nan) | (0x7FC0u & nan);
}

// Stores 16 floats rounded to the destination's dtype.
inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }
inline void store16(c10::BFloat16* p, vec16 v) {
  const u16x16 h = __builtin_convertvector(bf16_bits(v), u16x16);
  std::memcpy(p, &h, sizeof(h));
}
inline void store16(c10::Half* p, vec16 v) {
#if defined(__F16C__)
  // round to nearest even, as the cast
  __m256 lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT));
#else
  for (int i = 0; i < 16; ++i) p[i] = static_cast<c10::Half>(v[i]);
#endif
}

// v rounded to T's precision and back: what PyTorch's op in T would have stored, for
// formulas that round between ops as Hugging Face's do. For float, v as it is, computed
// on its own: the compiler may not fuse the product that made it into a later add (an FMA
// rounds once where PyTorch's two ops round twice).
template <typename T>
inline vec16 round_to(vec16 v) {
  if constexpr (std::is_same_v<T, float>) {
#if defined(__has_builtin)
#if __has_builtin(__builtin_assoc_barrier)
    return __builtin_assoc_barrier(v);
#endif
#endif
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uvec16 bits = bf16_bits(v) << 16;
    vec16 r;
    std::memcpy(&r, &bits, sizeof(r));
    return r;
  } else {
    T tmp[16];
    store16(tmp, v);
    return load16(tmp);
  }
}

#if defined(__AVX2__)
// 8 elements of a row as 8 floats in one AVX2 register (exact widening).
inline __m256 load8f(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8f(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#if defined(__F16C__)
inline __m256 load8f(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// 8 fp8 bytes as 8 floats (fp8_half_bits on 16-bit lanes, then F16C).
template <typename F8>
inline __m256 load8f_fp8(const F8* p) {
  const bool e4m3 = is_fp8_e4m3(p);
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));  // 8 used
  const __m256 f = _mm256_cvtph_ps(_mm256_castsi256_si128(fp8_half_bits(b, e4m3)));
  return e4m3 ? _mm256_mul_ps(f, _mm256_set1_ps(256.0f)) : f;
}
inline __m256 load8f(const c10::Float8_e5m2* p) { return load8f_fp8(p); }
inline __m256 load8f(const c10::Float8_e4m3fn* p) { return load8f_fp8(p); }
#endif

// Without AVX-512 a vec16 is two AVX2 registers, and GCC lowers the two-input 16-lane shuffles
// of transpose16 and lane_sums16 below to scalar moves (about 2000 and 500 instructions a call),
// so on AVX2 they work on the halves: 8 x 8 transposes and horizontal adds (lane_sums8 also serves
// quant_linear's AVX2 path).
// (Loads and stores of whole registers: a vec16 copied through memcpy went by four 16-byte moves,
// and the 32-byte load after them waited for the stores.)
inline void halves(const vec16& v, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(reinterpret_cast<const float*>(&v));
  hi = _mm256_loadu_ps(reinterpret_cast<const float*>(&v) + 8);
}
inline vec16 joined(__m256 lo, __m256 hi) {
  vec16 v;
  _mm256_storeu_ps(reinterpret_cast<float*>(&v), lo);
  _mm256_storeu_ps(reinterpret_cast<float*>(&v) + 8, hi);
  return v;
}
// r[i][j] and r[j][i] swapped (8 x 8).
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // u[4i + c]: column c (rows 4i .. 4i + 3) and column c + 4
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[c + 4] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}
// The largest and the sum of one register's 8 lanes (halves, then pairs of pairs, then pairs).
inline float max_lanes8(__m256 m) {
  m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
  m = _mm256_max_ps(m, _mm256_permute_ps(m, 0x4E));
  return _mm256_cvtss_f32(_mm256_max_ps(m, _mm256_permute_ps(m, 0xB1)));
}
inline float sum_lanes8(__m256 t) {
  t = _mm256_add_ps(t, _mm256_permute2f128_ps(t, t, 1));
  t = _mm256_add_ps(t, _mm256_permute_ps(t, 0x4E));
  return _mm256_cvtss_f32(_mm256_add_ps(t, _mm256_permute_ps(t, 0xB1)));
}
// Lane j of the result is the sum of v[j]'s 8 lanes (horizontal adds of pairs, then halves).
inline __m256 lane_sums8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}
#endif

// v[i][j] and v[j][i] swapped for every i, j (a 16 x 16 transpose): four rounds of swapping the
// off-diagonal blocks of 8, 4, 2 and 1 lanes between row pairs, two-input shuffles each (AVX2:
// four 8 x 8 transposes, the off-diagonal ones swapped).
inline void transpose16(vec16* v) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  __m256 top[8], bottom[8], right[8], corner[8];  // rows 0-7 / 8-15, columns 0-7 / 8-15
  for (int i = 0; i < 8; ++i) {
    halves(v[i], top[i], right[i]);
    halves(v[i + 8], bottom[i], corner[i]);
  }
  for (__m256* block : {top, bottom, right, corner}) transpose8(block);
  for (int i = 0; i < 8; ++i) {
    v[i] = joined(top[i], bottom[i]);
    v[i + 8] = joined(right[i], corner[i]);
  }
  return;
#endif
  for (int bs = 8; bs >= 1; bs /= 2) {
    ivec16 lo, hi;
    for (int c = 0; c < 16; ++c) {
      lo[c] = (c & bs) ? 16 + c - bs : c;
      hi[c] = (c & bs) ? 16 + c : c + bs;
    }
    for (int i = 0; i < 16; ++i) {
      if (i & bs) continue;
      const vec16 a = v[i], b = v[i + bs];
      v[i] = __builtin_shuffle(a, b, lo);
      v[i + bs] = __builtin_shuffle(a, b, hi);
    }
  }
}

// v's 16 lanes reduced by halves (lanes 8 apart combined, then 4, 2, 1): shuffles, no scalar
// loop, in a fixed order; the sum and the largest.
template <typename F>
inline float halving16(vec16 v, F combine) {
  static const ivec16 kHalves[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                                    {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                                    {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                                    {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
  for (const ivec16& half : kHalves) v = combine(v, __builtin_shuffle(v, half));
  return v[0];
}
inline float halving_sum16(vec16 v) {
  return halving16(v, [](vec16 a, vec16 b) { return a + b; });
}
inline float halving_max16(vec16 v) {
  return halving16(v, [](vec16 a, vec16 b) { return a > b ? a : b; });
}

// Lane j of the result is the sum of v[j]'s 16 lanes (a transpose-and-add tree: 15 adds; AVX2:
// each vector's halves added, then lane_sums8).
inline vec16 lane_sums16(vec16* v) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  __m256 s[16];
  for (int j = 0; j < 16; ++j) {
    __m256 lo, hi;
    halves(v[j], lo, hi);
    s[j] = _mm256_add_ps(lo, hi);
  }
  return joined(lane_sums8(s), lane_sums8(s + 8));
#endif
  const ivec16 lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const ivec16 hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const ivec16 lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const ivec16 hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const ivec16 lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const ivec16 hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const ivec16 lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const ivec16 hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  vec16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo1) + __builtin_shuffle(v[2 * i], v[2 * i + 1], hi1);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo2) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi2);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo3) + __builtin_shuffle(b[2 * i], b[2 * i + 1], hi3);
  return __builtin_shuffle(c[0], c[1], lo4) + __builtin_shuffle(c[0], c[1], hi4);
}

}  // namespace tandem_cpu
