// AVX2 + FMA + F16C 8-lane float vector: the operations the kernels need (vec_generic.h's, lane for lane), compiled
// for those extensions (MOE_TARGET_PUSH) and called only from the variants that have them: moe_avx2.cc,
// moe_avx512.cc (a subset of its target: they inline there), linear_cpu.cc, backward_cpu.cc. x86-64 only.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "target.h"

#if MOE_X86
MOE_TARGET_PUSH(MOE_AVX2_TARGET)
namespace moe {
namespace vec_avx2 {

using V = __m256;

static inline V vzero() { return _mm256_setzero_ps(); }
static inline V vset1(float a) { return _mm256_set1_ps(a); }
static inline V vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a); }
static inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
static inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
static inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
static inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }

static inline __m256i vu8_to_i32(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
// Integer codes minus their per-column offsets z, in int32 (exact), then converted.
using VI = __m256i;
static inline VI viload(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
static inline V vq8_to_f32(const uint8_t* p, VI z) { return _mm256_cvtepi32_ps(_mm256_sub_epi32(vu8_to_i32(p), z)); }
// Symmetric int8 (every offset 128): code - 128 is the code with its top bit flipped, read as int8 (the same values).
static inline V vq8sym_to_f32(const uint8_t* p) {
  const __m128i b = _mm_xor_si128(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), _mm_set1_epi8(-128));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
static inline void vq4_to_f32(const uint8_t* p, VI z, V& lo, V& hi) {  // low nibble: input i, high nibble: i + 1
  const __m256i b = vu8_to_i32(p);
  lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(15)), z));
  hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), z));
}

// e4m3fn bytes -> value * 2^-8, exactly: sign, exponent and mantissa moved into a float16's fields (bias 15 = 7 + 8;
// e4m3 subnormals become float16 subnormals, which F16C converts exactly to normal float32), 0x7f/0xff -> NaN.
static inline V ve4m3_to_f32_div256(const uint8_t* p) {
  const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));  // sign-extended
  __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(static_cast<short>(0xBF80)));
  const __m128i mag = _mm_set1_epi16(0x3F80);
  h = _mm_blendv_epi8(h, _mm_set1_epi16(0x7E00), _mm_cmpeq_epi16(_mm_and_si128(h, mag), mag));
  return _mm256_cvtph_ps(h);
}

// 16 e4m3fn bytes -> their values * 2^-8 as two vectors (bytes 0-7, 8-15), as ve4m3_to_f32_div256 on each half: the
// integer steps once on 16 lanes.
static inline void ve4m3x16_to_f32_div256(const uint8_t* p, V& lo, V& hi) {
  const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));  // sign-extended
  __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
  const __m256i mag = _mm256_set1_epi16(0x3F80);
  h = _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7E00), _mm256_cmpeq_epi16(_mm256_and_si256(h, mag), mag));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// e8m0 scale bytes -> 2^(s - 127) (s = 0: 2^-127, s = 255: NaN), as scalar.h's e8m0_to_f32.
static inline V ve8m0_to_f32(const uint8_t* p) {
  const __m256i s = vu8_to_i32(p);
  V v = _mm256_castsi256_ps(_mm256_slli_epi32(s, 23));
  v = _mm256_blendv_ps(v, _mm256_set1_ps(std::ldexp(1.0f, -127)),
                       _mm256_castsi256_ps(_mm256_cmpeq_epi32(s, _mm256_setzero_si256())));
  return _mm256_blendv_ps(v, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                          _mm256_castsi256_ps(_mm256_cmpeq_epi32(s, _mm256_set1_epi32(255))));
}

// e2m1 codes (in the low 4 bits of int32 lanes) -> float: the permutes read the low 3 bits (the magnitude) of
// a positive and a negative table, the blend takes the sign from bit 3 (moved to bit 31; higher bits shift out).
static inline V e2m1(__m256i c) {
  const V pos = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const V neg = _mm256_setr_ps(-0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(pos, c), _mm256_permutevar8x32_ps(neg, c),
                          _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
}
static inline void ve2m1_to_f32(const uint8_t* p, V& lo, V& hi) {  // low nibble: input i, high nibble: i + 1
  const __m256i b = vu8_to_i32(p);
  lo = e2m1(b);
  hi = e2m1(_mm256_srli_epi32(b, 4));
}

static inline V vbf16_to_f32(const uint8_t* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
static inline V vf16_to_f32(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), as vec_generic.h.
static inline float hsum(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));  // s0 s1 s2 s3
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                            // s0+s2, s1+s3
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
// out[c] = hsum(a[c]) for 8 vectors, by shuffles across registers: each sum is the same three levels of adds as
// hsum's (l_i + l_{i+4}, then s0 + s2 and s1 + s3, then their sum), so the same bits.
static inline void hsum8(const V* a, float* out) {
  V t[4];  // t[k] = [a[2k]'s s0..s3 | a[2k+1]'s s0..s3], s_i = l_i + l_{i+4}
  for (int k = 0; k < 4; ++k)
    t[k] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * k], a[2 * k + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * k], a[2 * k + 1], 0x31));
  V u[2];  // u[k] = [s0+s2, s1+s3 of a[4k], of a[4k+2] | of a[4k+1], of a[4k+3]]
  for (int k = 0; k < 2; ++k)
    u[k] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const V r = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));  // a0 a2 a4 a6 | a1 a3 a5 a7
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

}  // namespace vec_avx2
}  // namespace moe
MOE_TARGET_POP()
#endif  // MOE_X86
