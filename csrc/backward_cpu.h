// What backward_cpu.cc (the FFI handler: routing, the per-token combine) and its per-ISA kernels
// (backward_kernels.inc, compiled once per variant inside backward_cpu.cc) share: one call's work.
#pragma once

#include "moe_job.h"

namespace moe {
namespace bwd {

// The adapters of a backward or training-forward call (lora.h's stacks) and their gradients. With adapters, the
// pairs of an expert are ordered by adapter id, then row (build_pairs): each adapter's rows are one run, its
// gradients products over the run in row order.
struct BwdLoRA {
  LoRAJob adapters;           // targets and the rows' ids (lora.h); its per-pair state is unused here
  std::vector<int> pair_ad;   // [P] each pair's adapter, 0: none
  bool want = false;          // the adapters' gradients are asked for
  float* da[3] = {};          // [n, E, r, in] per target (gate, up, down), null when absent or not wanted
  float* db[3] = {};          // [n, E, out, r]
  float* ds[3] = {};          // [n] the scale's gradient
  std::vector<float> ds_part[3];  // [E, n] each expert's share of ds, summed over experts in order afterwards
};

// One backward call over the routed (row, expert) pairs. A pair is one row and one expert it chose: slots of a
// row with the same expert are one pair, on their summed input scale and summed output weight (the reference's
// semantics, reference_routed). Pairs are grouped by expert (ascending id), in order of their rows inside one.
struct BwdJob {
  int fmt = 0, H = 0, I = 0, E = 0;
  int group = 0, fields_per_proj = 1;  // quantized formats: inputs per scale group (int), fields per projection
  const float* scale2 = nullptr;       // [3, E] NVFP4's per-tensor multipliers
  bool fused = false;  // [out, in] weights (FusedExpertWeights): gate|up [2I, H], down [H, I]
  Activation act;
  // [field * E + e]: gate, up, down ([in, out]); gate|up, down ([out, in]); quantized: each projection's codes,
  // scales (and zero points).
  std::vector<const uint8_t*> field_ptr;
  const float* gate_up_bias = nullptr;    // [E, 2I] or null
  const float* down_bias = nullptr;       // [E, H] or null
  const float* x = nullptr;               // [T, H]
  const float* g = nullptr;               // [T, H] the cotangent of the routed sum
  // [P, 2I] each pair's gate|up before the biases, in pair order: the training forward writes them, the backward
  // reads them instead of recomputing them (null: the backward recomputes them).
  float* residual = nullptr;
  float* pair_y = nullptr;        // [P, H] the training forward's per-pair expert outputs
  // Routing (built by the calling thread).
  std::vector<int> union_ids, pair_start;  // [U], [U + 1]
  std::vector<int> pair_token;             // [P]
  std::vector<float> pair_weight;          // [P] summed output weight
  std::vector<float> pair_scale;           // [P] summed input scale (empty: no in_scale)
  // Per-pair results, combined per token afterwards.
  float* pair_dx = nullptr;       // [P, H] the pair's gradient w.r.t. its token's x (times the input scale)
  float* pair_dout = nullptr;     // [P] <g_t, y_pair>
  float* pair_dscale = nullptr;   // [P] <dxs, x_t> (with in_scale only)
  // Weight gradients (float32, the weights' layout); null pointers when the base is frozen.
  std::vector<float*> dw_ptr;     // [field * E + e]
  float* d_gate_up_bias = nullptr;  // [E, 2I] or null
  float* d_down_bias = nullptr;     // [E, H] or null
  BwdLoRA* lora = nullptr;          // the adapters, or null

  const uint8_t* field(int f, int e) const { return field_ptr[static_cast<size_t>(f) * E + e]; }
  float* dw(int f, int e) const { return dw_ptr.empty() ? nullptr : dw_ptr[static_cast<size_t>(f) * E + e]; }
  int num_fields() const { return fused ? 2 : 3 * fields_per_proj; }
  // Elements of dense field (or projection) f of one expert: every projection is H x I, the fused gate|up two.
  size_t field_size(int f) const { return static_cast<size_t>(fused && f == 0 ? 2 : 1) * H * I; }
};

// The work items of one ISA variant.
struct BwdKernels {
  void (*expert)(const BwdJob&, int u);   // every pair of union expert u, and its weight gradients
  void (*forward)(const BwdJob&, int u);  // the training forward of union expert u: pair_y and residual
  void (*lora_zero)(const BwdJob&, int k, int e);  // zeros for target k's adapter gradients of expert e
};

namespace generic {
const BwdKernels& bwd_kernels();
}  // namespace generic
#if MOE_X86
namespace avx2 {
const BwdKernels& bwd_kernels();
}  // namespace avx2
namespace avx512 {
const BwdKernels& bwd_kernels();
}  // namespace avx512
#endif

}  // namespace bwd
}  // namespace moe
