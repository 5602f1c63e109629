// The parity suite of causal attention and RoPE (include/octet/ops/attention.h): every backend x
// dtype x shape against an independent double-precision reference written here (forward, lse,
// and the analytic gradients of backward), a finite-difference check of the CPU backward,
// RoPE against its formula and its inverse (round trip and adjointness), bytewise repeatability,
// and the messages of bad inputs.
#include "octet/ops/attention.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "octet/fp8/format.h"
#include "ops/op_check.h"
#include "test_util.h"

namespace octet {
namespace {

using ops::AttentionShape;
using testing::expect_error;
using testing::fresh_seed;
using testing::random_tensor;
using testing::relative_l2;
using testing::to_bytes;
using testing::to_floats;

// ----------------------------------------------------------------------------
// Tolerances and inputs

/// Relative L2 error bounds against the double reference, per dtype.
struct Tolerance {
  double out;   ///< attention output
  double lse;   ///< log-sum-exp per query
  double grad;  ///< dq, dk, dv
};
/// f32: all math in f32, sums of at most T terms, so errors stay within a few hundred float ulps
/// (2^-24 = 6e-8) even where dS = P (dP - delta) cancels.
constexpr Tolerance kF32Tolerance{1e-5, 1e-5, 1e-5};
/// bf16: exact bf16 inputs, f32 accumulation; the output is rounded to bf16 (2^-9 relative,
/// ~1e-3 in L2), and the CUDA kernels also round P and dS to bf16 for the tensor-core products.
/// lse is never rounded to bf16, so it keeps f32's bound.
constexpr Tolerance kBf16Tolerance{1e-2, 1e-5, 1e-2};

/// qkv values are uniform in [-kQkvRange, kQkvRange]: scores q.k/sqrt(D) then have a standard
/// deviation of kQkvRange^2/3 = 1.3, so softmax rows are peaked, not flat.
constexpr float kQkvRange = 2.0f;
/// The RoPE base of GPT-NeoX and Llama.
constexpr float kRopeTheta = 10000.0f;
/// Heads whose reference costs more than this many multiply-adds in total are sampled (three
/// heads) instead of checked all.
constexpr double kFullCheckBudget = 2e8;

const Tolerance& tolerance(DType dtype) {
  return dtype == DType::bf16 ? kBf16Tolerance : kF32Tolerance;
}

Tensor on(const Tensor& t, const Device& device) { return t.device() == device ? t : t.to(device); }

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
constexpr int64_t kQ = 0, kK = 1, kV = 2;

// ----------------------------------------------------------------------------
// The double-precision reference, one head at a time

/// One head's forward (and optionally backward) in double, straight from the definitions:
/// P = softmax(mask(Q K^T / sqrt(D))), O = P V, lse = log sum exp; dV = P^T dO, dP = dO V^T,
/// dS = P o (dP - rowsum(P o dP)), dQ = dS K / sqrt(D), dK = dS^T Q / sqrt(D).
struct HeadReference {
  std::vector<double> out, lse, dq, dk, dv;  ///< [T, D] (lse [T])
};

HeadReference reference_head(const std::vector<float>& qkv, const std::vector<float>* dout,
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
  std::vector<double> p(T * T, 0.0);  // row i holds P_ij for j <= i
  for (int64_t i = 0; i < T; ++i) {
    double max_score = -INFINITY;
    for (int64_t j = 0; j <= i; ++j) {
      double dot = 0;
      for (int64_t d = 0; d < D; ++d) dot += x(kQ, i, d) * x(kK, j, d);
      p[i * T + j] = dot * scale;
      max_score = std::max(max_score, p[i * T + j]);
    }
    double sum = 0;
    for (int64_t j = 0; j <= i; ++j) sum += std::exp(p[i * T + j] - max_score);
    r.lse[i] = max_score + std::log(sum);
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
std::vector<std::pair<int64_t, int64_t>> heads_to_check(const AttentionShape& s) {
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
void gather_head(const std::vector<float>& m, const AttentionShape& s, int64_t part, int64_t b,
                 int64_t h, std::vector<float>& into) {
  const Index at{s};
  for (int64_t t = 0; t < s.seq; ++t) {
    const int64_t base = part < 0 ? at.out(b, t, h) : at.qkv(part, b, t, h);
    into.insert(into.end(), m.begin() + base, m.begin() + base + s.head_dim);
  }
}

void append(const std::vector<double>& values, std::vector<float>& into) {
  for (double v : values) into.push_back(static_cast<float>(v));
}

// ----------------------------------------------------------------------------
// Running the op

struct Case {
  Device backend;
  DType dtype;
  AttentionShape shape;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return (c.backend.is_cpu() ? std::string("cpu") : "cuda" + std::to_string(c.backend.index)) +
         "_" + std::string(dtype_name(c.dtype)) + "_B" + std::to_string(c.shape.batch) + "_T" +
         std::to_string(c.shape.seq) + "_H" + std::to_string(c.shape.heads) + "_D" +
         std::to_string(c.shape.head_dim);
}

Shape qkv_shape(const AttentionShape& s) { return {s.batch * s.seq, 3 * s.heads * s.head_dim}; }
Shape out_shape(const AttentionShape& s) { return {s.batch * s.seq, s.heads * s.head_dim}; }
Shape lse_shape(const AttentionShape& s) { return {s.batch, s.heads, s.seq}; }

/// Forward (and backward when dout is given) on the tensors' device.
struct Result {
  Tensor out, lse, dqkv;
};
Result run(const Tensor& qkv, const Tensor* dout, const AttentionShape& s) {
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

class AttentionParity : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionParity, ForwardMatchesReference) {
  const auto& [device, dtype, s] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const Tensor qkv_host = random_tensor(qkv_shape(s), dtype, seed, kQkvRange);
  const Result r = run(on(qkv_host, device), nullptr, s);

  const std::vector<float> qkv = to_floats(qkv_host), out = to_floats(r.out),
                           lse = to_floats(r.lse);
  std::vector<float> got_out, want_out, got_lse, want_lse;
  for (const auto& [b, h] : heads_to_check(s)) {
    const HeadReference ref = reference_head(qkv, nullptr, s, b, h);
    gather_head(out, s, -1, b, h, got_out);
    append(ref.out, want_out);
    for (int64_t t = 0; t < s.seq; ++t) got_lse.push_back(lse[Index{s}.lse(b, h, t)]);
    append(ref.lse, want_lse);
  }
  const Tolerance& tol = tolerance(dtype);
  EXPECT_LE(relative_l2(got_out, want_out), tol.out);
  EXPECT_LE(relative_l2(got_lse, want_lse), tol.lse);
}

TEST_P(AttentionParity, BackwardMatchesReferenceGradients) {
  const auto& [device, dtype, s] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const Tensor qkv_host = random_tensor(qkv_shape(s), dtype, seed, kQkvRange);
  const Tensor dout_host = random_tensor(out_shape(s), dtype, seed + 1);
  const Tensor dout = on(dout_host, device);
  const Result r = run(on(qkv_host, device), &dout, s);

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
  const char* names[3] = {"dq", "dk", "dv"};
  for (int64_t part : {kQ, kK, kV}) {
    SCOPED_TRACE(names[part]);
    EXPECT_LE(relative_l2(got[part], want[part]), tolerance(dtype).grad);
  }
}

// ----------------------------------------------------------------------------
// RoPE

/// RoPE's absolute error per element, relative to the pair's magnitude, for each unit of
/// position: the angle pos * theta^(-2i/D) is an f32 product whose powf may differ by up to 4
/// ulps between glibc and CUDA (CUDA Programming Guide, "Mathematical Functions": powf 4 ulp),
/// i.e. 4 * 2^-24 * pos radians; sinf/cosf (2 ulp in CUDA) and the rotation's own rounding add
/// less than that. 1e-6 * (pos + 1) covers 4 * 6e-8 * pos with margin.
constexpr double kRopeF32PerPosition = 1e-6;
/// bf16 results are rounded to bf16 after the f32 rotation: half an ulp, up to 2^-8 relative (just
/// above a power of two). One whole ulp, 2^-7, leaves room for an f32 result that differs in its
/// last bits between backends and so rounds the other way.
constexpr double kRopeBf16Relative = 1.0 / 128;

TEST_P(AttentionParity, RopeMatchesFormulaAndInverts) {
  const auto& [device, dtype, s] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  if (s.head_dim % 2 != 0) GTEST_SKIP() << "rope needs an even head_dim";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const Tensor x_host = random_tensor(qkv_shape(s), dtype, seed);
  Tensor x = on(x_host, device).clone();
  ops::rope(x, s, kRopeTheta, /*inverse=*/false);

  const std::vector<float> in = to_floats(x_host), rotated = to_floats(x);
  const Index at{s};
  const int64_t D = s.head_dim;
  double worst = 0;  // largest error / allowed error
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t t = 0; t < s.seq; ++t) {
      for (int64_t i = 0; i < D / 2; ++i) {
        // The angle as the contract computes it in f32; its sine and cosine in double.
        const float angle =
            static_cast<float>(t) *
            std::pow(kRopeTheta, -2.0f * static_cast<float>(i) / static_cast<float>(D));
        const double c = std::cos(static_cast<double>(angle));
        const double sn = std::sin(static_cast<double>(angle));
        for (int64_t h = 0; h < s.heads; ++h) {
          for (int64_t part : {kQ, kK}) {
            const int64_t e = at.qkv(part, b, t, h) + 2 * i;
            const double x0 = in[e], x1 = in[e + 1];
            const double want[2] = {x0 * c - x1 * sn, x0 * sn + x1 * c};
            const double norm = std::hypot(x0, x1);
            for (int k = 0; k < 2; ++k) {
              double allowed = kRopeF32PerPosition * (t + 1) * norm;
              if (dtype == DType::bf16) allowed += kRopeBf16Relative * std::fabs(want[k]);
              worst = std::max(worst, std::fabs(rotated[e + k] - want[k]) / allowed);
            }
          }
          // v is not rotated: bit for bit unchanged.
          const int64_t e = at.qkv(kV, b, t, h) + 2 * i;
          ASSERT_EQ(std::memcmp(&in[e], &rotated[e], 2 * sizeof(float)), 0)
              << "v changed at b=" << b << " t=" << t << " h=" << h << " pair " << i;
        }
      }
    }
  }
  EXPECT_LE(worst, 1.0) << "largest RoPE error, in units of the allowed error";

  // The inverse undoes the rotation: the same sine and cosine with the sine negated, so only the
  // roundings of the two rotations remain (f32), plus one bf16 rounding per pass.
  ops::rope(x, s, kRopeTheta, /*inverse=*/true);
  const double round_trip = dtype == DType::bf16 ? 2 * kRopeBf16Relative : 1e-6;
  EXPECT_LE(relative_l2(to_floats(x), in), round_trip);
}

TEST_P(AttentionParity, RopeInverseIsTheAdjoint) {
  // The backward of rope is rope(inverse=true): <rope(x), y> == <x, rope_inverse(y)>, up to the
  // roundings of the results (f32, or one bf16 rounding per element).
  const auto& [device, dtype, s] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  if (s.head_dim % 2 != 0) GTEST_SKIP() << "rope needs an even head_dim";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const Tensor x_host = random_tensor(qkv_shape(s), dtype, seed);
  const Tensor y_host = random_tensor(qkv_shape(s), dtype, seed + 1);
  Tensor x = on(x_host, device).clone(), y = on(y_host, device).clone();
  ops::rope(x, s, kRopeTheta, false);
  ops::rope(y, s, kRopeTheta, true);
  const std::vector<float> rx = to_floats(x), ry = to_floats(y), x0 = to_floats(x_host),
                           y0 = to_floats(y_host);
  double lhs = 0, rhs = 0, magnitude = 0;
  for (size_t i = 0; i < rx.size(); ++i) {
    lhs += double(rx[i]) * y0[i];
    rhs += double(x0[i]) * ry[i];
    magnitude += std::fabs(double(x0[i]) * y0[i]);
  }
  const double relative = dtype == DType::bf16 ? kRopeBf16Relative : 1e-6;
  EXPECT_LE(std::fabs(lhs - rhs), relative * magnitude);
}

// ----------------------------------------------------------------------------
// Repeatability: three runs compared as bytes (forward outputs, lse and every gradient)

TEST_P(AttentionParity, RunsAreBitwiseRepeatable) {
  const auto& [device, dtype, s] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const Tensor qkv = on(random_tensor(qkv_shape(s), dtype, seed, kQkvRange), device);
  const Tensor dout = on(random_tensor(out_shape(s), dtype, seed + 1), device);
  const Result first = run(qkv, &dout, s);
  for (const float v : to_floats(first.dqkv)) ASSERT_TRUE(std::isfinite(v));
  for (int repeat = 1; repeat < 3; ++repeat) {
    const Result again = run(qkv, &dout, s);
    EXPECT_EQ(to_bytes(first.out), to_bytes(again.out)) << "out, run " << repeat;
    EXPECT_EQ(to_bytes(first.lse), to_bytes(again.lse)) << "lse, run " << repeat;
    EXPECT_EQ(to_bytes(first.dqkv), to_bytes(again.dqkv)) << "dqkv, run " << repeat;
  }
}

std::vector<Case> parity_cases() {
  const AttentionShape shapes[] = {
      {1, 1, 1, 8}, {2, 7, 3, 16}, {1, 33, 2, 64}, {2, 128, 4, 64}, {1, 257, 2, 128}};
  std::vector<Case> cases;
  for (const Device& backend : testing::all_backends())
    for (DType dtype : {DType::f32, DType::bf16})
      for (const AttentionShape& s : shapes) cases.push_back({backend, dtype, s});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Ops, AttentionParity, ::testing::ValuesIn(parity_cases()), case_name);

/// GPT-2 1.5B's attention (B=8, T=1024, H=25, D=64): the training shape of the fast kernels,
/// checked on three sampled heads. GPU only: the CPU reference backend would take minutes.
INSTANTIATE_TEST_SUITE_P(Gpt2Xl, AttentionParity,
                         ::testing::Values(Case{Device::cuda(0), DType::bf16, {8, 1024, 25, 64}}),
                         case_name);

// ----------------------------------------------------------------------------
// Finite differences of the CPU backward

/// Central-difference step. The loss is a sum of f32 outputs (noise ~1e-7 relative), so the
/// difference quotient carries ~1e-5 of noise and O(h^2) = 1e-4 of truncation error.
constexpr float kFdStep = 1e-2f;
/// Bound on the relative L2 gap between finite differences and backward: 10x the error budget
/// above (about 1e-5 is typical), and far below what a wrong term (a missing scale, a shifted mask:
/// O(1)) would give.
constexpr double kFdTolerance = 1e-3;

TEST(AttentionGradient, CpuBackwardMatchesFiniteDifferences) {
  const AttentionShape s{2, 5, 2, 4};
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Tensor qkv = random_tensor(qkv_shape(s), DType::f32, seed, kQkvRange);
  const Tensor projection = random_tensor(out_shape(s), DType::f32, seed + 1);
  const std::vector<float> r = to_floats(projection);
  const auto loss = [&] {  // L = <out, projection>, summed in double
    const Result res = run(qkv, nullptr, s);
    const std::vector<float> out = to_floats(res.out);
    double sum = 0;
    for (size_t i = 0; i < out.size(); ++i) sum += double(out[i]) * r[i];
    return sum;
  };
  const Result analytic = run(qkv, &projection, s);  // dL/dqkv with dout = projection
  std::vector<float> numeric;
  float* x = qkv.data<float>();
  for (int64_t e = 0; e < qkv.numel(); ++e) {
    const float x0 = x[e];
    x[e] = x0 + kFdStep;
    const double up_x = x[e], up = loss();
    x[e] = x0 - kFdStep;
    const double down_x = x[e], down = loss();
    x[e] = x0;
    numeric.push_back(static_cast<float>((up - down) / (up_x - down_x)));  // the steps taken
  }
  EXPECT_LE(relative_l2(to_floats(analytic.dqkv), numeric), kFdTolerance);
}

// ----------------------------------------------------------------------------
// Bad inputs

class AttentionValidation : public ::testing::Test {
 protected:
  const AttentionShape s{2, 7, 3, 16};
  Tensor qkv = random_tensor(qkv_shape(s), DType::f32, 1);
  Tensor out = Tensor::empty(out_shape(s), DType::f32);
  Tensor lse = Tensor::empty(lse_shape(s), DType::f32);
  Tensor dout = random_tensor(out_shape(s), DType::f32, 2);
  Tensor dqkv = Tensor::empty(qkv_shape(s), DType::f32);
};

TEST_F(AttentionValidation, ShapesMustMatchTheAttentionShape) {
  const Tensor narrow = Tensor::empty({14, 143}, DType::f32);
  expect_error([&] { ops::attention_forward(narrow, s, out, lse); },
               {"attention_forward", "qkv must be [batch*seq, 3*heads*head_dim] = [14, 144]",
                "(batch=2, seq=7, heads=3, head_dim=16)", "got f32[14, 143] on cpu"});
  const Tensor short_out = Tensor::empty({13, 48}, DType::f32);
  expect_error([&] { ops::attention_forward(qkv, s, short_out, lse); },
               {"out must be [batch*seq, heads*head_dim] = [14, 48]", "got f32[13, 48]"});
  const Tensor flat_dout = Tensor::empty({14 * 48}, DType::f32);
  expect_error([&] { ops::attention_backward(flat_dout, qkv, out, lse, s, dqkv); },
               {"attention_backward", "dout must be [batch*seq, heads*head_dim] = [14, 48]",
                "got f32[672]"});
  const Tensor wrong_dqkv = Tensor::empty({14, 48}, DType::f32);
  expect_error([&] { ops::attention_backward(dout, qkv, out, lse, s, wrong_dqkv); },
               {"dqkv must be [batch*seq, 3*heads*head_dim] = [14, 144]", "got f32[14, 48]"});
  expect_error([&] { ops::rope(narrow, s, kRopeTheta, false); },
               {"rope", "qkv must be [batch*seq, 3*heads*head_dim]", "got f32[14, 143]"});
}

TEST_F(AttentionValidation, LseMustBeF32BatchHeadsSeq) {
  const Tensor transposed = Tensor::empty({2, 7, 3}, DType::f32);
  expect_error([&] { ops::attention_forward(qkv, s, out, transposed); },
               {"lse must be f32[batch, heads, seq] = f32[2, 3, 7]", "got f32[2, 7, 3]"});
  const Tensor bf16_lse = Tensor::empty(lse_shape(s), DType::bf16);
  expect_error([&] { ops::attention_backward(dout, qkv, out, bf16_lse, s, dqkv); },
               {"lse must be f32[batch, heads, seq]", "got bf16[2, 3, 7]"});
}

TEST_F(AttentionValidation, DtypesMustBeF32OrBf16AndAgree) {
  const Tensor half = Tensor::empty(qkv_shape(s), DType::f16);
  expect_error([&] { ops::attention_forward(half, s, out, lse); },
               {"unsupported dtype for qkv: expected f32 or bf16, got f16[14, 144]"});
  expect_error([&] { ops::rope(half, s, kRopeTheta, true); },
               {"rope", "expected f32 or bf16, got f16"});
  const Tensor bf16_out = Tensor::empty(out_shape(s), DType::bf16);
  expect_error([&] { ops::attention_forward(qkv, s, bf16_out, lse); },
               {"out must have qkv's dtype f32, got bf16[14, 48]"});
  const Tensor bf16_dqkv = Tensor::empty(qkv_shape(s), DType::bf16);
  expect_error([&] { ops::attention_backward(dout, qkv, out, lse, s, bf16_dqkv); },
               {"dqkv must have qkv's dtype f32, got bf16[14, 144]"});
}

TEST_F(AttentionValidation, EmptyShapesAndUndefinedTensorsAreRefused) {
  expect_error(
      [&] {
        ops::attention_forward(qkv, {2, 0, 3, 16}, out, lse);
      },
      {"batch, seq, heads and head_dim in [1, 2147483647]",
       "got (batch=2, seq=0, heads=3, head_dim=16)"});
  expect_error([&] { ops::rope(qkv, {2, 7, -3, 16}, kRopeTheta, false); }, {"heads=-3"});
  expect_error([&] { ops::attention_forward(Tensor(), s, out, lse); },
               {"qkv is an undefined tensor"});
  expect_error([&] { ops::attention_backward(dout, qkv, out, Tensor(), s, dqkv); },
               {"lse is an undefined tensor"});
}

TEST_F(AttentionValidation, RopeNeedsEvenHeadDimAndPositiveTheta) {
  const AttentionShape odd{1, 3, 2, 5};
  const Tensor x = random_tensor(qkv_shape(odd), DType::f32, 3);
  expect_error([&] { ops::rope(x, odd, kRopeTheta, false); },
               {"head_dim must be even", "head_dim=5"});
  expect_error([&] { ops::rope(qkv, s, 0.0f, false); }, {"theta must be finite and > 0", "got 0"});
  expect_error([&] { ops::rope(qkv, s, NAN, false); }, {"theta must be finite and > 0"});
}

TEST_F(AttentionValidation, OutputsMustNotAliasInputs) {
  expect_error([&] { ops::attention_backward(dout, qkv, out, lse, s, qkv); },
               {"dqkv must not share memory with qkv"});
  const Tensor out_in_qkv = qkv.view({-1}).slice(0, 14 * 48).view(out_shape(s));
  expect_error([&] { ops::attention_forward(qkv, s, out_in_qkv, lse); },
               {"out must not share memory with qkv"});
}

TEST_F(AttentionValidation, DevicesMustNotMix) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  const Tensor gpu_qkv = qkv.to(gpu);
  expect_error([&] { ops::attention_forward(gpu_qkv, s, out.to(gpu), lse); },
               {"all tensors must be on one device", "qkv f32[14, 144] on cuda:0",
                "lse f32[2, 3, 7] on cpu"});
  expect_error(
      [&] { ops::attention_backward(dout, gpu_qkv, out.to(gpu), lse.to(gpu), s, dqkv.to(gpu)); },
      {"all tensors must be on one device", "dout f32[14, 48] on cpu"});
}

TEST_F(AttentionValidation, CudaHeadDimIsBounded) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  const AttentionShape wide{1, 2, 1, 258};
  const Tensor x = Tensor::zeros(qkv_shape(wide), DType::f32, gpu);
  const Tensor o = Tensor::empty(out_shape(wide), DType::f32, gpu);
  const Tensor l = Tensor::empty(lse_shape(wide), DType::f32, gpu);
  expect_error([&] { ops::attention_forward(x, wide, o, l); }, {"head_dim <= 256", "got 258"});
}

}  // namespace
}  // namespace octet
