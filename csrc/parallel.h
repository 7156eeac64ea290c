// The thread scheme of moejax's FFI handlers (moe_cpu.cc, linear_cpu.cc, backward_cpu.cc): work items 0..n-1 handed
// out by an atomic counter to XLA's intra-op pool (the FFI's ThreadPool context) and the calling thread.
//
// The caller works too and then waits only for items already taken: a scheduled task may start late or never
// before the call ends, and one that starts late finds no item and touches nothing but the shared state it holds.
// Items are taken in index order, so an item may wait (wait_until) for the result of a lower-numbered one: that one
// is already held by a running thread, and the chain of such waits ends at an item that waits for nothing.
//
// A pool thread that has helped a call lingers (Lingering, below) for the next call's items before it goes back to
// the pool: a decode step makes several short calls (the router's linear, the routed experts), and a pool thread
// woken from its parked state on a virtual machine starts ~45 us after the call schedules it, a tenth of a one-token
// step. Lingering threads are only ever an addition: every call still works alone if nobody helps it.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace moe {

struct ParallelState {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<int64_t> seats{0};  // helpers this call still admits (its max_threads less the caller)
  int64_t n = 0;
  std::function<void(int64_t)> fn;

  void work() {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
  // Whether it took a seat (and with it the items left).
  bool help() {
    if (seats.fetch_sub(1, std::memory_order_relaxed) <= 0) return false;
    work();
    return true;
  }
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Spins until ready() (a load with acquire order) holds: the wait of an item for an earlier item's result.
template <class Ready>
inline void wait_until(const Ready& ready) {
  while (!ready()) std::this_thread::yield();
}

// The offer of the latest call to the pool threads lingering after earlier calls. A call publishes its state, then
// counts the lingering threads and schedules only the helpers they do not cover; a lingering thread stops counting
// itself, then looks for an offer once more. Both sides are sequentially consistent, so either the call counts the
// thread and the thread then sees the offer, or the call does not count it and schedules a helper instead.
class Lingering {
 public:
  static Lingering& get() {
    static Lingering* lingering = new Lingering();  // never destroyed: a thread may still linger at exit
    return *lingering;
  }

  // How long a thread waits for the next call: MOEJAX_NATIVE_LINGER_US, 0 to return to the pool at once.
  std::chrono::nanoseconds budget() const { return budget_; }
  // Calls a lingering thread helped, over the process (tests).
  uint64_t helped() const { return helped_.load(std::memory_order_relaxed); }

  // Returns how many lingering threads may take the offer.
  int64_t offer(const std::shared_ptr<ParallelState>& state) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      offer_ = state;
    }
    generation_.fetch_add(1, std::memory_order_seq_cst);
    return waiting_.load(std::memory_order_seq_cst);
  }

  // Runs on a pool thread after it helped a call: takes the offers made while it waits, until one budget passes
  // without any. At most `most` threads linger (the helpers a call can use): one more would only take a core from
  // the caller and the others.
  void linger(int64_t most) {
    uint64_t seen = generation_.load(std::memory_order_seq_cst);
    if (waiting_.fetch_add(1, std::memory_order_seq_cst) >= most) {
      waiting_.fetch_sub(1, std::memory_order_seq_cst);
      return;
    }
    auto deadline = std::chrono::steady_clock::now() + budget_;
    for (;;) {
      uint64_t now_generation = generation_.load(std::memory_order_seq_cst);
      if (now_generation != seen) {
        // Still counted while it helps: it takes the next offer as soon as it is done.
        seen = now_generation;
        take_offer();
        deadline = std::chrono::steady_clock::now() + budget_;
        continue;
      }
      if (std::chrono::steady_clock::now() > deadline) break;
      cpu_relax();
    }
    waiting_.fetch_sub(1, std::memory_order_seq_cst);
    if (generation_.load(std::memory_order_seq_cst) != seen) take_offer();
  }

 private:
  Lingering() {
    const char* env = std::getenv("MOEJAX_NATIVE_LINGER_US");
    long us = env ? std::strtol(env, nullptr, 10) : 50;
    budget_ = std::chrono::microseconds(std::max(0L, us));
  }

  void take_offer() {
    std::shared_ptr<ParallelState> state;
    {
      std::lock_guard<std::mutex> lock(mu_);
      state = offer_;
    }
    if (state && state->help()) helped_.fetch_add(1, std::memory_order_relaxed);
  }

  std::chrono::nanoseconds budget_;
  std::mutex mu_;
  std::shared_ptr<ParallelState> offer_;  // a finished call's state stays here harmlessly: it has no items left
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> waiting_{0};
  std::atomic<uint64_t> helped_{0};
};

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
  state->seats.store(helpers, std::memory_order_relaxed);
  if (helpers > 0) {
    Lingering& lingering = Lingering::get();
    int64_t scheduled = helpers - std::min(helpers, lingering.offer(state));
    for (int64_t i = 0; i < scheduled; ++i) {
      pool->Schedule([state, &lingering, most = pool->num_threads() - 1] {
        state->help();
        if (lingering.budget().count() > 0) lingering.linger(most);
      });
    }
  }
  state->work();
  // Items not yet done were taken by running threads: waiting for them cannot deadlock.
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace moe
