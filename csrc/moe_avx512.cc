// The AVX-512 (F, BW, DQ, VL) variant of the routed-expert kernels, in its own translation unit (see moe_job.h):
// kernels.inc over vec_avx2.h's V and vec_avx512.h's 16-lane W (MOE_WIDE), which lets the [in, out] kernels decode
// and multiply two vectors' columns per instruction (the same chains as the AVX2 variant's, the same bits). Chosen
// at load where the CPU has all four extensions (cpu_features.h).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
// GCC 12's _mm512_undefined_* self-initialize (`__m512 __Y = __Y`), so every AVX-512 conversion inlined here
// warns "may be used uninitialized" (GCC bug 105593, fixed in 13), or "is used uninitialized" where the argument
// comes from a masked load: no value is ever read uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include "moe_job.h"
#include "target.h"
#include "vec_avx2.h"
#include "vec_avx512.h"

namespace moe {
#if MOE_X86
// act8_kernels.inc leaves this region for its VNNI region and comes back (clang's target pushes do not nest: an
// inner one does not add its features to the outer one's).
MOE_TARGET_PUSH(MOE_AVX512_TARGET)
namespace avx512 {
using namespace vec_avx2;
using namespace vec_avx512;
#define MOE_WIDE 1  // kernels_inout.inc, kernels_outin.inc, act8_kernels.inc: the W paths
#include "lora_kernels.inc"
#include "kernels.inc"
#define MOE_ACT8_AVX2 1
#include "act8_kernels.inc"
#undef MOE_ACT8_AVX2
#undef MOE_WIDE
}  // namespace avx512
MOE_TARGET_POP()

namespace avx512 {
const IsaTables& tables() {  // outside the target region: callable on any CPU
  static const IsaTables t{kTable, &kLoRA, &kAct8};
  return t;
}
}  // namespace avx512
#endif
}  // namespace moe
