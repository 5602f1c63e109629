// The parity suite of causal attention and RoPE (include/octet/ops/attention.h): every backend x
// dtype x shape against an independent double-precision reference (attention_check.h: forward, lse,
// and the analytic gradients of backward), a finite-difference check of the CPU backward,
// RoPE against its formula and its inverse (round trip and adjointness), bytewise repeatability,
// and the messages of bad inputs.
#include "octet/ops/attention.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "octet/fp8/format.h"
#include "ops/attention_check.h"
#include "ops/op_check.h"
#include "test_util.h"

namespace octet {
namespace {

using namespace testing::attention;  // the reference, tolerances and runs this suite shares
using ops::AttentionShape;
using testing::expect_error;
using testing::fresh_seed;
using testing::on;
using testing::random_tensor;
using testing::relative_l2;
using testing::to_bytes;
using testing::to_floats;

// ----------------------------------------------------------------------------
// Parity cases

/// The RoPE base of GPT-NeoX and Llama.
constexpr float kRopeTheta = 10000.0f;

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

/// Pins octet's own kernels: under the default (auto) cuDNN would take the bf16 cases, and
/// attention_cudnn_test.cc checks that path.
class AttentionParity : public ::testing::TestWithParam<Case> {
  ops::ScopedAttentionChoice flash_{ops::AttentionChoice::flash};
};

TEST_P(AttentionParity, ForwardMatchesReference) {
  const auto& [device, dtype, s] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const Tensor qkv_host = random_tensor(qkv_shape(s), dtype, seed, kQkvRange);
  const ForwardErrors errors = forward_errors(qkv_host, run(on(qkv_host, device), nullptr, s), s);
  EXPECT_LE(errors.out, tolerance(dtype).out);
  EXPECT_LE(errors.lse, tolerance(dtype).lse);
}

TEST_P(AttentionParity, BackwardMatchesReferenceGradients) {
  const auto& [device, dtype, s] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const Tensor qkv_host = random_tensor(qkv_shape(s), dtype, seed, kQkvRange);
  const Tensor dout_host = random_tensor(out_shape(s), dtype, seed + 1);
  const Tensor dout = on(dout_host, device);
  const std::array<double, 3> errors =
      backward_errors(qkv_host, dout_host, run(on(qkv_host, device), &dout, s), s);
  const char* names[3] = {"dq", "dk", "dv"};
  for (int64_t part : {kQ, kK, kV}) {
    SCOPED_TRACE(names[part]);
    EXPECT_LE(errors[part], tolerance(dtype).grad);
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
  expect_bitwise_repeatable(qkv, dout, s);
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
