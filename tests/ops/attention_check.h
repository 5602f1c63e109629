// What the attention suites share (attention_test.cc, attention_cudnn_test.cc): the
// double-precision reference of causal attention, its per-dtype tolerances and inputs, one run of
// the op, and the comparisons of a run against the reference and against itself.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "octet/ops/attention.h"
#include "test_util.h"

namespace octet::testing::attention {

using ops::AttentionShape;

// ----------------------------------------------------------------------------
// Tolerances and inputs

/// Relative L2 error bounds against the double reference, per dtype.
struct Tolerance {
  double out;   ///< attention output
  double lse;   ///< log-sum-exp per query, against the size of its terms (lse_scale)
  double grad;  ///< dq, dk, dv
};
/// f32: all math in f32, sums of at most T terms, so errors stay within a few hundred float ulps
/// (2^-24 = 6e-8) even where dS = P (dP - delta) cancels.
inline constexpr Tolerance kF32Tolerance{1e-5, 1e-5, 1e-5};
/// bf16: exact bf16 inputs, f32 accumulation; the output is rounded to bf16 (2^-9 relative,
/// ~1e-3 in L2), and the CUDA kernels also round P and dS to bf16 for the tensor-core products.
/// lse is never rounded to bf16, so it keeps f32's bound.
inline constexpr Tolerance kBf16Tolerance{1e-2, 1e-5, 1e-2};

/// qkv values are uniform in [-kQkvRange, kQkvRange]: scores q.k/sqrt(D) then have a standard
/// deviation of kQkvRange^2/3 = 1.3, so softmax rows are peaked, not flat.
inline constexpr float kQkvRange = 2.0f;
/// Heads whose reference costs more than this many multiply-adds in total are sampled (three
/// heads) instead of checked all.
inline constexpr double kFullCheckBudget = 2e8;

inline const Tolerance& tolerance(DType dtype) {
  return dtype == DType::bf16 ? kBf16Tolerance : kF32Tolerance;
}

/// [B*T, 3*H*D] and [B*T, H*D] element indices, and [B, H, T] for lse.
struct Index {
  const AttentionShape& s;
  int64_t qkv(int64_t part, int64_t b, int64_t t, int64_t h) const {
    return (b * s.seq + t) * 3 * s.heads * s.head_dim + (part * s.heads + h) * s.head_dim;
  }
  int64_t out(int64_t b, int64_t t, int64_t h) const {
    return (b * s.seq + t) * s.heads * s.head_dim + h * s.head_dim;
  }
  int64_t lse(int64_t b, int64_t h, int64_t t) const { return (b * s.heads + h) * s.seq + t; }
};
inline constexpr int64_t kQ = 0, kK = 1, kV = 2;

// ----------------------------------------------------------------------------
// The double-precision reference, one head at a time

/// One head's forward (and optionally backward) in double, straight from the definitions:
/// P = softmax(mask(Q K^T / sqrt(D))), O = P V, lse = log sum exp; dV = P^T dO, dP = dO V^T,
/// dS = P o (dP - rowsum(P o dP)), dQ = dS K / sqrt(D), dK = dS^T Q / sqrt(D).
struct HeadReference {
  std::vector<double> out, lse, dq, dk, dv;  ///< [T, D] (lse [T])
  /// Per query, the size of the terms its lse is computed from: the largest sum of |q_d k_d| /
  /// sqrt(D) over its keys, plus log(keys) + 1. |lse| never exceeds it, and an f32 lse's rounding
  /// error is a multiple of it, also where the scores cancel and lse itself is near zero.
  std::vector<double> lse_scale;
};

inline HeadReference reference_head(const std::vector<float>& qkv, const std::vector<float>* dout,
                                    const AttentionShape& s, int64_t b, int64_t h) {
  const Index at{s};
  const int64_t T = s.seq, D = s.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const auto x = [&](int64_t part, int64_t t, int64_t d) {
    return static_cast<double>(qkv[at.qkv(part, b, t, h) + d]);
  };
  HeadReference r;
  r.out.assign(T * D, 0.0);
  r.lse.assign(T, 0.0);
  r.lse_scale.assign(T, 0.0);
  std::vector<double> p(T * T, 0.0);  // row i holds P_ij for j <= i
  for (int64_t i = 0; i < T; ++i) {
    double max_score = -INFINITY, max_magnitude = 0;
    for (int64_t j = 0; j <= i; ++j) {
      double dot = 0, magnitude = 0;
      for (int64_t d = 0; d < D; ++d) {
        const double term = x(kQ, i, d) * x(kK, j, d);
        dot += term;
        magnitude += std::abs(term);
      }
      p[i * T + j] = dot * scale;
      max_score = std::max(max_score, p[i * T + j]);
      max_magnitude = std::max(max_magnitude, magnitude * scale);
    }
    double sum = 0;
    for (int64_t j = 0; j <= i; ++j) sum += std::exp(p[i * T + j] - max_score);
    r.lse[i] = max_score + std::log(sum);
    r.lse_scale[i] = max_magnitude + std::log(static_cast<double>(i + 1)) + 1.0;
    for (int64_t j = 0; j <= i; ++j) {
      p[i * T + j] = std::exp(p[i * T + j] - r.lse[i]);
      for (int64_t d = 0; d < D; ++d) r.out[i * D + d] += p[i * T + j] * x(kV, j, d);
    }
  }
  if (dout == nullptr) return r;

  const auto g = [&](int64_t t, int64_t d) {
    return static_cast<double>((*dout)[at.out(b, t, h) + d]);
  };
  r.dq.assign(T * D, 0.0);
  r.dk.assign(T * D, 0.0);
  r.dv.assign(T * D, 0.0);
  std::vector<double> ds(T);
  for (int64_t i = 0; i < T; ++i) {
    double row = 0;  // rowsum(P o dP)
    for (int64_t j = 0; j <= i; ++j) {
      double dp = 0;
      for (int64_t d = 0; d < D; ++d) dp += g(i, d) * x(kV, j, d);
      ds[j] = dp;
      row += p[i * T + j] * dp;
    }
    for (int64_t j = 0; j <= i; ++j) {
      const double pij = p[i * T + j];
      const double dsij = pij * (ds[j] - row);
      for (int64_t d = 0; d < D; ++d) {
        r.dq[i * D + d] += dsij * x(kK, j, d) * scale;
        r.dk[j * D + d] += dsij * x(kQ, i, d) * scale;
        r.dv[j * D + d] += pij * g(i, d);
      }
    }
  }
  return r;
}

/// (b, h) pairs to check: all of them, or three when the reference would be too slow.
inline std::vector<std::pair<int64_t, int64_t>> heads_to_check(const AttentionShape& s) {
  const double cost = static_cast<double>(s.batch) * s.heads * s.seq * s.seq * s.head_dim;
  std::vector<std::pair<int64_t, int64_t>> heads;
  if (cost <= kFullCheckBudget) {
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t h = 0; h < s.heads; ++h) heads.push_back({b, h});
  } else {
    heads = {{0, 0}, {s.batch / 2, s.heads / 2}, {s.batch - 1, s.heads - 1}};
  }
  return heads;
}

