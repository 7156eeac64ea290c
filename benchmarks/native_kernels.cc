// Kernel-only harness of moejax's routed-expert kernels (csrc/moe_cpu.cc): the phases of one call without XLA,
// on the harness's own spinning threads, through ctypes. Not part of the package build; the driver
// benchmarks/native_kernels.py compiles it (one library per csrc tree, for A/B runs in one process):
//
//   g++ -shared -fPIC -std=c++17 -O3 -g0 -ffp-contract=off -fno-math-errno -isystem csrc/third_party -Icsrc \
//       -I$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])") \
//       -o /tmp/native_kernels.so benchmarks/native_kernels.cc csrc/linear_cpu.cc csrc/scores_cpu.cc
//
// A Model holds E experts of one format in moe_cpu.cc's per-expert layout (random codes, scales in a realistic
// range; int: symmetric, group `group`); kb_run builds a Job for T rows choosing K random distinct experts (new
// experts and a new x per call, so the weights come from memory when E * bytes per expert exceeds the L3) and
// times the chosen phases.
#include "moe_cpu.cc"

#include <chrono>
#include <ctime>
#include <random>

namespace moe {
// The chunk widths of a csrc tree older than moe_cpu.cc's set_chunks (A/B runs): a worse match than the
// non-template set_chunks where that exists.
template <class J>
static void set_chunks(J& job, int) {
  job.chunk_gu = job.chunk_down = chunk_width(job.fmt);
}
}  // namespace moe

namespace kb {
using namespace moe;

// n - 1 spinning helper threads plus the caller; run(f) runs f on all n and returns when all are done.
struct Pool {
  std::vector<std::thread> threads;
  std::atomic<int> generation{0}, busy{0};
  std::atomic<bool> stop{false};
  std::function<void()> task;
  explicit Pool(int n) {
    for (int i = 1; i < n; ++i)
      threads.emplace_back([this] {
        int seen = 0;
        while (!stop.load()) {
          const int g = generation.load(std::memory_order_acquire);
          if (g == seen) continue;
          seen = g;
          task();
          busy.fetch_sub(1);
        }
      });
  }
  void run(const std::function<void()>& f) {
    task = f;
    busy.store(static_cast<int>(threads.size()));
    generation.fetch_add(1, std::memory_order_release);
    f();
    while (busy.load() > 0) {
    }
  }
  ~Pool() {
    stop = true;
    for (auto& t : threads) t.join();
  }
};

// fn(0..n-1) handed out by an atomic counter, as parallel.inc.
static void pfor(Pool& pool, int64_t n, const std::function<void(int64_t)>& fn) {
  std::atomic<int64_t> next{0};
  pool.run([&] {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  });
}

// kb_set_cpu_clock: one-thread runs timed by the thread's CPU clock, others by the process's (wall clock: off)
static bool g_cpu_clock = false;
// kb_set_act8: int8 activations in groups of this many inputs (act8.h), 0: float32 activations
static int g_act_group = 0;

static double now() {
  if (g_cpu_clock) {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
// The calling thread's CPU time (seconds): a one-thread run's time without the other processes' time slices.
static double cpu_now() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Model {
  int fmt, H, I, E, group, fields_per_proj = 0;
  std::vector<std::vector<uint8_t>> bufs;  // field-major [field][e]
  std::vector<float> scale2;
  size_t expert_bytes = 0;
};

enum Fill { kBytes, kF32, kBF16, kE8m0, kE4m3 };

static void fill(std::vector<uint8_t>& b, size_t n, Fill kind, std::mt19937& rng) {
  b.resize(n);
  std::normal_distribution<float> nd(0, 0.02f);
  if (kind == kF32) {
    float* f = reinterpret_cast<float*>(b.data());
    for (size_t i = 0; i < n / 4; ++i) f[i] = nd(rng);
  } else if (kind == kBF16) {
    uint16_t* h = reinterpret_cast<uint16_t*>(b.data());
    for (size_t i = 0; i < n / 2; ++i) {
      const float v = nd(rng);
      uint32_t u;
      std::memcpy(&u, &v, 4);
      h[i] = static_cast<uint16_t>(u >> 16);
    }
  } else {
    for (auto& v : b) v = kind == kBytes ? rng() : kind == kE8m0 ? 118 + rng() % 8 : 0x30 + rng() % 16;
  }
}

static Model* make(int fmt, int H, int I, int E, int group) {
  auto* m = new Model{fmt, H, I, E, group};
  std::mt19937 rng(1);
  auto add = [&](size_t bytes, Fill kind) {
    for (int e = 0; e < E; ++e) {
      m->bufs.emplace_back();
      fill(m->bufs.back(), bytes, kind, rng);
    }
    m->expert_bytes += bytes;
  };
  const size_t HI = static_cast<size_t>(H) * I;
  if (fmt == kFusedF32 || fmt == kFusedBF16) {
    const size_t es = fmt == kFusedF32 ? 4 : 2;
    const Fill kind = fmt == kFusedF32 ? kF32 : kBF16;
    add(2 * HI * es, kind);
    add(HI * es, kind);
  } else if (fmt == kDenseF32 || fmt == kDenseBF16) {
    const size_t es = fmt == kDenseF32 ? 4 : 2;
    const Fill kind = fmt == kDenseF32 ? kF32 : kBF16;
    for (int p = 0; p < 3; ++p) add(HI * es, kind);
  } else {
    m->fields_per_proj = 2;
    for (int p = 0; p < 3; ++p) {
      const size_t n_in = p == 2 ? I : H, n_out = p == 2 ? H : I;
      const bool packed = fmt == kInt4 || fmt == kMxfp4 || fmt == kNvfp4;
      add((packed ? n_in / 2 : n_in) * n_out, kBytes);
      if (fmt == kInt8 || fmt == kInt4) add(n_in / group * n_out * 4, kF32);
      else if (fmt == kFp8) add((n_in + 127) / 128 * ((n_out + 127) / 128) * 4, kF32);
      else if (fmt == kMxfp4) add(n_in / 32 * n_out, kE8m0);
      else add(n_in / 16 * n_out, kE4m3);
    }
    m->scale2.assign(3 * E, 0.01f);
  }
  return m;
}

// The sum of chunks of x[0, n) taken from `next` (the read ceiling's loop).
#if MOE_X86
__attribute__((target("avx2,fma,f16c")))
#endif
static float read_sum(const float* x, size_t n, std::atomic<size_t>& next) {
  constexpr size_t kChunk = 16384;
#if MOE_X86  // four 8-lane accumulators (the harness's own: csrc's vector header may live in another file)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t c = next.fetch_add(kChunk); c < n; c = next.fetch_add(kChunk))
    for (size_t i = c; i + 32 <= std::min(n, c + kChunk); i += 32) {
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(x + i));
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(x + i + 8));
      a2 = _mm256_add_ps(a2, _mm256_loadu_ps(x + i + 16));
      a3 = _mm256_add_ps(a3, _mm256_loadu_ps(x + i + 24));
    }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
#else
  float a = 0.0f;
  for (size_t c = next.fetch_add(kChunk); c < n; c = next.fetch_add(kChunk))
    for (size_t i = c; i < std::min(n, c + kChunk); ++i) a += x[i];
  return a;
#endif
}
}  // namespace kb

