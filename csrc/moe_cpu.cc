// moejax's native CPU kernels: the routed experts of one MoE layer call as one XLA FFI handler.
//
// One call computes out[t] = Σ_k w[t,k] · E_{idx[t,k]}(s · x[t]) for all rows:
//   0. (calling thread) the union of the chosen experts and, per union expert, its rows: a row that chose the
//      expert in several slots is computed once, on its summed input scale (Llama-4's form), and rows with
//      bit-identical inputs once; slots with a skipped id (outside [0, E)) or weight 0 contribute exactly 0 and
//      are never computed.
//   1. gate/up -> activation, work items (union expert x chunk of I columns): each union expert's weights are read
//      once per call, for all of its rows.
//   2. down (+ bias), work items (union expert x chunk of H columns).
//   3. the slot-weighted combine in slot order, items of rows.
// Each phase runs on XLA's intra-op thread pool (the FFI's ThreadPool context): the calling thread works too,
// items are handed out by an atomic counter, and the caller waits only for items already started (a scheduled
// task may start late or never before the call ends; one that starts late finds no item and touches nothing).
// The reduction order of every output element is fixed by kernels.inc, independent of T, neighbours and threads.
// int8 activations for 4-bit weights (an explicit option, attribute act_group > 0): act8.h, act8_kernels.inc
// (their items replace 1. and 2., after a phase that quantizes each distinct input row once; a union expert's h
// rows are quantized by the gate/up item that completes them; same order guarantees).
//
// ISA: kernels.inc is compiled three times, as moe::avx512 (moe_avx512.cc: F, BW, DQ, VL), moe::avx2 (moe_avx2.cc:
// AVX2, FMA, F16C) and moe::generic (moe_generic.cc, baseline flags, any CPU); the best variant the CPU runs is
// chosen once at load by cpu_features.h (MOEJAX_NATIVE_ISA=avx2 or generic caps it). Which give the same
// bits (every format, float32 or int8 activations, LoRA): the three run one order of operations (kernels.inc;
// vec_avx512.h's 16 lanes are two of the 8-lane chains) and the same C library calls for the activations (expf,
// tanhf), so
//  * AVX2 and AVX-512 give the same bits;
//  * the portable variant built with a fused multiply-add (aarch64) runs the same operations (vec_generic.h:
//    std::fma, one rounding), so it gives their bits where its C library's expf and tanhf return the x86
//    machine's values (by construction; not measured on aarch64 hardware);
//  * the portable variant built for x86-64 (no FMA: the fallback for CPUs without AVX2/FMA/F16C) rounds each
//    multiply-add twice: other bits, within float32 rounding (~1e-6 relative), except with int8 activations and
//    no adapters, where the multiply-adds are integer sums and all three agree. A float32 value that differs by
//    rounding before an int8 quantization (LoRA deltas beside int8 activations) can move its code by one step.
// The types the four files share: moe_job.h.

#include <Python.h>

#include <mutex>
#include <unordered_map>

#include "ffi_bind.h"
#include "moe_job.h"
#include "parallel.h"

namespace moe {

// The tables of the chosen ISA and its name (set at load; set_isa switches them between calls, for tests).
static std::atomic<const IsaTables*> g_tables{&generic::tables()};
static std::atomic<const char*> g_isa{"generic"};

// The kernels of variant `isa` (built for this target).
static const IsaTables& tables_of(Isa isa) {
#if MOE_X86
  if (isa == Isa::kAvx512) return avx512::tables();
  if (isa == Isa::kAvx2) return avx2::tables();
#endif
  (void)isa;
  return generic::tables();
}

// The best variant this CPU runs, up to `cap` (cpu_features.h's best_isa: MOEJAX_NATIVE_ISA lowers the cap).
static void select_isa(Isa cap) {
  const Isa isa = best_isa(cap);
  g_tables = &tables_of(isa);
  g_isa = isa_name(isa);
}

// -- a call's intermediate buffers ---------------------------------------------------------------------------
// A call's h [P, I] and y [P, H], reused across calls: fresh buffers cost a call the page faults of a new mapping
// (T=2048 of Qwen3-30B-A3B: 184 MB, ~5% of the call when they were also zeroed). Every entry is
// written before it is read (gate/up writes h, down writes y, for every pair), so they are neither cleared nor
// initialized. A call takes a set (a new one while all are taken by concurrent calls) and gives it back on return.
// A set keeps its buffers when they hold at most kRetainedBytes together (decode and small batches: Qwen3-30B-A3B
// up to ~190 rows), else it frees them on return: a prefill's buffers (1 GB for T=32768, K=8, H=I=512) would
// otherwise stay resident for the life of the process, once per concurrent caller, while a prefill pays its
// page faults in any case (a few percent of its time).
constexpr size_t kRetainedBytes = size_t{16} << 20;

class CallBuffers {
 public:
  float* h(size_t n) { return grown(h_, h_size_, n); }
  float* y(size_t n) { return grown(y_, y_size_, n); }
  size_t bytes() const { return (h_size_ + y_size_) * sizeof(float); }
  void trim() {
    if (bytes() <= kRetainedBytes) return;
    h_.reset();
    y_.reset();
    h_size_ = y_size_ = 0;
  }

