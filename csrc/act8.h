// int8 activations for int8 and 4-bit weights (moejax.quantized.activations; Scheme.activations == "int8"), the
// ISA-independent part: the quantized inputs of one call. The kernels are act8_kernels.inc (once per ISA).
//
// An explicit option of the integer and 4-bit float formats (int8 / int4 symmetric / asymmetric, MXFP4, NVFP4),
// never a default. Per distinct input row of a projection, once per call (x for gate and up: once per row of the
// call whatever its experts; h for down: once per (expert, row) pair):
//   q = round_half_even(x / s) in [-127, 127] per group of `group` inputs, s = max|x_g| / 127 (NaN for a group
//   holding NaN or inf), and Σq per group.
// The weight codes are multiplied with q in integers, exactly inside a group (vpdpbusd with AVX-512 VNNI,
// vpmaddubsw / vpmaddwd on AVX2, a plain loop in the portable variant):
//   int8:  Σ (u - 128 - z)·q = Σ u·q - (128 + z)·Σq  (u the unsigned code 0..255, z the zero point or 0)
//   int4:  Σ (u - 8 - z)·q = Σ u·q - (8 + z)·Σq      (u the unsigned code 0..15)
//   e2m1:  Σ 2v·q = Σ t(u)·q - 12·Σq                   (t(u) = 2·e2m1(u) + 12 in 0..24, a 16-entry table)
// so the bytes multiplied are unsigned and a group's sum is one exact int32 isum (AVX2 forms int8's Σ u·q from
// the recentred codes by the sign trick, then adds 128·Σq back: the same integer). Then per output column, the
// groups in input order: tot = tot + (s_x · s_w') · float(isum), s_w' the weight's scale (halved for e2m1's 2v),
// starting from 0.0f: a product and a sum (no FMA), so the AVX-512, AVX2 and portable kernels give the same bits,
// and every output element is one fixed chain over its row's inputs (independent of T, the row's position, its
// neighbours and the threads).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace moe {

// The quantized inputs of one projection input for all pairs of a call, one stored row per distinct input: the
// pairs of one row of x (its experts, at decode all K of them) read one quantized copy, quantized once.
struct Act8Rows {
  int n = 0;       // inputs per row
  int group = 0;   // inputs per scale
  int groups = 0;  // ceil(n / group)
  int gstride = 0; // bytes per group of codes: group rounded up to 4, zero-padded (4 inputs per int32 lane)
  std::vector<int> row;        // [P] the stored row of each pair
  std::vector<int> source;     // [rows] a pair whose input a stored row quantizes
  std::vector<int8_t> q;       // [rows, groups * gstride]
  std::vector<float> scale;    // [rows, groups]
  std::vector<int32_t> total;  // [rows, groups] Σq

  // A row per pair (row: empty) or the given pair -> row map, with rows numbered 0.. in order of first use.
  void prepare(size_t P, int inputs, int group_size, const std::vector<int>* pair_row = nullptr) {
    n = inputs;
    group = group_size;
    groups = (n + group - 1) / group;
    gstride = (group + 3) / 4 * 4;
    source.clear();
    if (pair_row) {
      row = *pair_row;
      for (size_t p = 0; p < P; ++p)
        if (static_cast<size_t>(row[p]) == source.size()) source.push_back(static_cast<int>(p));
    } else {
      row.resize(P);
      source.resize(P);
      for (size_t p = 0; p < P; ++p) row[p] = source[p] = static_cast<int>(p);
    }
    const size_t rows = source.size();
    q.assign(rows * groups * gstride, 0);
    scale.assign(rows * groups, 0.0f);
    total.assign(rows * groups, 0);
  }
  int rows() const { return static_cast<int>(source.size()); }
  // Stored row i's group g.
  int8_t* stored_codes(int i, int g) { return q.data() + (static_cast<size_t>(i) * groups + g) * gstride; }
  // Pair p's group g.
  const int8_t* codes(int p, int g) const { return q.data() + (static_cast<size_t>(row[p]) * groups + g) * gstride; }
  float scale_of(int p, int g) const { return scale[static_cast<size_t>(row[p]) * groups + g]; }
  int32_t total_of(int p, int g) const { return total[static_cast<size_t>(row[p]) * groups + g]; }
};

// The int8 inputs of one call: the pairs' x (gate, up) and h (down).
struct Act8Job {
  int group = 0;
  Act8Rows x, h;
};

}  // namespace moe
