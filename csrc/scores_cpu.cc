// moejax_scores: the router's scores (softmax over a row, sigmoid, softplus) of float32 logits [T, N], one scalar
// chain per value, so a row's bits do not depend on the rows beside it (moejax/backends/native_ops.py).
//
// Why: XLA:CPU's exp gives different bits in a loop's vectorized body and its scalar tail, and its reduce picks
// its loop order by the array's shape: a row's softmax changed in the last bit with the batch around it
// (docs/DESIGN.md, "Batch invariance"). Here every value is std::exp / std::log1p of that value alone, and a row's
// softmax sums its exps in column order. Rows are few and short (T x experts): one thread, no pool.

#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace scores {

enum Kind : int64_t { kSoftmax = 0, kSigmoid = 1, kSoftplus = 2 };

// exp(z - max) / Σ exp(z_j - max) over the row; a NaN anywhere in the row gives a NaN row (as jax.nn.softmax).
static void softmax_row(const float* z, float* out, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) m = (std::isnan(z[j]) || z[j] > m) ? z[j] : m;
  if (std::isnan(m)) {
    for (int64_t j = 0; j < n; ++j) out[j] = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    out[j] = std::exp(z[j] - m);
    sum += out[j];
  }
  for (int64_t j = 0; j < n; ++j) out[j] /= sum;
}

static float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

// log(1 + exp(z)) without overflow: max(z, 0) + log1p(exp(-|z|)) (jax.nn.softplus's logaddexp(z, 0)).
static float softplus(float z) {
  if (std::isnan(z)) return z;
  return std::fmax(z, 0.0f) + std::log1p(std::exp(-std::fabs(z)));
}

static ffi::Error ScoresCall(ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::F32> out, int64_t kind) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("moejax scores: logits must be [T, N]");
  const auto od = out->dimensions();
  if (od.size() != 2 || od[0] != dims[0] || od[1] != dims[1])
    return ffi::Error::InvalidArgument("moejax scores: out must be [T, N] as logits");
  const int64_t T = dims[0], N = dims[1];
  const float* z = logits.typed_data();
  float* y = out->typed_data();
  if (kind == kSoftmax) {
    for (int64_t t = 0; t < T; ++t) softmax_row(z + t * N, y + t * N, N);
  } else if (kind == kSigmoid) {
    for (int64_t i = 0; i < T * N; ++i) y[i] = sigmoid(z[i]);
  } else if (kind == kSoftplus) {
    for (int64_t i = 0; i < T * N; ++i) y[i] = softplus(z[i]);
  } else {
    return ffi::Error::InvalidArgument("moejax scores: kind must be 0 (softmax), 1 (sigmoid) or 2 (softplus)");
  }
  return ffi::Error::Success();
}

static ffi::Error ScoresImpl(ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::F32> out, int64_t kind) {
  try {
    return ScoresCall(logits, out, kind);
  } catch (const std::exception& err) {
    return ffi::Error::Internal(std::string("moejax scores: ") + err.what());
  }
}

}  // namespace scores

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoejaxScores, scores::ScoresImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits [T, N]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // scores [T, N]
                                  .Attr<int64_t>("kind"));
