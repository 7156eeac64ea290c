// The backward of moejax's routed experts as one XLA FFI handler (moejax/backends/native.py, routed_backward):
// for the cotangent g [T, H] of out[t] = Σ_k w[t,k] · E_{idx[t,k]}(s[t,k] · x[t]), the gradients w.r.t. x, the
// slots' output weights and input scales, and (dense float weights) the experts' weights and biases. Quantized
// weights are frozen: input and slot gradients only, through each expert's weights decoded to float32.
//
//   0. (calling thread) the routed (row, expert) pairs, grouped by expert in order of rows: slots with an id
//      outside [0, E) are skipped; a row's slots with the same expert are one pair (summed scale and weight).
//   1. work items of union experts (backward_kernels.inc): per block of the expert's rows, the forward's gate/up
//      (read from the training forward's residual, or recomputed: the same bits), q = g·downᵀ, h = act(gate, up), <g, y> = <h, q> (+ the down bias), the gate/up gradients
//      through the activation's derivative for dh = w·q, the rows' input gradients dxs = dgate·gateᵀ + dup·upᵀ,
//      <dxs, x> for the input scale, and the weight gradients as outer products summed over the expert's rows.
//      The expert's weights are read once per block (in cache for all of its products).
//   2. work items of rows: dx[t] = Σ over the row's pairs in slot order; each slot's weight and scale gradient.
// One thread owns an expert: every gradient is one fixed chain of operations (backward_kernels.inc), so the bits
// do not depend on the threads, and a row's dx not on its neighbours. Weight gradients of experts without pairs
// are zeros.
//
// Adapters (a stack's, lora.h; BwdLoRA): step 0 orders each expert's pairs by adapter id, then row, so the rows of
// one adapter are runs; step 1 adds each run's deltas to its pre-activations (when recomputed), the input gradient
// through them, and, when asked, the adapter's A, B and scale gradients as products over the run, continued in pair
// order by the expert's thread (the scale's summed over experts in expert order afterwards). An (adapter, expert)
// without pairs gets zeros, as id 0 (no adapter).
//
// The training forward (TrainForwardCall, the FFI target moejax_routed_experts_train_forward, run by jax.grad's
// forward) computes the routed sum over the same pairs with the same product routine and saves each pair's gate|up
// [P, 2I] for the backward: its output equals the forward kernels' within float32 rounding (another summation
// order), with the same invariances.
//
// ISA: backward_kernels.inc compiled three times in this file (AVX-512 with 16 lanes, AVX2 + FMA with 8, the
// portable variant), the best the CPU runs chosen per call (MOEJAX_NATIVE_ISA caps it, as for the forward). Every
// value is a chain of per-lane fused multiply-adds in input order, so AVX2 and AVX-512 give the same bits.

#include "backward_cpu.h"

#include <array>
#include <numeric>
#include <utility>

#include "cpu_features.h"
#include "ffi_bind.h"
#include "huge_pages.h"
#include "parallel.h"
#include "target.h"
#include "vec_avx2.h"
#include "vec_avx512.h"
#include "vec_generic.h"

