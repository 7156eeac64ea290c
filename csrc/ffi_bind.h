// The pieces of the routed-experts FFI handlers' bindings that the forward (moe_cpu.cc) and the backward and
// training forward (backward_cpu.cc) share, so their argument lists and attributes cannot drift apart, and the
// wrapper that turns a handler's exception into an error for XLA.
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace moe {

namespace ffi = xla::ffi;

// The routing's arguments, after x (and the backward's g).
template <typename Binding>
static auto BindRoutingArgs(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::S32>>()   // indices [T, K]
      .template Arg<ffi::Buffer<ffi::F32>>()   // out_weight [T, K]
      .template Arg<ffi::Buffer<ffi::F32>>()   // in_scale [T, K] or [0]
      .template Arg<ffi::Buffer<ffi::F32>>()   // gate|up bias [E, 2I] or [0]
      .template Arg<ffi::Buffer<ffi::F32>>()   // down bias [E, H] or [0]
      .template Arg<ffi::Buffer<ffi::F32>>();  // NVFP4 scale2 [3, E] or [0]
}

// The arguments both routed-experts forward handlers start with.
static inline auto BindExpertsArgs() {
  return BindRoutingArgs(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>());  // x [T, H]
}

// A stack's adapters (lora.h): the rows' ids, then A, B, scale of gate, up and down (each empty when absent).
template <typename Binding>
static auto BindLoRAArgs(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::S32>>()   // adapter ids [T] (or [0]: no adapters)
      .template Arg<ffi::Buffer<ffi::F32>>()   // gate A [n, E, r, H] or [0]
      .template Arg<ffi::Buffer<ffi::F32>>()   // gate B [n, E, I, r] or [0]
      .template Arg<ffi::Buffer<ffi::F32>>()   // gate scale [n] or [0]
      .template Arg<ffi::Buffer<ffi::F32>>()   // up A
      .template Arg<ffi::Buffer<ffi::F32>>()   // up B
      .template Arg<ffi::Buffer<ffi::F32>>()   // up scale
      .template Arg<ffi::Buffer<ffi::F32>>()   // down A [n, E, r, I] or [0]
      .template Arg<ffi::Buffer<ffi::F32>>()   // down B [n, E, H, r] or [0]
      .template Arg<ffi::Buffer<ffi::F32>>();  // down scale
}

// The weights' format, the activation and the thread bound: the attributes every routed-experts handler takes.
template <typename Binding>
static auto BindExpertsAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<int64_t>("fmt")
      .template Attr<int64_t>("num_experts")
      .template Attr<int64_t>("intermediate")
      .template Attr<int64_t>("group")
      .template Attr<int64_t>("fields_per_proj")
      .template Attr<int64_t>("per_expert")
      .template Attr<int64_t>("act_kind")
      .template Attr<int64_t>("has_limit")
      .template Attr<float>("limit")
      .template Attr<float>("alpha")
      .template Attr<int64_t>("clamp_after")
      .template Attr<int64_t>("max_threads");
}

// The weight buffers, the result and the attributes both forward handlers end with, after `binding`'s arguments.
template <typename Binding>
static auto BindExpertsRest(Binding binding) {
  return BindExpertsAttrs(std::move(binding)
                              .RemainingArgs()                          // the weight buffers
                              .template Ret<ffi::Buffer<ffi::F32>>())  // out [T, H]
      .template Attr<int64_t>("act_group");  // 0: float32 activations; > 0: int8 per that many inputs (act8.h)
}

// A handler that returns an exception thrown by F (a failed allocation of the call's buffers) as an error to
// XLA instead of unwinding through the FFI's C boundary; the signature is F's.
template <auto F>
struct NoThrow;
template <typename... Args, ffi::Error (*F)(Args...)>
struct NoThrow<F> {
  static ffi::Error Call(Args... args) {
    try {
      return F(args...);
    } catch (const std::exception& err) {
      return ffi::Error::Internal(std::string("moejax native: ") + err.what());
    }
  }
};

}  // namespace moe