 private:
  static float* grown(std::unique_ptr<float[]>& v, size_t& size, size_t n) {
    if (size < n) {
      v.reset();  // the old buffer goes before the new one is taken
      size = 0;
      v.reset(new float[n]);  // default-initialized: no memset
      size = n;
    }
#if defined(__SANITIZE_ADDRESS__)  // the sanitizer build: NaN in every entry, so one read before its write shows
    std::fill(v.get(), v.get() + n, std::numeric_limits<float>::quiet_NaN());
#endif
    return v.get();
  }
  std::unique_ptr<float[]> h_, y_;
  size_t h_size_ = 0, y_size_ = 0;
};

class CallBufferLease {
 public:
  CallBufferLease() {
    std::lock_guard<std::mutex> lock(mutex());
    auto& idle = free_sets();
    if (idle.empty()) {
      set_ = std::make_unique<CallBuffers>();
    } else {
      set_ = std::move(idle.back());
      idle.pop_back();
    }
  }
  ~CallBufferLease() {
    set_->trim();  // outside the lock: freeing a large mapping takes a while
    std::lock_guard<std::mutex> lock(mutex());
    free_sets().push_back(std::move(set_));
  }
  CallBufferLease(const CallBufferLease&) = delete;
  CallBufferLease& operator=(const CallBufferLease&) = delete;
  float* h(size_t n) { return set_->h(n); }
  float* y(size_t n) { return set_->y(n); }

  // The idle sets and the bytes they hold (introspection: tests, benchmarks).
  static std::pair<size_t, size_t> idle() {
    std::lock_guard<std::mutex> lock(mutex());
    size_t bytes = 0;
    for (const auto& set : free_sets()) bytes += set->bytes();
    return {free_sets().size(), bytes};
  }

 private:
  // Never destroyed: a call still running while the process exits must not find them gone.
  static std::mutex& mutex() {
    static auto* m = new std::mutex;
    return *m;
  }
  static std::vector<std::unique_ptr<CallBuffers>>& free_sets() {
    static auto* sets = new std::vector<std::unique_ptr<CallBuffers>>;
    return *sets;
  }
  std::unique_ptr<CallBuffers> set_;
};

// -- phase 0 -------------------------------------------------------------------------------------------------
// Earlier rows phase 0 examined as possible copies of a row, over the process (rows_examined(): tests check that
// it grows linearly with T, whatever the routing).
static std::atomic<uint64_t> g_rows_examined{0};

// A hash of a row's bytes: four independent multiply-xor lanes over 8-byte words (one multiply chain per byte would
// cost a prefill more than the lookups it serves). Equal bytes give equal hashes; rows with equal hashes are
// compared byte for byte.
static uint64_t row_hash(const float* row, int H) {
  const unsigned char* b = reinterpret_cast<const unsigned char*>(row);
  const size_t n = static_cast<size_t>(H) * sizeof(float);
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  uint64_t lane[4] = {0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull, 0x082EFA98EC4E6C89ull};
  size_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int l = 0; l < 4; ++l) {
      uint64_t w;
      std::memcpy(&w, b + i + 8 * l, 8);
      lane[l] = (lane[l] ^ w) * kMul;
      lane[l] ^= lane[l] >> 29;
    }
  for (; i + 4 <= n; i += 4) {
    uint32_t w;
    std::memcpy(&w, b + i, 4);
    lane[0] = ((lane[0] ^ w) * kMul) ^ (lane[0] >> 31);
  }
  uint64_t h = n;
  for (uint64_t v : lane) h = ((h ^ v) * kMul) ^ (h >> 32);
  return h;
}

// first[t]: the first row with the bytes of row t (and, with LoRA, its adapter), t itself when none is earlier.
// An open-addressing table of the distinct rows (at most half full), so a row examines O(1) earlier rows on average
// whatever the routing; only rows of equal hash are compared byte for byte.
static std::vector<int> first_copies(const Job& job, const float* x) {
  const int T = job.T, H = job.H;
  size_t cap = 16;
  while (cap < 2 * static_cast<size_t>(T)) cap *= 2;
  std::vector<int> table(cap, -1), first(T);
  std::vector<uint64_t> hash(T);
  uint64_t examined = 0;
  for (int t = 0; t < T; ++t) {
    const float* row = x + static_cast<size_t>(t) * H;
    const int ad = job.lora ? job.lora->row_id(t) : 0;
    hash[t] = row_hash(row, H) ^ (static_cast<uint64_t>(static_cast<uint32_t>(ad)) * 0xD6E8FEB86659FD93ull);
    first[t] = t;
    size_t i = hash[t] & (cap - 1);
    for (; table[i] >= 0; i = (i + 1) & (cap - 1)) {
      const int c = table[i];
      ++examined;
      if (hash[c] == hash[t] && (!job.lora || job.lora->row_id(c) == ad) &&
          std::memcmp(x + static_cast<size_t>(c) * H, row, sizeof(float) * H) == 0) {
        first[t] = c;
        break;
      }
    }
    if (first[t] == t) table[i] = t;
  }
  g_rows_examined.fetch_add(examined, std::memory_order_relaxed);
  return first;
}