namespace moe {
namespace bwd {

namespace generic {
using namespace vec_generic;
using F = V;
constexpr int L = 8, kNV = 3;
constexpr int kStripRows[kNV] = {4, 4, 4};
static inline F fzero() { return vzero(); }
static inline F fset1(float a) { return vset1(a); }
static inline F fload(const float* p) { return vload(p); }
static inline void fstore(float* p, F a) { vstore(p, a); }
static inline F ffma(F a, F b, F c) { return vfma(a, b, c); }
static inline void fstream(float* p, F a) { vstore(p, a); }
static inline void fence_streams() {}
#include "backward_kernels.inc"
const BwdKernels& bwd_kernels() { return kBwdKernels; }
}  // namespace generic

#if MOE_X86
MOE_TARGET_PUSH(MOE_AVX2_TARGET)
namespace avx2 {
using namespace vec_avx2;
using F = V;
constexpr int L = 8, kNV = 3;
constexpr int kStripRows[kNV] = {4, 4, 4};  // up to 12 accumulators, 3 loads, a broadcast: the 16 registers
static inline F fzero() { return vzero(); }
static inline F fset1(float a) { return vset1(a); }
static inline F fload(const float* p) { return vload(p); }
static inline void fstore(float* p, F a) { vstore(p, a); }
static inline F ffma(F a, F b, F c) { return vfma(a, b, c); }
static inline void fstream(float* p, F a) { _mm256_stream_ps(p, a); }
static inline void fence_streams() { _mm_sfence(); }
#include "backward_kernels.inc"
}  // namespace avx2
MOE_TARGET_POP()
namespace avx2 {
const BwdKernels& bwd_kernels() { return kBwdKernels; }
}  // namespace avx2

MOE_TARGET_PUSH(MOE_AVX512_TARGET)
namespace avx512 {
using namespace vec_avx2;
using namespace vec_avx512;
using F = W;
constexpr int L = 16, kNV = 4;
// Up to 24 accumulators of the 32 registers; 6 x 4 vectors read a third less of B from cache than 4 x 4 (the
// weight gradients and the input gradient at T=2048 ~15% faster), 8 rows x 1 to 3 vectors (the transposed
// products' columns are an expert's rows) ran as fast as 12 x 1 or 2.
constexpr int kStripRows[kNV] = {8, 8, 8, 6};
static inline F fzero() { return wzero(); }
static inline F fset1(float a) { return wset1(a); }
static inline F fload(const float* p) { return wload(p); }
static inline void fstore(float* p, F a) { wstore(p, a); }
static inline F ffma(F a, F b, F c) { return wfma(a, b, c); }
static inline void fstream(float* p, F a) { _mm512_stream_ps(p, a); }
static inline void fence_streams() { _mm_sfence(); }
#include "backward_kernels.inc"
}  // namespace avx512
MOE_TARGET_POP()
namespace avx512 {
const BwdKernels& bwd_kernels() { return kBwdKernels; }
}  // namespace avx512
#endif

// The best variant this CPU runs, capped by MOEJAX_NATIVE_ISA ("avx2", "generic") as the forward's.
static const BwdKernels& best_kernels() {
#if MOE_X86
  const Isa isa = best_isa(Isa::kAvx512);
  if (isa == Isa::kAvx512) return avx512::bwd_kernels();
  if (isa == Isa::kAvx2) return avx2::bwd_kernels();
#endif
  return generic::bwd_kernels();
}

// With adapters: each expert's pairs reordered by adapter id, then row (stable), and slot_pair renumbered.
static void group_by_adapter(BwdJob& job, std::vector<int>& slot_pair) {
  BwdLoRA& L = *job.lora;
  const size_t P = job.pair_token.size();
  std::vector<int> ad(P), order(P), where(P);
  for (size_t p = 0; p < P; ++p) ad[p] = L.adapters.row_id(job.pair_token[p]);
  std::iota(order.begin(), order.end(), 0);
  for (size_t u = 0; u + 1 < job.pair_start.size(); ++u)
    std::stable_sort(order.begin() + job.pair_start[u], order.begin() + job.pair_start[u + 1],
                     [&](int a, int b) { return ad[a] < ad[b]; });
  auto permute = [&](auto& v) {
    auto old = v;
    for (size_t i = 0; i < P; ++i) v[i] = old[order[i]];
  };
  permute(job.pair_token);
  permute(job.pair_weight);
  if (!job.pair_scale.empty()) permute(job.pair_scale);
  L.pair_ad.resize(P);
  for (size_t i = 0; i < P; ++i) {
    L.pair_ad[i] = ad[order[i]];
    where[order[i]] = static_cast<int>(i);
  }
  for (int& p : slot_pair)
    if (p >= 0) p = where[p];
}

// Step 0: the pairs (BwdJob's routing) and each slot's pair (-1: skipped).
static std::vector<int> build_pairs(BwdJob& job, int T, int K, const int32_t* idx, const float* weight,
                                    const float* in_scale) {
  const int E = job.E;
  std::vector<int> slot_first(static_cast<size_t>(T) * K, -1);  // the row's first slot with the same expert
  std::vector<int> count(E, 0);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const size_t s = static_cast<size_t>(t) * K + k;
      const int e = idx[s];
      if (e < 0 || e >= E) continue;
      int first = k;
      for (int j = 0; j < k && first == k; ++j)
        if (idx[static_cast<size_t>(t) * K + j] == e) first = j;
      slot_first[s] = first;
      if (first == k) ++count[e];
    }
  std::vector<int> start(E + 1, 0);
  job.union_ids.clear();
  job.pair_start.assign(1, 0);
  for (int e = 0; e < E; ++e) {
    start[e + 1] = start[e] + count[e];
    if (count[e]) {
      job.union_ids.push_back(e);
      job.pair_start.push_back(start[e + 1]);
    }
  }
  const int P = start[E];
  job.pair_token.assign(P, 0);
  job.pair_weight.assign(P, 0.0f);
  if (in_scale) job.pair_scale.assign(P, 0.0f);
  std::vector<int> slot_pair(static_cast<size_t>(T) * K, -1), next(start.begin(), start.end() - 1);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const size_t s = static_cast<size_t>(t) * K + k;
      if (slot_first[s] < 0) continue;
      const int p = slot_first[s] == k ? next[idx[s]]++ : slot_pair[static_cast<size_t>(t) * K + slot_first[s]];
      slot_pair[s] = p;
      job.pair_token[p] = t;
      job.pair_weight[p] += weight[s];
      if (in_scale) job.pair_scale[p] += in_scale[s];
    }
  if (job.lora) group_by_adapter(job, slot_pair);
  return slot_pair;
}

