// The one CPU probe of the native kernels: which instruction-set variant of the kernels this CPU runs (x86-64:
// __builtin_cpu_supports, probed once), capped by the MOEJAX_NATIVE_ISA environment variable, and the facts about
// the CPU a kernel tunes by. Every handler (moe_cpu.cc, linear_cpu.cc, backward_cpu.cc) chooses its variant here.
#pragma once

namespace moe {

// The variants of the kernels, each running on a subset of the CPUs of the one before it.
enum class Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

struct CpuFeatures {
  bool avx2 = false;         // AVX2, FMA and F16C: the avx2 variant
  bool avx512 = false;       // those and AVX-512 F, BW, DQ, VL: the avx512 variant
  bool avx512_vnni = false;  // AVX-512 VNNI (vpdpbusd): the avx512 variant's int8-activation loops
  bool avx512_vbmi = false;  // AVX-512 VBMI (byte permutes): those loops' 4-bit code spread
  bool intel = false;        // an Intel CPU (moe_job.h: whether float32 weights are prefetched in software)
};

// This CPU's features (probed on the first call).
const CpuFeatures& cpu_features();

// "generic", "avx2" or "avx512".
const char* isa_name(Isa isa);

// The variant named `name` in *isa; false when `name` names none.
bool isa_from_name(const char* name, Isa* isa);

// The widest variant this CPU runs, at most `cap` and, when MOEJAX_NATIVE_ISA names a variant, at most that one
// (read on every call: tests set it between calls).
Isa best_isa(Isa cap);

}  // namespace moe