// Union experts (ascending id), their rows (ascending t) and each slot's pair. A row that chose an expert in
// several slots is one pair (on the summed input scale of those slots); rows with bit-identical inputs (x and
// scale) and, with LoRA, one adapter share one pair too (8 copies of a token compute one row per expert; by
// construction a row's result does not depend on which pair computes it). scaled: the pairs' s·x rows when
// in_scale is given.
static void build_routing(Job& job, const float* x, const int32_t* idx, const float* weight, const float* in_scale,
                          std::vector<float>& scaled) {
  const int T = job.T, K = job.K, E = job.E, H = job.H;
  const std::vector<int> first = first_copies(job, x);
  std::vector<char> copied(T, 0);  // whether a later row is a copy of this one
  for (int t = 0; t < T; ++t)
    if (first[t] != t) copied[first[t]] = 1;
  struct Rep {
    int t;
    float scale;
  };
  // The pair of (first copy, expert, input scale's bits), for rows with copies only.
  struct PairKey {
    int first, e;
    uint32_t scale;
    bool operator==(const PairKey& o) const { return first == o.first && e == o.e && scale == o.scale; }
  };
  struct PairKeyHash {
    size_t operator()(const PairKey& k) const {
      return static_cast<size_t>(((static_cast<uint64_t>(k.first) << 32 | static_cast<uint32_t>(k.e)) ^
                                  (static_cast<uint64_t>(k.scale) * 0x9E3779B97F4A7C15ull)) *
                                 0xBF58476D1CE4E5B9ull >>
                                 7);
    }
  };
  std::unordered_map<PairKey, int, PairKeyHash> copy_rep;
  std::vector<std::vector<Rep>> reps(E);                  // the distinct inputs of each expert, in order of t
  std::vector<int> slot_rep(static_cast<size_t>(T) * K, -1);  // index into reps[expert], -1: contributes 0
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      const size_t s = static_cast<size_t>(t) * K + k;
      const int e = idx[s];
      if (e < 0 || e >= E || weight[s] == 0.0f) continue;
      int earlier = -1;  // an earlier kept slot of the row with the same expert
      for (int j = 0; j < k && earlier < 0; ++j)
        if (slot_rep[static_cast<size_t>(t) * K + j] >= 0 && idx[static_cast<size_t>(t) * K + j] == e) earlier = j;
      if (earlier >= 0) {
        slot_rep[s] = slot_rep[static_cast<size_t>(t) * K + earlier];
        continue;
      }
      float sc = 1.0f;
      if (in_scale) {  // every valid slot of the row with expert e, whatever its weight (reference_routed)
        sc = 0.0f;
        for (int j = 0; j < K; ++j)
          if (idx[static_cast<size_t>(t) * K + j] == e) sc += in_scale[static_cast<size_t>(t) * K + j];
      }
      std::vector<Rep>& list = reps[e];
      int r = static_cast<int>(list.size());
      if (first[t] != t || copied[t]) {
        uint32_t bits;
        std::memcpy(&bits, &sc, sizeof bits);
        r = copy_rep.emplace(PairKey{first[t], e, bits}, r).first->second;
      }
      if (r == static_cast<int>(list.size())) list.push_back({t, sc});
      slot_rep[s] = r;
    }
  }
  std::vector<int> start(E + 1, 0);
  job.union_ids.clear();
  job.pair_start.assign(1, 0);
  for (int e = 0; e < E; ++e) {
    start[e + 1] = start[e] + static_cast<int>(reps[e].size());
    if (!reps[e].empty()) {
      job.union_ids.push_back(e);
      job.pair_start.push_back(start[e + 1]);
    }
  }
  const int P = start[E];
  job.pair_x.assign(P, nullptr);
  // A pair's distinct input: its row of x (the pairs of one row, or of its copies, read the same), or with input
  // scales its own scaled row.
  job.pair_row.assign(P, -1);
  std::vector<int> row_number(in_scale ? 0 : T, -1);
  int rows = 0;
  if (job.lora) job.lora->pair_ad.assign(P, 0);
  if (in_scale) scaled.resize(static_cast<size_t>(P) * H);
  for (int e = 0; e < E; ++e) {
    for (size_t q = 0; q < reps[e].size(); ++q) {
      const int p = start[e] + static_cast<int>(q);
      const float* row = x + static_cast<size_t>(reps[e][q].t) * H;
      if (job.lora) job.lora->pair_ad[p] = job.lora->row_id(reps[e][q].t);
      if (!in_scale) {
        job.pair_x[p] = row;
        int& number = row_number[reps[e][q].t];
        if (number < 0) number = rows++;
        job.pair_row[p] = number;
        continue;
      }
      job.pair_row[p] = rows++;
      float* dst = scaled.data() + static_cast<size_t>(p) * H;
      for (int i = 0; i < H; ++i) dst[i] = row[i] * reps[e][q].scale;
      job.pair_x[p] = dst;
    }
  }
  job.slot_pair.assign(static_cast<size_t>(T) * K, -1);
  for (size_t s = 0; s < slot_rep.size(); ++s)
    if (slot_rep[s] >= 0) job.slot_pair[s] = start[idx[s]] + slot_rep[s];
}

// Column chunk widths of [in, out] weights: a few strips of kStrip columns (small enough that a layer's items keep
// every thread busy); set_chunks sizes the [out, in] weights' items.
static int chunk_width(int fmt) {
  switch (fmt) {
    case kDenseF32:
      return 128;
    case kDenseBF16:
    case kDenseF16:
      return 256;
    default:
      return 256;
  }
}