// The call's shape, format, activation, biases and weights (what the training forward and the backward share);
// idx, weight and in_scale are checked here, read by build_pairs.
static ffi::Error read_call(BwdJob& job, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::S32>& idx,
                            ffi::Buffer<ffi::F32>& weight, ffi::Buffer<ffi::F32>& in_scale,
                            ffi::Buffer<ffi::F32>& gate_up_bias, ffi::Buffer<ffi::F32>& down_bias,
                            ffi::Buffer<ffi::F32>& scale2, ffi::RemainingArgs& weights, int64_t fmt,
                            int64_t num_experts, int64_t intermediate, int64_t group, int64_t fields_per_proj,
                            int64_t per_expert, int64_t act_kind, int64_t has_limit, float limit, float alpha,
                            int64_t clamp_after) {
  const auto xd = x.dimensions(), id = idx.dimensions();
  if (xd.size() != 2 || id.size() != 2 || id[0] != xd[0])
    return ffi::Error::InvalidArgument("moejax native backward: x [T, H], indices [T, K]");
  if (fmt < 0 || fmt >= kNumFormats) return ffi::Error::InvalidArgument("moejax native backward: unknown format");
  const bool quantized = fmt >= kInt8;
  if (quantized && (fields_per_proj < 2 || fields_per_proj > 3))
    return ffi::Error::InvalidArgument("moejax native backward: fields_per_proj must be 2 or 3");
  job.fmt = static_cast<int>(fmt);
  job.fused = fmt >= kFusedF32 && fmt <= kFusedF16;
  job.H = static_cast<int>(xd[1]);
  job.I = static_cast<int>(intermediate);
  job.E = static_cast<int>(num_experts);
  job.group = static_cast<int>(group);
  job.fields_per_proj = quantized ? static_cast<int>(fields_per_proj) : 1;
  if (fmt == kNvfp4) {
    if (scale2.element_count() != static_cast<size_t>(3) * job.E)
      return ffi::Error::InvalidArgument("moejax native backward: NVFP4 needs scale2 [3, E]");
    job.scale2 = scale2.typed_data();
  }
  job.act = Activation{static_cast<int>(act_kind), has_limit != 0, limit, alpha, clamp_after != 0};
  const size_t TK = static_cast<size_t>(id[0]) * id[1], E = job.E;
  if (weight.element_count() != TK || (in_scale.element_count() != 0 && in_scale.element_count() != TK))
    return ffi::Error::InvalidArgument("moejax native backward: out_weight and in_scale must be [T, K]");
  if (gate_up_bias.element_count()) {
    if (gate_up_bias.element_count() != E * 2 * job.I || down_bias.element_count() != E * job.H)
      return ffi::Error::InvalidArgument("moejax native backward: biases must be [E, 2I] and [E, H]");
    job.gate_up_bias = gate_up_bias.typed_data();
    job.down_bias = down_bias.typed_data();
  }
  // Weights: per-expert, field-major [field][expert] buffers; stacked, one [E, ...] buffer per field.
  const size_t nfields = job.num_fields(), nbuf = per_expert ? nfields * E : nfields;
  if (weights.size() != nbuf)
    return ffi::Error::InvalidArgument("moejax native backward: weight buffers do not match the format");
  job.field_ptr.resize(nfields * E);
  const size_t elem = job.fmt == kDenseF32 || job.fmt == kFusedF32 ? 4 : 2;
  for (size_t b = 0; b < nbuf; ++b) {
    auto buf = weights.get<ffi::AnyBuffer>(b);
    if (!buf.has_value()) return buf.error();
    const int f = static_cast<int>(per_expert ? b / E : b);
    const size_t per = quantized ? buf->size_bytes() / (per_expert ? 1 : E) : job.field_size(f) * elem;
    if (!quantized && buf->size_bytes() != per * (per_expert ? 1 : E))
      return ffi::Error::InvalidArgument("moejax native backward: a weight buffer's size does not fit H and I");
    const uint8_t* base = static_cast<const uint8_t*>(buf->untyped_data());
    for (size_t e = 0; e < (per_expert ? 1 : E); ++e) job.field_ptr[per_expert ? b : f * E + e] = base + per * e;
  }
  job.x = x.typed_data();
  return ffi::Error::Success();
}

