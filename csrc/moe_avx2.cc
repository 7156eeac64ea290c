// The AVX2 + FMA + F16C variant of the routed-expert kernels (MOE_TARGET_PUSH: only these functions use the
// extensions; chosen at load by cpu_features.h), in its own translation unit (see moe_job.h).
#include "moe_job.h"
#include "target.h"
#include "vec_avx2.h"

namespace moe {
#if MOE_X86
MOE_TARGET_PUSH(MOE_AVX2_TARGET)
namespace avx2 {
using namespace vec_avx2;
#include "lora_kernels.inc"
#include "kernels.inc"
#define MOE_ACT8_AVX2 1
#include "act8_kernels.inc"
#undef MOE_ACT8_AVX2
}  // namespace avx2
MOE_TARGET_POP()

namespace avx2 {
const IsaTables& tables() {  // outside the target region: callable on any CPU
  static const IsaTables t{kTable, &kLoRA, &kAct8};
  return t;
}
}  // namespace avx2
#endif
}  // namespace moe
