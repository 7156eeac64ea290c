// MOE_TARGET_PUSH("avx2,fma,f16c") ... MOE_TARGET_POP(): the functions defined between them are compiled for
// those extensions (GCC's `#pragma GCC target`, clang's attribute push), the rest of the file with the baseline
// flags; a variant's functions are called only where the CPU has them (checked at load). No -march in the build.
#pragma once

#define MOE_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define MOE_TARGET_PUSH(t) MOE_PRAGMA(clang attribute push(__attribute__((target(t))), apply_to = function))
#define MOE_TARGET_POP() MOE_PRAGMA(clang attribute pop)
#else
#define MOE_TARGET_PUSH(t) MOE_PRAGMA(GCC push_options) MOE_PRAGMA(GCC target(t))
#define MOE_TARGET_POP() MOE_PRAGMA(GCC pop_options)
#endif