// The weight gradients' buffers (float32, the weights' buffers' order) into job.dw_ptr.
static ffi::Error read_weight_gradients(BwdJob& job, ffi::RemainingRets& d_weights, int64_t per_expert) {
  const size_t E = job.E, nfields = job.num_fields(), nbuf = per_expert ? nfields * E : nfields;
  if (d_weights.size() != 0 && d_weights.size() != nbuf)
    return ffi::Error::InvalidArgument("moejax native backward: weight gradients do not match the format");
  if (d_weights.size()) job.dw_ptr.resize(nfields * E);
  for (size_t b = 0; b < d_weights.size(); ++b) {
    auto d = d_weights.get<ffi::Buffer<ffi::F32>>(b);
    if (!d.has_value()) return d.error();
    const int f = static_cast<int>(per_expert ? b / E : b);
    const size_t per = job.field_size(f);
    if ((*d)->element_count() != per * (per_expert ? 1 : E))
      return ffi::Error::InvalidArgument("moejax native backward: a weight gradient's size does not fit");
    advise_huge_pages((*d)->typed_data(), (*d)->size_bytes());
    for (size_t e = 0; e < (per_expert ? 1 : E); ++e)
      job.dw_ptr[per_expert ? b : f * E + e] = (*d)->typed_data() + per * e;
  }
  return ffi::Error::Success();
}

// The adapters' arguments (lora.h; ids empty: no adapters, job.lora stays null).
static ffi::Error read_lora(BwdJob& job, BwdLoRA& L, int T, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> gate_a,
                           ffi::Buffer<ffi::F32> gate_b, ffi::Buffer<ffi::F32> gate_s, ffi::Buffer<ffi::F32> up_a,
                           ffi::Buffer<ffi::F32> up_b, ffi::Buffer<ffi::F32> up_s, ffi::Buffer<ffi::F32> down_a,
                           ffi::Buffer<ffi::F32> down_b, ffi::Buffer<ffi::F32> down_s) {
  if (ids.element_count() == 0) return ffi::Error::Success();
  if (ids.element_count() != static_cast<size_t>(T))
    return ffi::Error::InvalidArgument("moejax native backward: adapter ids must be [T] or empty");
  L.adapters.ids = ids.typed_data();
  const int E = job.E, H = job.H, I = job.I;
  for (auto err : {lora_bind_target(L.adapters, kLoRAGate, gate_a, gate_b, gate_s, E, H, I),
                   lora_bind_target(L.adapters, kLoRAUp, up_a, up_b, up_s, E, H, I),
                   lora_bind_target(L.adapters, kLoRADown, down_a, down_b, down_s, E, I, H)})
    if (err.failure()) return err;
  if (L.adapters.n_ids) job.lora = &L;
  return ffi::Error::Success();
}