extern "C" {
// 1: kb_run times CPU time (one thread: the thread's clock; far less sensitive to other load), 0: the wall clock.
void kb_set_cpu_clock(int on) { kb::g_cpu_clock = on != 0; }
// The calls of kb_run with int8 activations in groups of `group` inputs (the int and 4-bit float formats; 0: off).
// The AVX-512 variant's VNNI loops where the CPU has them, as the package's module chooses at load.
void kb_set_act8(int group) {
  kb::g_act_group = group;
#if __has_include("act8.h")
#ifdef MOE_A8_STRIPS
  moe::g_act8_strip = moe::a8_strip_best();
#else  // a tree before the strips' tiers (an A/B against an older --csrc)
  moe::g_act8_vnni = moe::cpu_features().avx512_vnni;
#endif
#endif
}
void* kb_make(int fmt, int H, int I, int E, int group) { return kb::make(fmt, H, I, E, group); }
void kb_free(void* m) { delete static_cast<kb::Model*>(m); }
// Bytes of one expert's weights and scales.
double kb_expert_bytes(void* m) { return static_cast<double>(static_cast<kb::Model*>(m)->expert_bytes); }

// The one-row kernels' software prefetch of float32 weights: 1 on, 0 off, -1 as the package chooses at load (a
// no-op for a tree without the switch).
void kb_set_prefetch_f32(int on) {
#if __has_include("target.h")
  moe::g_soft_prefetch_f32 = on < 0 ? moe::soft_prefetch_f32_default() : on != 0;
#else
  (void)on;
#endif
}

// Min and median seconds of `reps` calls of T rows, each row choosing K random distinct experts (the same K and the
// same x for every row when same_rows != 0). phases: bit 0 gate/up, bit 1 down, bit 2 combine; isa: 2 the AVX-512
// kernels (the AVX2 ones in a tree without them), 1 the AVX2 kernels, 0 the portable ones.
double kb_run(void* mp, int T, int K, int threads, int reps, int phases, int isa, int same_rows, double* out_min) {
  using namespace moe;
  auto* m = static_cast<kb::Model*>(mp);
#if __has_include("moe_job.h")  // the kernel variants in translation units of their own (built beside this one)
  const Kernels* table = generic::tables().kernels;
#if MOE_X86
  if (isa >= 1) table = avx2::tables().kernels;
#if __has_include("vec_avx512.inc") || __has_include("vec_avx512.h")
  if (isa >= 2) table = avx512::tables().kernels;
#endif
#endif
#else  // an older csrc tree: the variants inside moe_cpu.cc
  const Kernels* table = generic::kTable;
#if MOE_X86
  if (isa >= 1) table = avx2::kTable;
#endif
#endif
  const Kernels* k_ptr = &table[m->fmt];
#if __has_include("act8.h")  // a tree with int8 activations: their phase items of the same variant
  const Act8Kernels* a8 = nullptr;
  if (kb::g_act_group > 0) {
    a8 = generic::tables().act8;
#if MOE_X86
    if (isa >= 1) a8 = avx2::tables().act8;
    if (isa >= 2) a8 = avx512::tables().act8;
#endif
    k_ptr = &a8->items;
  }
#endif
  const Kernels& k = *k_ptr;
  kb::Pool pool(threads);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0, 1);
  std::vector<float> x(static_cast<size_t>(T) * m->H), w(static_cast<size_t>(T) * K, 1.0f / K);
  std::vector<float> out(static_cast<size_t>(T) * m->H);
  std::vector<int32_t> idx(static_cast<size_t>(T) * K);
  std::vector<int> perm(m->E);
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    for (auto& v : x) v = nd(rng);
    for (int t = 0; t < T; ++t) {
      if (same_rows && t > 0) {
        std::memcpy(&x[static_cast<size_t>(t) * m->H], &x[0], sizeof(float) * m->H);
        std::memcpy(&idx[static_cast<size_t>(t) * K], &idx[0], sizeof(int32_t) * K);
        continue;
      }
      for (int e = 0; e < m->E; ++e) perm[e] = e;
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int j = 0; j < K; ++j) idx[static_cast<size_t>(t) * K + j] = perm[j];
    }
    const bool cpu = kb::g_cpu_clock && threads == 1;  // the caller runs every item alone
    const double t0 = cpu ? kb::cpu_now() : kb::now();
    Job job;
    job.fmt = m->fmt;
    job.T = T;
    job.K = K;
    job.H = m->H;
    job.I = m->I;
    job.E = m->E;
    job.group = m->group;
    job.fields_per_proj = m->fields_per_proj;
    job.per_expert = true;
    job.field_ptr.resize(m->bufs.size());
    for (size_t b = 0; b < m->bufs.size(); ++b) job.field_ptr[b] = m->bufs[b].data();
    job.scale2 = m->scale2.data();
    std::vector<float> scaled;
    build_routing(job, x.data(), idx.data(), w.data(), nullptr, scaled);
    job.slot_weight = w.data();
    const size_t P = job.pair_x.size();
    std::vector<float> h(P * job.I), y(P * job.H);
    job.h = h.data();
    job.y = y.data();
    job.out = out.data();
    job.pair_h.resize(P);
    for (size_t p = 0; p < P; ++p) job.pair_h[p] = job.h + p * job.I;
