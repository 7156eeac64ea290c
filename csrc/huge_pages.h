// Transparent huge pages for the large buffers a kernel writes first.
//
// XLA's CPU runtime takes a call's output buffers from malloc, and glibc maps each large one fresh (mmap), so every
// 4 KiB page of it faults on its first write, in every call: the float32 expert gradient of Qwen3-30B-A3B's layer
// (2.4 GB) is 600k faults, seconds of kernel time on a busy machine. Advising huge pages before the first write
// makes that about 1,200 faults where the kernel's THP mode is "madvise" (many distributions' default) or
// "always". The advice changes no value: it is skipped where unsupported, and its failure is ignored.
#ifndef MOEJAX_HUGE_PAGES_H_
#define MOEJAX_HUGE_PAGES_H_

#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace moe {

// Advise huge pages on the whole 2 MiB pages inside [p, p + bytes), for buffers of at least 4 MiB.
inline void advise_huge_pages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (p == nullptr || bytes < 2 * kHuge) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace moe

#endif  // MOEJAX_HUGE_PAGES_H_