// The most rows per union expert, on average, with which a call's [in, out] items are whole rows (set_chunks).
constexpr int kWideRowsPerExpert = 8;

// The column chunks of a call's items, once its routing is known (threads: the threads that take items). Widths
// never change a value's bits (each column's chain is the same in any chunk).
//  * Dense [out, in] weights: the widest items (multiples of 16 outputs, up to a whole projection) that still give
//    every thread >= 8 items. With many rows per union expert (prefill) the kernel packs an item's input rows once
//    (from memory at large T: a cost per item) and prefetches each next tile inside it (a tile that comes cold
//    from memory costs about as much as computing it); with a row or a few (decode) an item's fixed costs (the
//    hand-out, the first lines' latency, the prefetch's restart) are paid per item: 16-output items at one token
//    (1024 down items of 8 KiB for 8 experts of H = 2048, I = 256) took 1.25x the step's time in bfloat16.
//  * Decode and small batches ([in, out] weights, at most kWideRowsPerExpert rows per union expert on average):
//    the widest chunks (multiples of 64 columns) that still give every thread two items per phase, so the one-row
//    kernel (inout_row1) reads whole weight rows, one address-ordered stream per projection, which the prefetchers
//    follow far better than 256-column pieces of rows, and the many-row kernels' K block tiles (inout_matmul, and
//    with int8 activations act8_kernels.inc) are contiguous runs of whole rows, prefetched in address order. Against
//    256-column chunks (Intel Xeon, Emerald Rapids, two threads, benchmarks/native_kernels.py, Qwen3-30B-A3B's
//    experts): one token 1.14-1.38x faster from the L3 and 1.9-2x from memory with int8 activations (the AVX2
//    loops 1.12-1.22x); 4 to 128 tokens of 128 experts from memory (1.3 to 8 rows per union expert) 1.1-1.65x for
//    int8, int4 and int8 activations alike.
//  * Otherwise chunk_width.
static void set_chunks(Job& job, int threads) {
  job.chunk_gu = job.chunk_down = chunk_width(job.fmt);
  const int U = static_cast<int>(job.union_ids.size());
  if (U == 0) return;
  if (job.fmt == kFusedF32 || job.fmt == kFusedBF16 || job.fmt == kFusedF16) {
    auto wide = [&](int n_out) {
      int w = (n_out + 15) / 16 * 16;
      while (w > 16 && static_cast<int64_t>(U) * ((n_out + w - 1) / w) < 8 * static_cast<int64_t>(threads))
        w = (w / 2 + 15) / 16 * 16;
      return w;
    };
    job.chunk_gu = wide(job.I);
    job.chunk_down = wide(job.H);
    return;
  }
  if (job.pair_start[U] > kWideRowsPerExpert * static_cast<int64_t>(U)) return;  // rows per union expert, average
  const int per_expert = std::max(1, (2 * threads + U - 1) / U);  // chunks per expert
  auto width = [&](int n) { return std::max(job.chunk_gu, ((n + per_expert - 1) / per_expert + 63) / 64 * 64); };
  job.chunk_gu = width(job.I);
  job.chunk_down = width(job.H);
}

// The LoRA phase items of the chosen ISA (lora_kernels.inc).
static const LoRAKernels& lora_kernels() { return *g_tables.load(std::memory_order_relaxed)->lora; }

// The int8-activation phase items of the chosen ISA (act8_kernels.inc).
static const Act8Kernels& act8_kernels() { return *g_tables.load(std::memory_order_relaxed)->act8; }

// The progress of one union expert through a call's items: each level is reached by one item, after the level
// before it (a release store; the items that need it wait with an acquire load).
struct UnionProgress {
  enum Level : int { kGateUpInputs = 1, kH = 2, kDownInputs = 3 };
  std::atomic<int> level{0};
  std::atomic<int> chunks_left{0};  // gate/up chunks not yet done

  void reach(int l) { level.store(l, std::memory_order_release); }
  void wait(int l) const {
    wait_until([&] { return level.load(std::memory_order_acquire) >= l; });
  }
};