/// Appends one head's [T, D] block of a token matrix (qkv part `part`, or out when part < 0).
inline void gather_head(const std::vector<float>& m, const AttentionShape& s, int64_t part,
                        int64_t b, int64_t h, std::vector<float>& into) {
  const Index at{s};
  for (int64_t t = 0; t < s.seq; ++t) {
    const int64_t base = part < 0 ? at.out(b, t, h) : at.qkv(part, b, t, h);
    into.insert(into.end(), m.begin() + base, m.begin() + base + s.head_dim);
  }
}

inline void append(const std::vector<double>& values, std::vector<float>& into) {
  for (double v : values) into.push_back(static_cast<float>(v));
}

// ----------------------------------------------------------------------------
// Running the op

inline Shape qkv_shape(const AttentionShape& s) {
  return {s.batch * s.seq, 3 * s.heads * s.head_dim};
}
inline Shape out_shape(const AttentionShape& s) { return {s.batch * s.seq, s.heads * s.head_dim}; }
inline Shape lse_shape(const AttentionShape& s) { return {s.batch, s.heads, s.seq}; }

/// Forward (and backward when dout is given) on the tensors' device.
struct Result {
  Tensor out, lse, dqkv;
};
inline Result run(const Tensor& qkv, const Tensor* dout, const AttentionShape& s) {
  const Device device = qkv.device();
  Result r;
  r.out = Tensor::empty(out_shape(s), qkv.dtype(), device);
  r.lse = Tensor::empty(lse_shape(s), DType::f32, device);
  ops::attention_forward(qkv, s, r.out, r.lse);
  if (dout != nullptr) {
    r.dqkv = Tensor::empty(qkv_shape(s), qkv.dtype(), device);
    ops::attention_backward(*dout, qkv, r.out, r.lse, s, r.dqkv);
  }
  return r;
}

