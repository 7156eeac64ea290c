// The one CPU probe of the native kernels (cpu_features.h).
#include "cpu_features.h"

#include <cstdlib>
#include <cstring>

namespace moe {

static CpuFeatures probe() {
  CpuFeatures f;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  f.avx512 = f.avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  f.avx512_vnni = f.avx512 && __builtin_cpu_supports("avx512vnni");
  f.avx512_vbmi = f.avx512 && __builtin_cpu_supports("avx512vbmi");
  f.intel = __builtin_cpu_is("intel");
#endif
  return f;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = probe();
  return features;
}

static const char* const kIsaNames[] = {"generic", "avx2", "avx512"};

const char* isa_name(Isa isa) { return kIsaNames[static_cast<int>(isa)]; }

bool isa_from_name(const char* name, Isa* isa) {
  for (int i = 0; i < 3; ++i)
    if (name && std::strcmp(name, kIsaNames[i]) == 0) {
      *isa = static_cast<Isa>(i);
      return true;
    }
  return false;
}

Isa best_isa(Isa cap) {
  Isa env;
  if (isa_from_name(std::getenv("MOEJAX_NATIVE_ISA"), &env) && env < cap) cap = env;
  const CpuFeatures& f = cpu_features();
  if (cap >= Isa::kAvx512 && f.avx512) return Isa::kAvx512;
  if (cap >= Isa::kAvx2 && f.avx2) return Isa::kAvx2;
  return Isa::kGeneric;
}

}  // namespace moe