// The adapters' gradient buffers into L (all empty: not wanted), checked against the stacks.
static ffi::Error read_lora_gradients(BwdJob& job, BwdLoRA& L, std::array<ffi::Result<ffi::Buffer<ffi::F32>>*, 9> d) {
  size_t total = 0;
  for (auto* r : d) total += (**r).element_count();
  if (total == 0) return ffi::Error::Success();
  if (!job.lora) return ffi::Error::InvalidArgument("moejax native backward: adapter gradients without adapters");
  const size_t n = L.adapters.n_ids, E = job.E;
  for (int k = 0; k < 3; ++k) {
    const LoRATarget& t = L.adapters.t[k];
    const size_t want[3] = {t.on() ? n * E * t.r * t.n_in : 0, t.on() ? n * E * t.n_out * t.r : 0, t.on() ? n : 0};
    float** ptr[3] = {&L.da[k], &L.db[k], &L.ds[k]};
    for (int j = 0; j < 3; ++j) {
      auto& buf = *d[3 * k + j];
      if ((*buf).element_count() != want[j])
        return ffi::Error::InvalidArgument("moejax native backward: adapter gradients must fit A, B and scale");
      *ptr[j] = t.on() ? (*buf).typed_data() : nullptr;
    }
    if (t.on()) L.ds_part[k].assign(E * n, 0.0f);
  }
  L.want = true;
  return ffi::Error::Success();
}

