// Portable 8-lane float vector (any CPU, aarch64 included): the operations the kernels need (kernels.inc,
// lora_kernels.inc, linear_kernel.inc, backward_kernels.inc), as plain loops that the compiler may vectorize with
// the baseline ISA. The portable variants take them with `using namespace vec_generic`.
// Compiled with -ffp-contract=off, so the order is the code's. vfma: where the target has a fused multiply-add
// instruction (aarch64; x86-64 only when built with FMA, which the portable build is not) std::fma, one rounding as
// the AVX2 and AVX-512 variants' FMA: the same bits as theirs. On x86-64 without it, a product then a sum (two
// roundings): std::fma would be a C library call per lane there (~8x the time of the whole kernel, and an
// emulation on the CPUs this variant serves, those without AVX2/FMA), so this variant gives other bits, within
// float32 rounding, than the two others.
#pragma once

#if defined(__aarch64__) || defined(__FMA__) || defined(__FP_FAST_FMAF)
#define MOE_GENERIC_FUSED 1
#else
#define MOE_GENERIC_FUSED 0
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

#include "scalar.h"

namespace moe {
namespace vec_generic {

struct V {
  float f[8];
};

static inline V vzero() { return V{{0, 0, 0, 0, 0, 0, 0, 0}}; }
static inline V vset1(float a) { return V{{a, a, a, a, a, a, a, a}}; }
static inline V vload(const float* p) {
  V r;
  std::memcpy(r.f, p, sizeof(r.f));
  return r;
}
static inline void vstore(float* p, V a) { std::memcpy(p, a.f, sizeof(a.f)); }

#define MOE_LANEWISE(expr)  \
  V r;                      \
  for (int l = 0; l < 8; ++l) r.f[l] = (expr); \
  return r

static inline V vadd(V a, V b) { MOE_LANEWISE(a.f[l] + b.f[l]); }
static inline V vsub(V a, V b) { MOE_LANEWISE(a.f[l] - b.f[l]); }
static inline V vmul(V a, V b) { MOE_LANEWISE(a.f[l] * b.f[l]); }
#if MOE_GENERIC_FUSED
static inline V vfma(V a, V b, V c) { MOE_LANEWISE(std::fma(a.f[l], b.f[l], c.f[l])); }
#else
static inline V vfma(V a, V b, V c) { MOE_LANEWISE(a.f[l] * b.f[l] + c.f[l]); }
#endif

// Integer codes minus their per-column offsets z (exact).
struct VI {
  int32_t i[8];
};
static inline VI viload(const int32_t* p) {
  VI r;
  std::memcpy(r.i, p, sizeof(r.i));
  return r;
}
static inline V vq8_to_f32(const uint8_t* p, VI z) {
  MOE_LANEWISE(static_cast<float>(static_cast<int32_t>(p[l]) - z.i[l]));
}
static inline V vq8sym_to_f32(const uint8_t* p) { MOE_LANEWISE(static_cast<float>(static_cast<int32_t>(p[l]) - 128)); }
static inline void vq4_to_f32(const uint8_t* p, VI z, V& lo, V& hi) {  // low nibble: input i, high nibble: i + 1
  for (int l = 0; l < 8; ++l) {
    lo.f[l] = static_cast<float>((p[l] & 15) - z.i[l]);
    hi.f[l] = static_cast<float>((p[l] >> 4) - z.i[l]);
  }
}
static inline void ve2m1_to_f32(const uint8_t* p, V& lo, V& hi) {
  for (int l = 0; l < 8; ++l) {
    lo.f[l] = e2m1_to_f32(p[l] & 15);
    hi.f[l] = e2m1_to_f32(p[l] >> 4);
  }
}
// e4m3fn value * 2^-8 (exact: the smallest subnormal 2^-9 becomes 2^-17), as the AVX2 variant's.
static inline V ve4m3_to_f32_div256(const uint8_t* p) { MOE_LANEWISE(e4m3_to_f32(p[l]) * (1.0f / 256.0f)); }
static inline void ve4m3x16_to_f32_div256(const uint8_t* p, V& lo, V& hi) {  // 16 bytes: two ve4m3_to_f32_div256
  lo = ve4m3_to_f32_div256(p);
  hi = ve4m3_to_f32_div256(p + 8);
}
static inline V ve8m0_to_f32(const uint8_t* p) { MOE_LANEWISE(e8m0_to_f32(p[l])); }
static inline V vbf16_to_f32(const uint8_t* p) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  MOE_LANEWISE(bf16_to_f32(h[l]));
}
static inline V vf16_to_f32(const uint8_t* p) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  MOE_LANEWISE(f16_to_f32(h[l]));
}
#undef MOE_LANEWISE

// Sum of the lanes in the fixed tree of the AVX2 variant: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
static inline float hsum(V a) {
  const float s0 = a.f[0] + a.f[4], s1 = a.f[1] + a.f[5], s2 = a.f[2] + a.f[6], s3 = a.f[3] + a.f[7];
  return (s0 + s2) + (s1 + s3);
}
// out[c] = hsum(a[c]) for 8 vectors (vec_avx2.inc does it across registers, with the same adds).
static inline void hsum8(const V* a, float* out) {
  for (int c = 0; c < 8; ++c) out[c] = hsum(a[c]);
}

}  // namespace vec_generic
}  // namespace moe