/// A forward's errors against the reference, over heads_to_check: out's relative L2 error, and
/// lse's L2 error relative to the L2 norm of its lse_scale (a relative error of lse itself is
/// ill-conditioned: with one key, lse is one dot product, which may cancel to near zero).
struct ForwardErrors {
  double out = 0, lse = 0;
};
inline ForwardErrors forward_errors(const Tensor& qkv_host, const Result& r,
                                    const AttentionShape& s) {
  const std::vector<float> qkv = to_floats(qkv_host), out = to_floats(r.out),
                           lse = to_floats(r.lse);
  std::vector<float> got_out, want_out;
  double lse_error = 0, lse_norm = 0;
  for (const auto& [b, h] : heads_to_check(s)) {
    const HeadReference ref = reference_head(qkv, nullptr, s, b, h);
    gather_head(out, s, -1, b, h, got_out);
    append(ref.out, want_out);
    for (int64_t t = 0; t < s.seq; ++t) {
      const double diff = lse[Index{s}.lse(b, h, t)] - ref.lse[t];
      lse_error += diff * diff;
      lse_norm += ref.lse_scale[t] * ref.lse_scale[t];
    }
  }
  return {relative_l2(got_out, want_out), std::sqrt(lse_error / lse_norm)};
}

/// Relative L2 errors of a backward's dq, dk and dv (indexed kQ, kK, kV) against the reference.
inline std::array<double, 3> backward_errors(const Tensor& qkv_host, const Tensor& dout_host,
                                             const Result& r, const AttentionShape& s) {
  const std::vector<float> qkv = to_floats(qkv_host), g = to_floats(dout_host),
                           dqkv = to_floats(r.dqkv);
  std::vector<float> got[3], want[3];
  for (const auto& [b, h] : heads_to_check(s)) {
    const HeadReference ref = reference_head(qkv, &g, s, b, h);
    for (int64_t part : {kQ, kK, kV}) gather_head(dqkv, s, part, b, h, got[part]);
    append(ref.dq, want[kQ]);
    append(ref.dk, want[kK]);
    append(ref.dv, want[kV]);
  }
  return {relative_l2(got[kQ], want[kQ]), relative_l2(got[kK], want[kK]),
          relative_l2(got[kV], want[kV])};
}

/// Expects every gradient finite and three forward + backward runs equal as bytes (out, lse and
/// every gradient).
inline void expect_bitwise_repeatable(const Tensor& qkv, const Tensor& dout,
                                      const AttentionShape& s, int runs = 3) {
  const Result first = run(qkv, &dout, s);
  for (const float v : to_floats(first.dqkv)) ASSERT_TRUE(std::isfinite(v));
  for (int repeat = 1; repeat < runs; ++repeat) {
    const Result again = run(qkv, &dout, s);
    EXPECT_EQ(to_bytes(first.out), to_bytes(again.out)) << "out, run " << repeat;
    EXPECT_EQ(to_bytes(first.lse), to_bytes(again.lse)) << "lse, run " << repeat;
    EXPECT_EQ(to_bytes(first.dqkv), to_bytes(again.dqkv)) << "dqkv, run " << repeat;
  }
}

}  // namespace octet::testing::attention
