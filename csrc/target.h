// The instruction-set plumbing of the kernel variants. MOE_X86: x86-64 with GCC or clang (<immintrin.h> included).
// MOE_TARGET_PUSH("avx2,fma,f16c") ... MOE_TARGET_POP(): the functions defined between them are compiled for
// those extensions (GCC's `#pragma GCC target`, clang's attribute push), the rest of the file with the baseline
// flags; a variant's functions are called only where the CPU has them (cpu_features.h). No -march in the build.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MOE_X86 1
#include <immintrin.h>
#else
#define MOE_X86 0
#endif

// The extensions of the variants (cpu_features.h's CpuFeatures::avx2, ::avx512).
#define MOE_AVX2_TARGET "avx2,fma,f16c"
#define MOE_AVX512_TARGET "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl"

#define MOE_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define MOE_TARGET_PUSH(t) MOE_PRAGMA(clang attribute push(__attribute__((target(t))), apply_to = function))
#define MOE_TARGET_POP() MOE_PRAGMA(clang attribute pop)
#else
#define MOE_TARGET_PUSH(t) MOE_PRAGMA(GCC push_options) MOE_PRAGMA(GCC target(t))
#define MOE_TARGET_POP() MOE_PRAGMA(GCC pop_options)
#endif

// Full unrolling of the small fixed loops over register blocks (keeps GCC's accumulator arrays in registers).
#if defined(__clang__)
#define MOE_UNROLL _Pragma("clang loop unroll(full)")
#elif defined(__GNUC__)
#define MOE_UNROLL _Pragma("GCC unroll 16")
#else
#define MOE_UNROLL
#endif
