// The portable variant of the routed-expert kernels (baseline flags, any CPU: aarch64 included), in its own
// translation unit (see moe_job.h).
#include "moe_job.h"
#include "vec_generic.h"

namespace moe {
namespace generic {
using namespace vec_generic;
#include "lora_kernels.inc"
#include "kernels.inc"
#define MOE_ACT8_AVX2 0
#include "act8_kernels.inc"
#undef MOE_ACT8_AVX2

const IsaTables& tables() {
  static const IsaTables t{kTable, &kLoRA, &kAct8};
  return t;
}
}  // namespace generic
}  // namespace moe
