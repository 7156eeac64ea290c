// What moe_cpu.cc (the FFI handlers) and the per-ISA kernel files (moe_generic.cc, moe_avx2.cc, moe_avx512.cc)
// share: the formats, the activation, the weights' views, the scratch buffers, the adapters' and int8 inputs'
// state and the Job one call's work items read, and the per-ISA tables. Separate translation units, so the kernel
// variants compile side by side (setup.py): the first two together were one ~55 s compile.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "act8.h"
#include "cpu_features.h"
#include "lora.h"
#include "scalar.h"
#include "target.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe {

// Weight formats; the Python side (moejax/backends/native.py) uses the same numbers.
enum Format : int {
  kDenseF32 = 0,   // [in, out] gate, up, down (moejax.weights.ExpertWeights)
  kDenseBF16 = 1,
  kDenseF16 = 2,
  kFusedF32 = 3,   // [out, in] gate|up fused, down (moejax.weights.FusedExpertWeights)
  kFusedBF16 = 4,
  kFusedF16 = 5,
  kInt8 = 6,       // moejax.quantized: [in, out] codes, scales per group of inputs
  kInt4 = 7,
  kFp8 = 8,
  kMxfp4 = 9,
  kNvfp4 = 10,
  kNumFormats = 11,
};

enum ActKind : int { kSilu = 0, kGeluTanh = 1, kGptOss = 2 };

struct Activation {
  int kind = kSilu;
  bool has_limit = false;
  float limit = 0.0f;
  float alpha = 1.702f;
  bool clamp_after = false;  // min(act(g), L) (Step-3.7) instead of act(min(g, L)) (DeepSeek-V4)
};

static inline float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }
static inline float silu(float z) { return z * sigmoid(z); }
static inline float gelu_tanh(float z) {
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  return z * (0.5f * (1.0f + std::tanh(k * (z + 0.044715f * (z * z * z)))));
}

// pallas_kernels/activations.py's GatedActivation, element by element.
static inline float activation(const Activation& a, float g, float u) {
  if (a.kind == kGptOss) {
    g = std::min(g, a.limit);
    u = std::min(std::max(u, -a.limit), a.limit);
    return (u + 1.0f) * (g * sigmoid(a.alpha * g));
  }
  float (*f)(float) = a.kind == kSilu ? silu : gelu_tanh;
  if (!a.has_limit) return f(g) * u;
  u = std::min(std::max(u, -a.limit), a.limit);
  if (a.clamp_after) return std::min(f(g), a.limit) * u;
  return f(std::min(g, a.limit)) * u;
}

// A read prefetch into all cache levels (never faults, whatever the address).
static inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
// A read prefetch into the L2 (and outer) caches, not the L1 (x86: prefetcht1).
static inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// Whether the one-row kernels prefetch float32 weight streams in software (the quantized and 16-bit ones always
// do). On the Intel Xeon measured (AVX-512) float32 decode ran 18-27% faster without (the hardware
// streamers keep up with a few wide streams; the hints only add fill-buffer traffic) while the other formats ran
// 1.4-1.7x slower without theirs; on the AMD EPYC (Zen 3) the prefetch was measured a gain (0.8x the time). Set at
// load (soft_prefetch_f32_default) and read by the kernels of every variant.
inline bool g_soft_prefetch_f32 = true;
// Whether a one-row kernel of weight format fmt prefetches its weight streams in software.
static inline bool soft_prefetch(int fmt) { return fmt != kDenseF32 || g_soft_prefetch_f32; }
// The AVX-512 variant's int8-activation strips, all with the same integer sums: the 256-bit vpmaddubsw loop of the
// avx2 variant, 512-bit vpdpbusd (AVX-512 VNNI), and vpdpbusd with the 4-bit codes spread by byte permutes (VBMI).
// Set at load to the best the CPU has (a8_strip_best); tests choose lower ones (moe_cpu.cc's set_act8_strip).
#define MOE_A8_STRIPS 1
enum class A8Strip : int { kMaddubs = 0, kVnni = 1, kVbmi = 2 };
inline A8Strip g_act8_strip = A8Strip::kMaddubs;
static inline A8Strip a8_strip_best() {
  const CpuFeatures& f = cpu_features();
  return !f.avx512_vnni ? A8Strip::kMaddubs : f.avx512_vbmi ? A8Strip::kVbmi : A8Strip::kVnni;
}
static inline bool soft_prefetch_f32_default() { return !cpu_features().intel; }