// The routed experts of one call (MoeExpertsCall), with the adapters of `lora` when it is not null.
static ffi::Error RunExperts(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> idx,
                             ffi::Buffer<ffi::F32> weight, ffi::Buffer<ffi::F32> in_scale,
                             ffi::Buffer<ffi::F32> gate_up_bias, ffi::Buffer<ffi::F32> down_bias,
                             ffi::Buffer<ffi::F32> scale2, ffi::RemainingArgs& weights,
                             ffi::ResultBuffer<ffi::F32>& out, int64_t fmt, int64_t num_experts,
                             int64_t intermediate, int64_t group, int64_t fields_per_proj, int64_t per_expert,
                             int64_t act_kind, int64_t has_limit, float limit, float alpha, int64_t clamp_after,
                             int64_t max_threads, int64_t act_group, LoRAJob* lora) {
  Job job;
  job.lora = lora;
  const auto xd = x.dimensions(), id = idx.dimensions();
  if (xd.size() != 2 || id.size() != 2 || id[0] != xd[0])
    return ffi::Error::InvalidArgument("moejax native: x [T, H], indices [T, K]");
  if (fmt < 0 || fmt >= kNumFormats) return ffi::Error::InvalidArgument("moejax native: unknown format");
  job.fmt = static_cast<int>(fmt);
  job.T = static_cast<int>(xd[0]);
  job.H = static_cast<int>(xd[1]);
  job.K = static_cast<int>(id[1]);
  job.I = static_cast<int>(intermediate);
  job.E = static_cast<int>(num_experts);
  job.group = static_cast<int>(group);
  job.fields_per_proj = static_cast<int>(fields_per_proj);
  job.per_expert = per_expert != 0;
  job.act = Activation{static_cast<int>(act_kind), has_limit != 0, limit, alpha, clamp_after != 0};
  if (weight.element_count() != static_cast<size_t>(job.T) * job.K)
    return ffi::Error::InvalidArgument("moejax native: out_weight must be [T, K]");
  const bool has_in_scale = in_scale.element_count() != 0;
  if (has_in_scale && in_scale.element_count() != static_cast<size_t>(job.T) * job.K)
    return ffi::Error::InvalidArgument("moejax native: in_scale must be [T, K] or empty");
  if (gate_up_bias.element_count()) {
    if (gate_up_bias.element_count() != static_cast<size_t>(job.E) * 2 * job.I ||
        down_bias.element_count() != static_cast<size_t>(job.E) * job.H)
      return ffi::Error::InvalidArgument("moejax native: biases must be [E, 2I] and [E, H]");
    job.gate_up_bias = gate_up_bias.typed_data();
    job.down_bias = down_bias.typed_data();
  }
  if (job.fmt == kNvfp4) {
    if (scale2.element_count() != static_cast<size_t>(3) * job.E)
      return ffi::Error::InvalidArgument("moejax native: NVFP4 needs scale2 [3, E]");
    job.scale2 = scale2.typed_data();
  }
  // Weights: per-expert, field-major [field][expert] buffers; stacked, one [E, ...] buffer per field.
  const size_t nbuf = weights.size();
  const size_t nfields = job.per_expert ? nbuf / job.E : nbuf;
  if (nfields == 0 || (job.per_expert && nbuf % job.E))
    return ffi::Error::InvalidArgument("moejax native: weight buffers do not match the expert count");
  Act8Job act8;  // int8 activations (act8.h): act_group > 0, 4-bit formats only
  if (act_group < 0 || (act_group > 0 && !act8_format(job.fmt)))
    return ffi::Error::InvalidArgument("moejax native: act_group > 0 needs int8, int4, MXFP4 or NVFP4 weights");
  if (act_group > 0) job.act8 = &act8;

  std::vector<float> scaled;
  build_routing(job, x.typed_data(), idx.typed_data(), weight.typed_data(),
                has_in_scale ? in_scale.typed_data() : nullptr, scaled);
  job.slot_weight = weight.typed_data();
  // The weights of the union experts only (per-expert buffers: at decode a few of the E · fields a call passes).
  job.field_ptr.assign(nfields * job.E, nullptr);
  for (size_t f = 0; f < nfields; ++f) {
    if (job.per_expert) {
      for (const int e : job.union_ids) {
        auto buf = weights.get<ffi::AnyBuffer>(f * job.E + e);
        if (!buf.has_value()) return buf.error();
        job.field_ptr[f * job.E + e] = static_cast<const uint8_t*>(buf->untyped_data());
      }
      continue;
    }
    auto buf = weights.get<ffi::AnyBuffer>(f);
    if (!buf.has_value()) return buf.error();
    const uint8_t* base = static_cast<const uint8_t*>(buf->untyped_data());
    const size_t per = buf->size_bytes() / job.E;
    for (int e = 0; e < job.E; ++e) job.field_ptr[f * job.E + e] = base + per * e;
  }
  const size_t P = job.pair_x.size();
  CallBufferLease buffers;
  job.h = buffers.h(P * job.I);
  job.y = buffers.y(P * job.H);
  job.out = out->typed_data();
  job.pair_h.resize(P);
  for (size_t p = 0; p < P; ++p) job.pair_h[p] = job.h + p * job.I;
  set_chunks(job, max_threads > 0 ? static_cast<int>(std::min<int64_t>(max_threads, pool.num_threads()))
                                   : static_cast<int>(pool.num_threads()));
  if (lora) lora->prepare(P);
  if (job.act8) {
    act8.x.prepare(P, job.H, static_cast<int>(act_group), &job.pair_row);
    act8.h.prepare(P, job.I, static_cast<int>(act_group));
  }

  const Kernels& k = job.act8 ? act8_kernels().items : g_tables.load(std::memory_order_relaxed)->kernels[job.fmt];
  const int U = static_cast<int>(job.union_ids.size());
  const int mt = static_cast<int>(max_threads);
  const int n_gu = (job.I + job.chunk_gu - 1) / job.chunk_gu;
  const int n_down = (job.H + job.chunk_down - 1) / job.chunk_down;
  constexpr int kRowsPerItem = 8;
  const int n_rows = (job.T + kRowsPerItem - 1) / kRowsPerItem;
  // One pool dispatch per call, its items in the order of the phases: the act8 input rows, the LoRA gate/up
  // inputs, the gate/up chunks, the LoRA down inputs, the down chunks, the combine rows. Items are handed out in
  // index order, so an item whose inputs are not ready waits only for items already taken by running threads (no
  // deadlock), and a union expert's down chunks start once its own h rows are done: a dispatch per phase (the
  // helpers' wake-up, the idle tail of each phase's last item) cost a decode step more than the work it ordered.
  const int64_t n_in = job.act8 ? act8.x.rows() : 0, n_lora = lora ? U : 0;
  const int64_t n_gu_items = static_cast<int64_t>(U) * n_gu, n_down_items = static_cast<int64_t>(U) * n_down;
  std::atomic<int64_t> inputs_left{n_in}, downs_left{n_down_items};
  std::unique_ptr<UnionProgress[]> progress(new UnionProgress[U]);
  for (int u = 0; u < U; ++u) {
    progress[u].level.store(lora ? 0 : UnionProgress::kGateUpInputs, std::memory_order_relaxed);
    progress[u].chunks_left.store(n_gu, std::memory_order_relaxed);
  }
  const int64_t n_items = n_in + 2 * n_lora + n_gu_items + n_down_items + n_rows;
  parallel_for(&pool, n_items, mt, [&](int64_t i) {
    if (i < n_in) {
      act8_kernels().gate_up_inputs(job, static_cast<int>(i));
      inputs_left.fetch_sub(1, std::memory_order_release);
      return;
    }
    i -= n_in;
    if (i < n_lora) {
      lora_kernels().gate_up_inputs(job, static_cast<int>(i));
      progress[i].reach(UnionProgress::kGateUpInputs);
      return;
    }
    i -= n_lora;
    if (i < n_gu_items) {
      const int u = static_cast<int>(i / n_gu);
      wait_until([&] { return inputs_left.load(std::memory_order_acquire) == 0; });
      progress[u].wait(UnionProgress::kGateUpInputs);
      k.gate_up(job, u, static_cast<int>(i % n_gu));
      if (progress[u].chunks_left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
      // The item that completes a union expert's h rows quantizes them for int8 activations.
      if (job.act8)
        for (int p = job.pair_start[u]; p < job.pair_start[u + 1]; ++p) act8_kernels().down_inputs(job, p);
      progress[u].reach(lora ? UnionProgress::kH : UnionProgress::kDownInputs);
      return;
    }
    i -= n_gu_items;
    if (i < n_lora) {
      progress[i].wait(UnionProgress::kH);
      lora_kernels().down_inputs(job, static_cast<int>(i));
      progress[i].reach(UnionProgress::kDownInputs);
      return;
    }
    i -= n_lora;
    if (i < n_down_items) {
      const int u = static_cast<int>(i / n_down);
      progress[u].wait(UnionProgress::kDownInputs);
      k.down(job, u, static_cast<int>(i % n_down));
      downs_left.fetch_sub(1, std::memory_order_release);
      return;
    }
    i -= n_down_items;
    wait_until([&] { return downs_left.load(std::memory_order_acquire) == 0; });
    const int t0 = static_cast<int>(i) * kRowsPerItem;
    k.combine(job, t0, std::min(job.T, t0 + kRowsPerItem));
  });
  return ffi::Error::Success();
}

static ffi::Error MoeExpertsCall(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> idx,
                                 ffi::Buffer<ffi::F32> weight, ffi::Buffer<ffi::F32> in_scale,
                                 ffi::Buffer<ffi::F32> gate_up_bias, ffi::Buffer<ffi::F32> down_bias,
                                 ffi::Buffer<ffi::F32> scale2, ffi::RemainingArgs weights,
                                 ffi::ResultBuffer<ffi::F32> out, int64_t fmt, int64_t num_experts,
                                 int64_t intermediate, int64_t group, int64_t fields_per_proj, int64_t per_expert,
                                 int64_t act_kind, int64_t has_limit, float limit, float alpha, int64_t clamp_after,
                                 int64_t max_threads, int64_t act_group) {
  return RunExperts(pool, x, idx, weight, in_scale, gate_up_bias, down_bias, scale2, weights, out, fmt, num_experts,
                    intermediate, group, fields_per_proj, per_expert, act_kind, has_limit, limit, alpha, clamp_after,
                    max_threads, act_group, nullptr);
}

// MoeExpertsCall with LoRA adapters: the rows' adapter ids [T] and gate, up, down's stacked A, B, scale (lora.h;
// a target's three buffers empty when absent).
static ffi::Error MoeExpertsLoRACall(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::F32> weight,
    ffi::Buffer<ffi::F32> in_scale, ffi::Buffer<ffi::F32> gate_up_bias, ffi::Buffer<ffi::F32> down_bias,
    ffi::Buffer<ffi::F32> scale2, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> gate_a,
    ffi::Buffer<ffi::F32> gate_b, ffi::Buffer<ffi::F32> gate_s, ffi::Buffer<ffi::F32> up_a, ffi::Buffer<ffi::F32> up_b,
    ffi::Buffer<ffi::F32> up_s, ffi::Buffer<ffi::F32> down_a, ffi::Buffer<ffi::F32> down_b,
    ffi::Buffer<ffi::F32> down_s, ffi::RemainingArgs weights, ffi::ResultBuffer<ffi::F32> out, int64_t fmt,
    int64_t num_experts, int64_t intermediate, int64_t group, int64_t fields_per_proj, int64_t per_expert,
    int64_t act_kind, int64_t has_limit, float limit, float alpha, int64_t clamp_after, int64_t max_threads,
    int64_t act_group) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || ids.element_count() != static_cast<size_t>(xd[0]))
    return ffi::Error::InvalidArgument("moejax native lora: x [T, H] and adapter ids [T]");
  LoRAJob lora;
  lora.ids = ids.typed_data();
  const int E = static_cast<int>(num_experts), H = static_cast<int>(xd[1]), I = static_cast<int>(intermediate);
  for (auto err : {lora_bind_target(lora, kLoRAGate, gate_a, gate_b, gate_s, E, H, I),
                   lora_bind_target(lora, kLoRAUp, up_a, up_b, up_s, E, H, I),
                   lora_bind_target(lora, kLoRADown, down_a, down_b, down_s, E, I, H)})
    if (err.failure()) return err;
  return RunExperts(pool, x, idx, weight, in_scale, gate_up_bias, down_bias, scale2, weights, out, fmt, num_experts,
                    intermediate, group, fields_per_proj, per_expert, act_kind, has_limit, limit, alpha, clamp_after,
                    max_threads, act_group, lora.n_ids ? &lora : nullptr);
}

