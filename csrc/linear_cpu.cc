// moejax's batch-invariant linear layer on CPU: y[T, N] = x[T, K] @ W[K, N] (+ b[N]) as one XLA FFI handler.
//
// Used for what the MoE layer computes besides the routed experts: the router logits (x @ W_router) and the
// shared expert's sigmoid gate (x @ w). x and y are float32; W is read as stored ([in, out], float32, bfloat16 or
// float16, converted exactly to float32 in registers).
//
// Reduction order (what makes a row's bits independent of T, its position, its neighbours and the threads):
// every y[t, n] is one chain `acc = 0; for k in 0..K-1: acc = fma(x[t, k], W[k, n], acc)` (the portable variant:
// a product then a sum), then `acc + b[n]`. Vector lanes hold columns and registers hold rows, so blocking over
// rows and columns, the work split and the thread count change only which register holds a chain, never its
// order.
//
// Threads: work items (block of rows x chunk of columns) taken from an atomic counter by XLA's intra-op pool
// (the FFI's ThreadPool context) and the calling thread: parallel.h, shared with moe_cpu.cc.
//
// ISA: the kernel is compiled twice, as linear::avx2 (MOE_TARGET_PUSH(MOE_AVX2_TARGET)) and linear::generic
// (baseline flags, any CPU); the variant is chosen once (cpu_features.h), MOEJAX_NATIVE_ISA=generic (or
// the call's `portable` attribute) forces the portable one. The same order of operations in both: the same bits
// where the portable one is built with a fused multiply-add (aarch64), float32 rounding apart on x86-64
// (vec_generic.h).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "cpu_features.h"
#include "parallel.h"
#include "scalar.h"
#include "target.h"
#include "vec_avx2.h"
#include "vec_generic.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace moe {
namespace linear {

enum WeightType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// One call's operands.
struct Problem {
  const float* x = nullptr;     // [T, K]
  const uint8_t* w = nullptr;   // [K, N] of `wtype`
  const float* bias = nullptr;  // [N] or null
  float* y = nullptr;           // [T, N]
  int T = 0, K = 0, N = 0, wtype = kF32;
};

constexpr int kRows = 4;      // rows per register block
constexpr int kTile = 16;     // columns per register block (two 8-lane vectors)
constexpr int kRowItem = 32;  // rows per work item
constexpr int kColItem = 64;  // columns per work item

using Kernel = void (*)(const Problem&, int t0, int t1, int c0, int c1);

namespace generic {
using namespace vec_generic;
#include "linear_kernel.inc"
}  // namespace generic

#if MOE_X86
MOE_TARGET_PUSH(MOE_AVX2_TARGET)
namespace avx2 {
using namespace vec_avx2;
#include "linear_kernel.inc"
}  // namespace avx2
MOE_TARGET_POP()
#endif

// The kernel per weight type of the best variant for this CPU (cpu_features.h; MOEJAX_NATIVE_ISA=generic: the
// portable one), chosen on the first call.
static const Kernel* best_kernels() {
  static const Kernel* chosen = [] {
#if MOE_X86
    if (best_isa(Isa::kAvx2) == Isa::kAvx2) return avx2::kKernels;
#endif
    return generic::kKernels;
  }();
  return chosen;
}

static ffi::Error LinearCall(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> y, int64_t max_threads,
                             int64_t portable) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[0] != xd[1])
    return ffi::Error::InvalidArgument("moejax linear: x [T, K] and W [K, N]");
  Problem p;
  switch (w.element_type()) {
    case ffi::DataType::F32: p.wtype = kF32; break;
    case ffi::DataType::BF16: p.wtype = kBF16; break;
    case ffi::DataType::F16: p.wtype = kF16; break;
    default: return ffi::Error::InvalidArgument("moejax linear: W must be float32, bfloat16 or float16");
  }
  p.T = static_cast<int>(xd[0]);
  p.K = static_cast<int>(xd[1]);
  p.N = static_cast<int>(wd[1]);
  if (bias.element_count() != 0 && bias.element_count() != static_cast<size_t>(p.N))
    return ffi::Error::InvalidArgument("moejax linear: bias must be [N] or empty");
  const auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[1]) return ffi::Error::InvalidArgument("moejax linear: y [T, N]");
  p.x = x.typed_data();
  p.w = static_cast<const uint8_t*>(w.untyped_data());
  p.bias = bias.element_count() ? bias.typed_data() : nullptr;
  p.y = y->typed_data();
  const Kernel kernel = (portable ? generic::kKernels : best_kernels())[p.wtype];
  const int row_items = (p.T + kRowItem - 1) / kRowItem, col_items = (p.N + kColItem - 1) / kColItem;
  parallel_for(&pool, static_cast<int64_t>(row_items) * col_items, static_cast<int>(max_threads), [&](int64_t i) {
    const int t0 = static_cast<int>(i / col_items) * kRowItem, c0 = static_cast<int>(i % col_items) * kColItem;
    kernel(p, t0, std::min(p.T, t0 + kRowItem), c0, std::min(p.N, c0 + kColItem));
  });
  return ffi::Error::Success();
}

// The handler: LinearCall, with a C++ exception (a failed allocation) returned as an error to XLA instead of
// unwinding through the FFI's C boundary.
static ffi::Error LinearImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> y, int64_t max_threads,
                             int64_t portable) {
  try {
    return LinearCall(pool, x, w, bias, y, max_threads, portable);
  } catch (const std::exception& err) {
    return ffi::Error::Internal(std::string("moejax linear: ") + err.what());
  }
}

}  // namespace linear
}  // namespace moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxLinear, moe::linear::LinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, K]
                                  .Arg<ffi::AnyBuffer>()         // W [K, N] float32 / bfloat16 / float16
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias [N] or [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, N]
                                  .Attr<int64_t>("max_threads")
                                  .Attr<int64_t>("portable"));
