// AVX-512 (F, BW, DQ, VL) vector operations: a 16-lane W beside vec_avx2.h's 8-lane V (which the AVX-512 variant
// takes too: inlined into its functions, compiled with EVEX encodings and 32 vector registers). W serves the
// [in, out] kernels, whose lanes are columns: a W holds the columns of two adjacent V's, each lane the same chain
// of operations as in V (a per-lane FMA is one rounding either way, the decoders are exact), so this variant's
// results equal the AVX2 variant's bit for bit. x86-64 only.
#pragma once

#include <cstdint>
#include <limits>

#include "target.h"
#include "vec_avx2.h"

#if MOE_X86
MOE_TARGET_PUSH(MOE_AVX512_TARGET)
namespace moe {
namespace vec_avx512 {

using vec_avx2::V;

using W = __m512;
using WI = __m512i;

static inline W wzero() { return _mm512_setzero_ps(); }
static inline W wset1(float a) { return _mm512_set1_ps(a); }
static inline W wload(const float* p) { return _mm512_loadu_ps(p); }
static inline void wstore(float* p, W a) { _mm512_storeu_ps(p, a); }
static inline W wadd(W a, W b) { return _mm512_add_ps(a, b); }
static inline W wmul(W a, W b) { return _mm512_mul_ps(a, b); }
static inline W wfma(W a, W b, W c) { return _mm512_fmadd_ps(a, b, c); }
static inline WI wiload(const int32_t* p) { return _mm512_loadu_si512(p); }
static inline WI wiset1(int32_t a) { return _mm512_set1_epi32(a); }

static inline __m512i wu8_to_i32(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// Integer codes minus their per-column offsets z, in int32 (exact), then converted (as vq8_to_f32 / vq4_to_f32).
static inline W wq8_to_f32(const uint8_t* p, WI z) { return _mm512_cvtepi32_ps(_mm512_sub_epi32(wu8_to_i32(p), z)); }
// Symmetric int8 (every offset 128): the code with its top bit flipped, sign-extended (one 128-bit xor instead of
// a 512-bit subtraction; the same values).
static inline W wq8sym_to_f32(const uint8_t* p) {
  const __m128i b = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), _mm_set1_epi8(-128));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
static inline void wq4_to_f32(const uint8_t* p, WI z, W& lo, W& hi) {  // low nibble: input i, high nibble: i + 1
  const __m512i b = wu8_to_i32(p);
  lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(b, _mm512_set1_epi32(15)), z));
  hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), z));
}
// Symmetric int4 (every offset 8): code - 8 by one permute of the table -8..7 per nibble (the same exact values).
static inline void wq4sym_to_f32(const uint8_t* p, W& lo, W& hi) {
  const W table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i b = wu8_to_i32(p);
  lo = _mm512_permutexvar_ps(b, table);  // the index's low 4 bits: the low nibble
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}
// e2m1 codes: one permute of the 16-entry table (the index's low 4 bits are the code; bit 3 the sign).
static inline void we2m1_to_f32(const uint8_t* p, W& lo, W& hi) {
  const W table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f,
                                 -3.0f, -4.0f, -6.0f);
  const __m512i b = wu8_to_i32(p);
  lo = _mm512_permutexvar_ps(b, table);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}
// 16 e4m3fn bytes -> their values * 2^-8 (ve4m3x16_to_f32_div256's integer steps, then one conversion of 16 float16s).
static inline W we4m3_to_f32_div256(const uint8_t* p) {
  const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));  // sign-extended
  __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
  const __m256i mag = _mm256_set1_epi16(0x3F80);
  h = _mm256_mask_mov_epi16(h, _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, mag), mag), _mm256_set1_epi16(0x7E00));
  return _mm512_cvtph_ps(h);
}
// 16 e8m0 scale bytes -> 2^(s - 127) (s = 0: 2^-127, s = 255: NaN), as vec_avx2.h's ve8m0_to_f32 on each half.
static inline W we8m0_to_f32(const uint8_t* p) {
  const __m512i s = wu8_to_i32(p);
  W v = _mm512_castsi512_ps(_mm512_slli_epi32(s, 23));
  v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(s, _mm512_setzero_si512()), _mm512_set1_ps(0x1p-127f));
  return _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(s, _mm512_set1_epi32(255)),
                            _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}
static inline W wbf16_to_f32(const uint8_t* p) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
// Four rows' 8 bfloat16s each (at p0..p3), one row per 128-bit lane, split by parity: each 32-bit
// lane holds inputs 2k (low half) and 2k + 1 (high half), so even = lane << 16 and odd = lane with its low half
// cleared give lane group g's inputs 0, 2, 4, 6 and 1, 3, 5, 7 as float32 (exact), without a cross-lane widening
// (the four loads go into one register by inserts, which run beside the FMAs on either vector port).
static inline void wbf16_quad_to_f32(const uint8_t* p0, const uint8_t* p1, const uint8_t* p2, const uint8_t* p3,
                                     W& even, W& odd) {
  __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0)));
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p2)), 2);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p3)), 3);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// The 4 floats at p in every 128-bit lane.
static inline W wbroadcast4(const float* p) { return _mm512_broadcast_f32x4(_mm_loadu_ps(p)); }
static inline W wf16_to_f32(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// [lo | hi]: two V's side by side (the many-row [out, in] kernel's output pairs).
static inline W wpair(V lo, V hi) { return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1); }
// lo, hi = a's 8-lane halves (wpair's inverse).
static inline void whalves(W a, V& lo, V& hi) {
  lo = _mm512_castps512_ps256(a);
  hi = _mm512_extractf32x8_ps(a, 1);
}
// The 8 floats at p in both halves.
static inline W wbroadcast8(const float* p) { return _mm512_broadcast_f32x8(_mm256_loadu_ps(p)); }

}  // namespace vec_avx512
}  // namespace moe
MOE_TARGET_POP()
#endif  // MOE_X86
