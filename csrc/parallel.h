// The thread scheme of moejax's FFI handlers (moe_cpu.cc, linear_cpu.cc, backward_cpu.cc): work items 0..n-1 handed
// out by an atomic counter to XLA's intra-op pool (the FFI's ThreadPool context) and the calling thread.
//
// The caller works too and then waits only for items already taken: a scheduled task may start late or never
// before the call ends, and one that starts late finds no item and touches nothing but the shared state it holds.
// Items are taken in index order, so an item may wait (wait_until) for the result of a lower-numbered one: that one
// is already held by a running thread, and the chain of such waits ends at an item that waits for nothing.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace moe {

struct ParallelState {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t n = 0;
  std::function<void(int64_t)> fn;

  void work() {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Spins until ready() (a load with acquire order) holds: the wait of an item for an earlier item's result.
template <class Ready>
inline void wait_until(const Ready& ready) {
  while (!ready()) std::this_thread::yield();
}

// fn(0..n-1) on the pool's threads and the calling thread; returns when all n have run. max_threads > 0: at most
// that many threads, the caller's included.
inline void parallel_for(xla::ffi::ThreadPool* pool, int64_t n, int max_threads, std::function<void(int64_t)> fn) {
  if (n <= 0) return;
  auto state = std::make_shared<ParallelState>();
  state->n = n;
  state->fn = std::move(fn);
  // The pool's size is the core count: the caller plus num_threads - 1 helpers fill the cores (one more would
  // only time-slice with them, whether or not the caller is itself a pool thread).
  int64_t helpers = pool ? std::min<int64_t>(pool->num_threads() - 1, n - 1) : 0;
  if (max_threads > 0) helpers = std::min<int64_t>(helpers, max_threads - 1);
  for (int64_t i = 0; i < helpers; ++i) pool->Schedule([state] { state->work(); });
  state->work();
  // Items not yet done were taken by running threads: waiting for them cannot deadlock.
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace moe
