// LoRA adapters inside the routed-experts call (moejax/lora.py's math), the ISA-independent part: the stacked
// arrays of one call, their checks, and the per-pair state. The kernels are lora_kernels.inc (once per ISA).
//
// A stack holds n_ids adapters (id 0 = none, all zeros) for gate, up and down, any of them absent:
//   A [n_ids, E, r, in], B [n_ids, E, out, r], scale [n_ids], float32 (moejax.lora.stack's layout).
// Each row names its adapter (ids [T] int32; ids outside [0, n_ids) are 0, as moejax.lora.clamp_ids). A (row,
// expert) pair with adapter a != 0 gets, per target, delta[c] = Σ_j u_j · B[a, e][c, j] with
// u = s[a] · (in · A[a, e]ᵀ) (`in`: the pair's input for gate and up, its activation h for down):
//   * phase 0b (after the routing): u of gate and up for every pair with an adapter;
//   * gate/up items add the gate and up deltas to their columns' projections (before the bias and the activation);
//   * phase 1b (after gate/up): u of down from the pair's h;
//   * down items add the down delta after the bias, before the slot combine.
// Pairs with adapter 0 are never touched: their bits are the no-adapter kernel's. Two rows share a pair only if
// their inputs and their adapters are equal (phase 0). Every u_j and every delta[c] is one fixed chain
// (lora_kernels.inc), so a row's bits do not depend on T, its position, its neighbours or their adapters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe {

struct LoRATarget {
  const float* a = nullptr;      // [n_ids, E, r, n_in]; null: the target is absent
  const float* b = nullptr;      // [n_ids, E, n_out, r]
  const float* scale = nullptr;  // [n_ids]
  int r = 0, rp = 0;             // rank; rank rounded up to 8 (the row stride of u, zero-padded)
  int n_in = 0, n_out = 0;

  bool on() const { return a != nullptr; }
  const float* A(int ad, int e, int E) const {
    return a + (static_cast<size_t>(ad) * E + e) * static_cast<size_t>(r) * n_in;
  }
  const float* B(int ad, int e, int E) const {
    return b + (static_cast<size_t>(ad) * E + e) * static_cast<size_t>(n_out) * r;
  }
};

enum LoRAProj : int { kLoRAGate = 0, kLoRAUp = 1, kLoRADown = 2 };

// The adapters of one call and the per-pair state the phases share.
struct LoRAJob {
  int n_ids = 0;
  const int32_t* ids = nullptr;  // [T] the rows' adapter ids
  LoRATarget t[3];               // gate, up, down (LoRAProj)
  std::vector<int> pair_ad;      // [P] the adapter of each (expert, row) pair, 0: none
  std::vector<float> u[3];       // [P, rp] per target: s · (in · Aᵀ), zero past r

  int row_id(int row) const {
    const int32_t a = ids[row];
    return a >= 0 && a < n_ids ? a : 0;
  }
  // Sized for P pairs once the routing is known (pair_ad filled by build_routing).
  void prepare(size_t P) {
    for (int k = 0; k < 3; ++k) u[k].assign(t[k].on() ? P * t[k].rp : 0, 0.0f);
  }
};

// The per-ISA phase items (lora_kernels.inc): u of gate and up, u of down, for the pairs of union expert u.
struct Job;
struct LoRAKernels {
  void (*gate_up_inputs)(const Job&, int u);
  void (*down_inputs)(const Job&, int u);
  // One row's delta of a target without experts (E = 1): the router's logits, the shared expert's sigmoid gate.
  void (*row_delta)(const LoRATarget& t, int ad, const float* x, float* u, float* out);
};

// Binds target k from its FFI buffers (all three empty: absent) and checks their shapes against the call's.
// `what` names the target in errors (default: gate, up or down by k).
static inline ffi::Error lora_bind_target(LoRAJob& L, int k, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                                          ffi::Buffer<ffi::F32> s, int E, int n_in, int n_out,
                                          const char* what = nullptr) {
  static const char* kNames[3] = {"gate", "up", "down"};
  const std::string name = std::string("moejax native lora: ") + (what ? what : kNames[k]);
  if (a.element_count() == 0 && b.element_count() == 0 && s.element_count() == 0) return ffi::Error::Success();
  const auto ad = a.dimensions(), bd = b.dimensions(), sd = s.dimensions();
  if (ad.size() != 4 || bd.size() != 4 || sd.size() != 1)
    return ffi::Error::InvalidArgument(name + ": A [n, E, r, in], B [n, E, out, r], scale [n]");
  const int64_t n = ad[0], r = ad[2];
  if (ad[1] != E || ad[3] != n_in || bd[0] != n || bd[1] != E || bd[2] != n_out || bd[3] != r || sd[0] != n)
    return ffi::Error::InvalidArgument(name + ": A, B or scale do not fit E, in, out or each other");
  if (L.n_ids && n != L.n_ids) return ffi::Error::InvalidArgument(name + ": targets hold different adapter counts");
  if (n < 1 || r < 1) return ffi::Error::InvalidArgument(name + ": empty stack or rank 0");
  L.n_ids = static_cast<int>(n);
  LoRATarget& t = L.t[k];
  t.a = a.typed_data();
  t.b = b.typed_data();
  t.scale = s.typed_data();
  t.r = static_cast<int>(r);
  t.rp = (t.r + 7) / 8 * 8;
  t.n_in = n_in;
  t.n_out = n_out;
  return ffi::Error::Success();
}

}  // namespace moe
