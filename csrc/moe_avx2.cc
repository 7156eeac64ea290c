// The AVX2 + FMA + F16C variant of the routed-expert kernels (`#pragma GCC target`: only these functions use the
// extensions; chosen at load with __builtin_cpu_supports), in its own translation unit (see moe_job.h).
#include "moe_job.h"

namespace moe {
#if MOE_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {
#include "vec_avx2.inc"
#include "lora_kernels.inc"
#include "kernels.inc"
#define MOE_ACT8_AVX2 1
#include "act8_kernels.inc"
#undef MOE_ACT8_AVX2
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

#if MOE_X86
namespace avx2 {
const IsaTables& tables() {  // outside the target region: callable on any CPU
  static const IsaTables t{kTable, &kLoRA, &kAct8};
  return t;
}
}  // namespace avx2
#endif
}  // namespace moe