#if __has_include("act8.h")
    Act8Job act8;
    if (a8) {
      job.act8 = &act8;
      act8.x.prepare(P, job.H, kb::g_act_group);
      act8.h.prepare(P, job.I, kb::g_act_group);
    }
#endif
    set_chunks(job, threads);
    const int U = static_cast<int>(job.union_ids.size());
    const int n_gu = (job.I + job.chunk_gu - 1) / job.chunk_gu;
    const int n_down = (job.H + job.chunk_down - 1) / job.chunk_down;
#if __has_include("act8.h")
    if (a8 && (phases & 1)) kb::pfor(pool, U, [&](int64_t i) { a8->gate_up_inputs(job, static_cast<int>(i)); });
#endif
    if (phases & 1) kb::pfor(pool, int64_t{U} * n_gu, [&](int64_t i) { k.gate_up(job, i / n_gu, i % n_gu); });
#if __has_include("act8.h")
    if (a8 && (phases & 2)) kb::pfor(pool, U, [&](int64_t i) { a8->down_inputs(job, static_cast<int>(i)); });
#endif
    if (phases & 2) kb::pfor(pool, int64_t{U} * n_down, [&](int64_t i) { k.down(job, i / n_down, i % n_down); });
    if (phases & 4)
      kb::pfor(pool, (T + 7) / 8, [&](int64_t i) { k.combine(job, i * 8, std::min<int>(T, i * 8 + 8)); });
    times.push_back((cpu ? kb::cpu_now() : kb::now()) - t0);
  }
  std::sort(times.begin(), times.end());
  *out_min = times[0];
  return times[times.size() / 2];
}

// The read ceiling: min seconds to sum `bytes` of float32 (a fresh region of a buffer of `total` bytes each rep)
// on `threads` threads, 4 independent vector sums each.
double kb_read(size_t bytes, size_t total, int threads, int reps) {
  std::vector<float> buf(total / 4, 1.0f);
  kb::Pool pool(threads);
  double best = 1e9;
  size_t off = 0;
  for (int r = 0; r < reps; ++r) {
    if (off + bytes > total) off = 0;
    const float* base = buf.data() + off / 4;
    std::atomic<size_t> next{0};
    std::atomic<float> sink{0};
    const double t0 = kb::now();
    pool.run([&] { sink.store(kb::read_sum(base, bytes / 4, next)); });
    best = std::min(best, kb::now() - t0);
    off += bytes;
  }
  return best;
}
}
