// Exact scalar decoders of the weight formats, to float32 (the vector decoders of vec_generic.h, vec_avx2.h and
// vec_avx512.h match them lane by lane).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace moe {

static inline float bits_f32(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
static inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }
static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const int exp = (h >> 10) & 31;
  const uint32_t man = h & 1023;
  float v;
  if (exp == 0) v = static_cast<float>(man) * (1.0f / 16777216.0f);  // man * 2^-24
  else if (exp == 31) v = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  else v = bits_f32((static_cast<uint32_t>(exp + 112) << 23) | (man << 13));
  return sign ? -v : v;
}
static inline float e4m3_to_f32(uint8_t b) {
  const int mag = b & 0x7f;
  float v;
  if (mag == 0x7f) v = std::numeric_limits<float>::quiet_NaN();
  else if (mag < 8) v = static_cast<float>(mag) * (1.0f / 512.0f);  // subnormal: m * 2^-9
  else v = bits_f32((static_cast<uint32_t>(mag) << 20) + (120u << 23));
  return (b & 0x80) ? -v : v;
}
static inline float e2m1_to_f32(int c) {
  static const float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  return (c & 8) ? -kMag[c & 7] : kMag[c & 7];
}
static inline float e8m0_to_f32(uint8_t s) {
  if (s == 255) return std::numeric_limits<float>::quiet_NaN();
  if (s == 0) return std::ldexp(1.0f, -127);
  return bits_f32(static_cast<uint32_t>(s) << 23);
}

}  // namespace moe