// One LoRA target's deltas per row, for what has no experts (the router's logits, the shared expert's sigmoid
// gate: moejax.backends.native_ops.lora_delta): out[t] = s[a] · (x[t] · A[a]ᵀ) · B[a]ᵀ with a the row's adapter
// (ids outside [0, n) are 0), zeros on rows without one. Each value is one fixed chain (lora_row_delta): a row's
// bits do not depend on T, its position, its neighbours or the threads.
static ffi::Error LoRADeltaCall(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                                ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::F32> s,
                                ffi::ResultBuffer<ffi::F32> out, int64_t max_threads) {
  const auto xd = x.dimensions(), bd = b.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || ids.element_count() != static_cast<size_t>(xd[0]))
    return ffi::Error::InvalidArgument("moejax native lora delta: x [T, in] and adapter ids [T]");
  if (bd.size() != 4 || od.size() != 2 || od[0] != xd[0] || od[1] != bd[2])
    return ffi::Error::InvalidArgument("moejax native lora delta: B [n, 1, out, r] and out [T, out]");
  const int T = static_cast<int>(xd[0]), n_in = static_cast<int>(xd[1]), n_out = static_cast<int>(bd[2]);
  LoRAJob L;
  L.ids = ids.typed_data();
  if (auto err = lora_bind_target(L, 0, a, b, s, 1, n_in, n_out, "delta"); err.failure()) return err;
  if (!L.t[0].on()) return ffi::Error::InvalidArgument("moejax native lora delta: empty A, B and scale");
  const LoRATarget& t = L.t[0];
  const auto row_delta = lora_kernels().row_delta;
  const float* xs = x.typed_data();
  float* y = out->typed_data();
  constexpr int kRows = 8;  // rows per work item
  parallel_for(&pool, (T + kRows - 1) / kRows, static_cast<int>(max_threads), [&](int64_t i) {
    std::vector<float> u(t.r);
    for (int r = static_cast<int>(i) * kRows; r < std::min(T, static_cast<int>(i + 1) * kRows); ++r) {
      float* o = y + static_cast<size_t>(r) * n_out;
      const int ad = L.row_id(r);
      if (ad == 0) std::fill(o, o + n_out, 0.0f);
      else row_delta(t, ad, xs + static_cast<size_t>(r) * n_in, u.data(), o);
    }
  });
  return ffi::Error::Success();
}

}  // namespace moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxRoutedExperts, moe::NoThrow<moe::MoeExpertsCall>::Call,
                              moe::BindExpertsRest(moe::BindExpertsArgs()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxRoutedExpertsLoRA, moe::NoThrow<moe::MoeExpertsLoRACall>::Call,
                              moe::BindExpertsRest(moe::BindLoRAArgs(moe::BindExpertsArgs())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxLoRADelta, moe::NoThrow<moe::LoRADeltaCall>::Call,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, in]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // adapter ids [T]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // A [n, 1, r, in]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // B [n, 1, out, r]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [n]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, out]
                                  .Attr<int64_t>("max_threads"));