// One [in, out] projection of one expert (moejax.quantized's layout; dense [in, out] uses q and n_in only).
struct InOut {
  const uint8_t* q = nullptr;      // codes (4-bit: [in/2, out] nibble pairs) or dense weights
  const uint8_t* scale = nullptr;  // [in/group, out] (FP8: float32 [ceil(in/128), ceil(out/128)])
  const int8_t* zero = nullptr;    // [in/group, out] asymmetric int only
  float scale2 = 1.0f;             // NVFP4's per-tensor multiplier
  int n_in = 0, n_out = 0, group = 1, scale_cols = 0;
};

// Per-thread scratch buffers, grown on demand.
struct Scratch {
  std::vector<float> buf[5];
  float* get(int i, size_t n) {
    if (buf[i].size() < n) buf[i].resize(n);
    return buf[i].data();
  }
};
static inline Scratch& scratch() {  // inline: unused in some of the files that include this header
  static thread_local Scratch s;
  return s;
}

struct Job;

struct Kernels {
  void (*gate_up)(const Job&, int u, int chunk);
  void (*down)(const Job&, int u, int chunk);
  void (*combine)(const Job&, int t0, int t1);
};

// Whether format fmt takes int8 activations (act8.h).
static constexpr bool act8_format(int fmt) { return fmt == kInt8 || fmt == kInt4 || fmt == kMxfp4 || fmt == kNvfp4; }

// The per-ISA phase items (act8_kernels.inc): quantize stored row i of the pairs' x / h (act8.h's Act8Rows); the
// gate/up and down items (Kernels.combine is the float32 one).
struct Act8Kernels {
  void (*gate_up_inputs)(const Job&, int i);
  void (*down_inputs)(const Job&, int i);
  Kernels items;
};

// Everything one call's work items read; built by the calling thread before the parallel phases.
struct Job {
  int fmt = 0, T = 0, K = 0, H = 0, I = 0, E = 0;
  int group = 1, fields_per_proj = 0;
  bool per_expert = true;
  Activation act;
  std::vector<const uint8_t*> field_ptr;  // [field * E + e]
  const float* gate_up_bias = nullptr;    // [E, 2I] or null
  const float* down_bias = nullptr;       // [E, H] or null
  const float* scale2 = nullptr;          // [3, E] (NVFP4)
  // Routing, built in phase 0.
  std::vector<int> union_ids, pair_start;  // [U], [U + 1]
  std::vector<const float*> pair_x, pair_h;  // [P] the input row of each (expert, row) pair, its h row
  std::vector<int> pair_row;               // [P] the distinct input of each pair, numbered in order of first use
  std::vector<int> slot_pair;              // [T * K] the pair of each slot, -1: contributes 0
  const float* slot_weight = nullptr;      // [T * K]
  int chunk_gu = 0, chunk_down = 0;
  float* h = nullptr;    // [P, I]
  float* y = nullptr;    // [P, H]
  float* out = nullptr;  // [T, H]
  LoRAJob* lora = nullptr;  // the adapters of the call (lora.h), or null
  Act8Job* act8 = nullptr;  // the int8 inputs of a call with int8 activations (act8.h), or null

  const uint8_t* field(int f, int e) const { return field_ptr[static_cast<size_t>(f) * E + e]; }

  // Projection p (0 gate, 1 up, 2 down) of expert e in an [in, out] format.
  InOut inout(int p, int e) const {
    InOut w;
    const bool down = p == 2;
    w.n_in = down ? I : H;
    w.n_out = down ? H : I;
    if (fmt <= kDenseF16) {
      w.q = field(p, e);
      w.group = w.n_in;
      return w;
    }
    const int f = p * fields_per_proj;
    w.q = field(f, e);
    w.scale = field(f + 1, e);
    if (fmt == kInt8 || fmt == kInt4) {
      w.group = group > 0 ? group : w.n_in;
      if (fields_per_proj == 3) w.zero = reinterpret_cast<const int8_t*>(field(f + 2, e));
    } else if (fmt == kFp8) {
      w.group = 128;
      w.scale_cols = (w.n_out + 127) / 128;
    } else {
      w.group = fmt == kMxfp4 ? 32 : 16;
      if (fmt == kNvfp4) w.scale2 = scale2[static_cast<size_t>(p) * E + e];
    }
    return w;
  }
};

// The phase items of one ISA variant: the routed experts' kernels (kernels.inc), the adapters' (lora_kernels.inc)
// and the int8 activations' (act8_kernels.inc).
struct IsaTables {
  const Kernels* kernels;  // [kNumFormats]
  const LoRAKernels* lora;
  const Act8Kernels* act8;
};
namespace generic {
const IsaTables& tables();  // moe_generic.cc
}  // namespace generic
#if MOE_X86
namespace avx2 {
const IsaTables& tables();  // moe_avx2.cc
}  // namespace avx2
namespace avx512 {
const IsaTables& tables();  // moe_avx512.cc
}  // namespace avx512
#endif

}  // namespace moe