static ffi::Error BackwardCall(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> g,
                               ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::F32> weight,
                               ffi::Buffer<ffi::F32> in_scale, ffi::Buffer<ffi::F32> gate_up_bias,
                               ffi::Buffer<ffi::F32> down_bias, ffi::Buffer<ffi::F32> scale2,
                               ffi::Buffer<ffi::F32> residual, ffi::Buffer<ffi::S32> ids,
                               ffi::Buffer<ffi::F32> gate_a, ffi::Buffer<ffi::F32> gate_b,
                               ffi::Buffer<ffi::F32> gate_s, ffi::Buffer<ffi::F32> up_a, ffi::Buffer<ffi::F32> up_b,
                               ffi::Buffer<ffi::F32> up_s, ffi::Buffer<ffi::F32> down_a,
                               ffi::Buffer<ffi::F32> down_b, ffi::Buffer<ffi::F32> down_s,
                               ffi::RemainingArgs weights, ffi::ResultBuffer<ffi::F32> dx,
                               ffi::ResultBuffer<ffi::F32> d_weight, ffi::ResultBuffer<ffi::F32> d_in_scale,
                               ffi::ResultBuffer<ffi::F32> d_gate_up_bias, ffi::ResultBuffer<ffi::F32> d_down_bias,
                               ffi::ResultBuffer<ffi::F32> d_gate_a, ffi::ResultBuffer<ffi::F32> d_gate_b,
                               ffi::ResultBuffer<ffi::F32> d_gate_s, ffi::ResultBuffer<ffi::F32> d_up_a,
                               ffi::ResultBuffer<ffi::F32> d_up_b, ffi::ResultBuffer<ffi::F32> d_up_s,
                               ffi::ResultBuffer<ffi::F32> d_down_a, ffi::ResultBuffer<ffi::F32> d_down_b,
                               ffi::ResultBuffer<ffi::F32> d_down_s, ffi::RemainingRets d_weights, int64_t fmt,
                               int64_t num_experts, int64_t intermediate, int64_t group, int64_t fields_per_proj,
                               int64_t per_expert, int64_t act_kind,
                               int64_t has_limit, float limit, float alpha, int64_t clamp_after,
                               int64_t max_threads) {
  BwdJob job;
  if (ffi::Error err = read_call(job, x, idx, weight, in_scale, gate_up_bias, down_bias, scale2, weights, fmt,
                                 num_experts, intermediate, group, fields_per_proj, per_expert, act_kind, has_limit,
                                 limit, alpha, clamp_after);
      err.failure())
    return err;
  if (g.element_count() != x.element_count())
    return ffi::Error::InvalidArgument("moejax native backward: g must be [T, H]");
  if (fmt >= kInt8 && (d_weights.size() || d_gate_up_bias->element_count()))
    return ffi::Error::InvalidArgument("moejax native backward: quantized weights are frozen (no weight gradient)");
  if (ffi::Error err = read_weight_gradients(job, d_weights, per_expert); err.failure()) return err;
  const int T = static_cast<int>(x.dimensions()[0]), K = static_cast<int>(idx.dimensions()[1]);
  BwdLoRA lora;
  if (ffi::Error err = read_lora(job, lora, T, ids, gate_a, gate_b, gate_s, up_a, up_b, up_s, down_a, down_b, down_s);
      err.failure())
    return err;
  if (ffi::Error err = read_lora_gradients(job, lora, {&d_gate_a, &d_gate_b, &d_gate_s, &d_up_a, &d_up_b, &d_up_s,
                                                       &d_down_a, &d_down_b, &d_down_s});
      err.failure())
    return err;
  const size_t TK = static_cast<size_t>(T) * K, E = job.E, H = job.H;
  const bool has_in_scale = in_scale.element_count() != 0;
  if (d_weight->element_count() != TK || (has_in_scale && d_in_scale->element_count() != TK))
    return ffi::Error::InvalidArgument("moejax native backward: the slots' gradients must be [T, K]");
  if (residual.element_count() != 0 && residual.element_count() != TK * 2 * job.I)
    return ffi::Error::InvalidArgument("moejax native backward: the residual must be [T * K, 2I] or empty");
  if (residual.element_count()) job.residual = residual.typed_data();
  if (job.gate_up_bias && d_gate_up_bias->element_count()) {
    if (d_gate_up_bias->element_count() != E * 2 * job.I || d_down_bias->element_count() != E * H)
      return ffi::Error::InvalidArgument("moejax native backward: bias gradients must be [E, 2I] and [E, H]");
    job.d_gate_up_bias = d_gate_up_bias->typed_data();
    job.d_down_bias = d_down_bias->typed_data();
  }
  job.g = g.typed_data();
  const std::vector<int> slot_pair = build_pairs(job, T, K, idx.typed_data(), weight.typed_data(),
                                                 has_in_scale ? in_scale.typed_data() : nullptr);
  const size_t P = job.pair_token.size(), nfields = job.num_fields();
  std::unique_ptr<float[]> pair_dx(new float[P * H]), pair_dout(new float[P]), pair_dscale(new float[P]);
  advise_huge_pages(pair_dx.get(), P * H * sizeof(float));
  job.pair_dx = pair_dx.get();
  job.pair_dout = pair_dout.get();
  job.pair_dscale = pair_dscale.get();

  const int mt = static_cast<int>(max_threads);
  const BwdKernels& k = best_kernels();
  const int U = static_cast<int>(job.union_ids.size());
  // Experts without pairs: zero gradients (items after the union experts').
  std::vector<int> unused;
  if (!job.dw_ptr.empty() || job.d_gate_up_bias || lora.want)
    for (int e = 0, u = 0; e < job.E; ++e) {
      if (u < U && job.union_ids[u] == e) ++u;
      else unused.push_back(e);
    }
  parallel_for(&pool, U + static_cast<int64_t>(unused.size()), mt, [&](int64_t i) {
    if (i < U) return k.expert(job, static_cast<int>(i));
    const int e = unused[i - U];
    for (size_t f = 0; f < nfields && !job.dw_ptr.empty(); ++f) std::fill_n(job.dw(f, e), job.field_size(f), 0.0f);
    if (job.d_gate_up_bias) {
      std::fill_n(job.d_gate_up_bias + e * 2 * static_cast<size_t>(job.I), 2 * job.I, 0.0f);
      std::fill_n(job.d_down_bias + e * H, H, 0.0f);
    }
    for (int t = 0; t < 3 && lora.want; ++t) k.lora_zero(job, t, e);
  });
  // The scales' gradients: each expert's share, summed over experts in order.
  for (int t = 0; t < 3 && lora.want; ++t) {
    if (!lora.adapters.t[t].on()) continue;
    const size_t n = lora.adapters.n_ids;
    for (size_t a = 0; a < n; ++a) {
      float sum = 0.0f;
      for (size_t e = 0; e < E; ++e) sum = sum + lora.ds_part[t][e * n + a];
      lora.ds[t][a] = sum;
    }
  }
  // Step 2: per row, its pairs in slot order.
  float* dxo = dx->typed_data();
  float* dwo = d_weight->typed_data();
  float* dso = has_in_scale ? d_in_scale->typed_data() : nullptr;
  constexpr int kRows = 8;
  parallel_for(&pool, (T + kRows - 1) / kRows, mt, [&](int64_t i) {
    for (int t = static_cast<int>(i) * kRows; t < std::min(T, static_cast<int>(i + 1) * kRows); ++t) {
      float* d = dxo + static_cast<size_t>(t) * H;
      bool first = true;
      for (int s = 0; s < K; ++s) {
        const size_t slot = static_cast<size_t>(t) * K + s;
        const int p = slot_pair[slot];
        dwo[slot] = p < 0 ? 0.0f : job.pair_dout[p];
        if (dso) dso[slot] = p < 0 ? 0.0f : job.pair_dscale[p];
        bool counted = false;  // an earlier slot of the row with the same pair
        for (int j = 0; j < s && !counted; ++j) counted = slot_pair[static_cast<size_t>(t) * K + j] == p;
        if (p < 0 || counted) continue;
        const float* src = job.pair_dx + static_cast<size_t>(p) * H;
        if (first) std::copy(src, src + H, d);
        else
          for (size_t c = 0; c < H; ++c) d[c] += src[c];
        first = false;
      }
      if (first) std::fill(d, d + H, 0.0f);
    }
  });
  return ffi::Error::Success();
}