// -- the Python module: PyCapsules of the handlers, the chosen ISA ---------------------------------------------
extern "C" XLA_FFI_Error* MoejaxLinear(XLA_FFI_CallFrame* call_frame);  // csrc/linear_cpu.cc
extern "C" XLA_FFI_Error* MoejaxScores(XLA_FFI_CallFrame* call_frame);  // csrc/scores_cpu.cc
extern "C" XLA_FFI_Error* MoejaxRoutedExpertsBackward(XLA_FFI_CallFrame* call_frame);  // csrc/backward_cpu.cc
extern "C" XLA_FFI_Error* MoejaxRoutedExpertsTrainForward(XLA_FFI_CallFrame* call_frame);  // csrc/backward_cpu.cc

static PyObject* registrations(PyObject*, PyObject*) {
  PyObject* dict = PyDict_New();
  if (!dict) return nullptr;
  const std::pair<const char*, void*> handlers[] = {
      {"moejax_routed_experts", reinterpret_cast<void*>(&MoejaxRoutedExperts)},
      {"moejax_routed_experts_lora", reinterpret_cast<void*>(&MoejaxRoutedExpertsLoRA)},
      {"moejax_lora_delta", reinterpret_cast<void*>(&MoejaxLoRADelta)},
      {"moejax_linear", reinterpret_cast<void*>(&MoejaxLinear)},
      {"moejax_scores", reinterpret_cast<void*>(&MoejaxScores)},
      {"moejax_routed_experts_backward", reinterpret_cast<void*>(&MoejaxRoutedExpertsBackward)},
      {"moejax_routed_experts_train_forward", reinterpret_cast<void*>(&MoejaxRoutedExpertsTrainForward)},
  };
  for (const auto& [name, fn] : handlers) {
    PyObject* capsule = PyCapsule_New(fn, nullptr, nullptr);
    if (!capsule || PyDict_SetItemString(dict, name, capsule) < 0) {
      Py_XDECREF(capsule);
      Py_DECREF(dict);
      return nullptr;
    }
    Py_DECREF(capsule);
  }
  return dict;
}

static PyObject* isa(PyObject*, PyObject*) { return PyUnicode_FromString(moe::g_isa.load()); }

// set_isa("generic" | "avx2" | "avx512" | "best"): the best kernels this CPU runs up to that variant, for calls
// that start afterwards (tests compare the variants in one process).
static PyObject* set_isa(PyObject*, PyObject* arg) {
  const char* name = PyUnicode_AsUTF8(arg);
  if (!name) return nullptr;
  moe::Isa cap = moe::Isa::kAvx512;
  if (std::string(name) != "best" && !moe::isa_from_name(name, &cap)) {
    PyErr_SetString(PyExc_ValueError, "set_isa: expected 'generic', 'avx2', 'avx512' or 'best'");
    return nullptr;
  }
  moe::select_isa(cap);
  return PyUnicode_FromString(moe::g_isa.load());
}

// set_act8_strip('maddubs' | 'vnni' | 'vbmi' | 'best') -> the AVX-512 variant's int8-activation strips now used, at
// most the CPU's best (moe_job.h's A8Strip; tests compare them bit for bit).
static PyObject* set_act8_strip(PyObject*, PyObject* arg) {
  static const char* const kNames[] = {"maddubs", "vnni", "vbmi"};
  const char* name = PyUnicode_AsUTF8(arg);
  if (!name) return nullptr;
  const int best = static_cast<int>(moe::a8_strip_best());
  int want = best;
  if (std::string(name) != "best") {
    want = 0;
    while (want < 3 && std::string(name) != kNames[want]) ++want;
    if (want == 3) {
      PyErr_SetString(PyExc_ValueError, "set_act8_strip: expected 'maddubs', 'vnni', 'vbmi' or 'best'");
      return nullptr;
    }
    want = std::min(want, best);
  }
  moe::g_act8_strip = static_cast<moe::A8Strip>(want);
  return PyUnicode_FromString(kNames[want]);
}

// rows_examined(): the earlier rows phase 0 examined as possible copies of a row, over the process (tests).
static PyObject* rows_examined(PyObject*, PyObject*) {
  return PyLong_FromUnsignedLongLong(moe::g_rows_examined.load());
}

// lingering_helped(): the calls a pool thread lingering after an earlier call helped, over the process (tests).
static PyObject* lingering_helped(PyObject*, PyObject*) {
  return PyLong_FromUnsignedLongLong(moe::Lingering::get().helped());
}

// call_buffers(): {"idle_sets", "retained_bytes", "retained_bound_bytes"} of the call-buffer pool.
static PyObject* call_buffers(PyObject*, PyObject*) {
  const auto [sets, bytes] = moe::CallBufferLease::idle();
  return Py_BuildValue("{s:n,s:n,s:n}", "idle_sets", static_cast<Py_ssize_t>(sets), "retained_bytes",
                       static_cast<Py_ssize_t>(bytes), "retained_bound_bytes",
                       static_cast<Py_ssize_t>(moe::kRetainedBytes));
}

static PyMethodDef kMethods[] = {
    {"registrations", registrations, METH_NOARGS, "{target name: PyCapsule of its XLA FFI handler}"},
    {"isa", isa, METH_NOARGS, "the instruction set of the kernels in use ('avx512', 'avx2' or 'generic')"},
    {"set_isa", set_isa, METH_O, "set_isa('generic' | 'avx2' | 'avx512' | 'best') -> the instruction set now used"},
    {"set_act8_strip", set_act8_strip, METH_O,
     "set_act8_strip('maddubs' | 'vnni' | 'vbmi' | 'best') -> the int8-activation strips now used (AVX-512)"},
    {"call_buffers", call_buffers, METH_NOARGS, "the call-buffer pool: idle sets, bytes they retain, the bound"},
    {"rows_examined", rows_examined, METH_NOARGS, "earlier rows examined as copies of a row, over the process"},
    {"lingering_helped", lingering_helped, METH_NOARGS, "calls helped by a lingering pool thread, over the process"},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_cpu", "moejax's native CPU kernels (XLA FFI)", -1,
                              kMethods, nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit__native_cpu(void) {
  moe::select_isa(moe::Isa::kAvx512);
  moe::g_soft_prefetch_f32 = moe::soft_prefetch_f32_default();
  moe::g_act8_strip = moe::a8_strip_best();
  return PyModule_Create(&kModule);
}