// The training forward: out = the routed sum (as the forward kernels define it, in the backward's products: the
// same values within float32 rounding) and each pair's gate|up, the residual the backward reads. The combine is
// the forward kernels': per row and column, acc + w_k · y_k over the slots in order, slots of weight 0 skipped.
static ffi::Error TrainForwardCall(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> idx,
                                   ffi::Buffer<ffi::F32> weight, ffi::Buffer<ffi::F32> in_scale,
                                   ffi::Buffer<ffi::F32> gate_up_bias, ffi::Buffer<ffi::F32> down_bias,
                                   ffi::Buffer<ffi::F32> scale2, ffi::Buffer<ffi::S32> ids,
                                   ffi::Buffer<ffi::F32> gate_a, ffi::Buffer<ffi::F32> gate_b,
                                   ffi::Buffer<ffi::F32> gate_s, ffi::Buffer<ffi::F32> up_a,
                                   ffi::Buffer<ffi::F32> up_b, ffi::Buffer<ffi::F32> up_s,
                                   ffi::Buffer<ffi::F32> down_a, ffi::Buffer<ffi::F32> down_b,
                                   ffi::Buffer<ffi::F32> down_s, ffi::RemainingArgs weights,
                                   ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> residual,
                                   int64_t fmt, int64_t num_experts, int64_t intermediate, int64_t group,
                                   int64_t fields_per_proj, int64_t per_expert, int64_t act_kind, int64_t has_limit,
                                   float limit, float alpha, int64_t clamp_after, int64_t max_threads) {
  BwdJob job;
  if (ffi::Error err = read_call(job, x, idx, weight, in_scale, gate_up_bias, down_bias, scale2, weights, fmt,
                                 num_experts, intermediate, group, fields_per_proj, per_expert, act_kind, has_limit,
                                 limit, alpha, clamp_after);
      err.failure())
    return err;
  const int T = static_cast<int>(x.dimensions()[0]), K = static_cast<int>(idx.dimensions()[1]);
  const size_t TK = static_cast<size_t>(T) * K, H = job.H, I2 = 2 * static_cast<size_t>(job.I);
  if (out->element_count() != x.element_count() || residual->element_count() != TK * I2)
    return ffi::Error::InvalidArgument("moejax native training forward: out [T, H], residual [T * K, 2I]");
  BwdLoRA lora;
  if (ffi::Error err = read_lora(job, lora, T, ids, gate_a, gate_b, gate_s, up_a, up_b, up_s, down_a, down_b, down_s);
      err.failure())
    return err;
  const std::vector<int> slot_pair = build_pairs(job, T, K, idx.typed_data(), weight.typed_data(),
                                                 in_scale.element_count() ? in_scale.typed_data() : nullptr);
  const size_t P = job.pair_token.size();
  std::unique_ptr<float[]> pair_y(new float[P * H]);
  advise_huge_pages(pair_y.get(), P * H * sizeof(float));
  job.pair_y = pair_y.get();
  job.residual = residual->typed_data();
  advise_huge_pages(job.residual, residual->size_bytes());
  std::fill(job.residual + P * I2, job.residual + TK * I2, 0.0f);  // rows of no pair: defined bits
  const int mt = static_cast<int>(max_threads);
  const BwdKernels& k = best_kernels();
  parallel_for(&pool, static_cast<int64_t>(job.union_ids.size()), mt,
               [&](int64_t i) { k.forward(job, static_cast<int>(i)); });
  const float* w = weight.typed_data();
  float* o = out->typed_data();
  constexpr int kRows = 8;
  parallel_for(&pool, (T + kRows - 1) / kRows, mt, [&](int64_t i) {
    for (int t = static_cast<int>(i) * kRows; t < std::min(T, static_cast<int>(i + 1) * kRows); ++t) {
      float* d = o + static_cast<size_t>(t) * H;
      std::fill(d, d + H, 0.0f);
      for (int s = 0; s < K; ++s) {
        const size_t slot = static_cast<size_t>(t) * K + s;
        const int p = slot_pair[slot];
        if (p < 0 || w[slot] == 0.0f) continue;
        const float* y = job.pair_y + static_cast<size_t>(p) * H;
        for (size_t c = 0; c < H; ++c) d[c] = d[c] + w[slot] * y[c];
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace bwd
}  // namespace moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoejaxRoutedExpertsBackward, moe::NoThrow<moe::bwd::BackwardCall>::Call,
    moe::BindExpertsAttrs(
        moe::BindLoRAArgs(moe::BindRoutingArgs(ffi::Ffi::Bind()
                                                   .Ctx<ffi::ThreadPool>()
                                                   .Arg<ffi::Buffer<ffi::F32>>()   // x [T, H]
                                                   .Arg<ffi::Buffer<ffi::F32>>())  // g [T, H]
                              .Arg<ffi::Buffer<ffi::F32>>())  // residual [T * K, 2I] or [0]: recompute
            .RemainingArgs()               // the weight buffers
            .Ret<ffi::Buffer<ffi::F32>>()  // dx [T, H]
            .Ret<ffi::Buffer<ffi::F32>>()  // d out_weight [T, K]
            .Ret<ffi::Buffer<ffi::F32>>()  // d in_scale [T, K] or [0]
            .Ret<ffi::Buffer<ffi::F32>>()  // d gate|up bias [E, 2I] or [0]
            .Ret<ffi::Buffer<ffi::F32>>()  // d down bias [E, H] or [0]
            .Ret<ffi::Buffer<ffi::F32>>()  // d gate A [n, E, r, H] or [0]: the adapters' gradients (none: frozen)
            .Ret<ffi::Buffer<ffi::F32>>()  // d gate B [n, E, I, r] or [0]
            .Ret<ffi::Buffer<ffi::F32>>()  // d gate scale [n] or [0]
            .Ret<ffi::Buffer<ffi::F32>>()  // d up A
            .Ret<ffi::Buffer<ffi::F32>>()  // d up B
            .Ret<ffi::Buffer<ffi::F32>>()  // d up scale
            .Ret<ffi::Buffer<ffi::F32>>()  // d down A [n, E, r, I] or [0]
            .Ret<ffi::Buffer<ffi::F32>>()  // d down B [n, E, H, r] or [0]
            .Ret<ffi::Buffer<ffi::F32>>()  // d down scale
            .RemainingRets()));            // the weight gradients (none: base frozen)

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxRoutedExpertsTrainForward, moe::NoThrow<moe::bwd::TrainForwardCall>::Call,
                              moe::BindExpertsAttrs(moe::BindLoRAArgs(moe::BindExpertsArgs())
                                                        .RemainingArgs()                // the weight buffers
                                                        .Ret<ffi::Buffer<ffi::F32>>()   // out [T, H]
                                                        .Ret<ffi::Buffer<ffi::F32>>()));  // residual [T * K, 2I]
