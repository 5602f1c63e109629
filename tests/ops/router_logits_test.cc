// The router's GEMM (ops::router_logits and its backward): the CPU reference against double-
// precision sums within the bound of a recursive f32 sum, CUDA against the CPU bit for bit (both
// run every output as the same fma chain), across shapes that take every kernel path (vector and
// element-wise loads, more than 16 experts, partial token tiles), and bad inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "octet/ops/moe.h"
#include "ops/op_check.h"
#include "test_util.h"

namespace octet {
namespace {

using testing::bitwise_equal;
using testing::fresh_seed;
using testing::make_tensor;
using testing::on;
using testing::to_floats;

const Device kCpu = Device::cpu();
const Device kGpu = Device::cuda(0);

/// Unit roundoff of f32: a recursive sum of n terms is within n * u * sum|terms| of the exact one.
constexpr double kF32Unit = 1.0 / (1 << 24);

struct Shape3 {
  int64_t tokens, dim, experts;
};

std::string name(const Shape3& s) {
  return std::to_string(s.tokens) + "x" + std::to_string(s.dim) + "x" + std::to_string(s.experts);
}

struct Inputs {
  Tensor x, weight, dlogits, dx, dweight;
};

/// Random inputs of shape s; x and dx in `dtype`.
Inputs draw(const Shape3& s, DType dtype, std::mt19937_64& rng) {
  Inputs in;
  in.x = make_tensor(testing::uniform_values(s.tokens * s.dim, -2.0f, 2.0f, rng), {s.tokens, s.dim},
                     dtype);
  in.weight = make_tensor(testing::uniform_values(s.experts * s.dim, -0.1f, 0.1f, rng),
                          {s.experts, s.dim}, DType::f32);
  in.dlogits = make_tensor(testing::uniform_values(s.tokens * s.experts, -1.0f, 1.0f, rng),
                           {s.tokens, s.experts}, DType::f32);
  in.dx = make_tensor(testing::uniform_values(s.tokens * s.dim, -1.0f, 1.0f, rng),
                      {s.tokens, s.dim}, dtype);
  in.dweight = make_tensor(testing::uniform_values(s.experts * s.dim, -1.0f, 1.0f, rng),
                           {s.experts, s.dim}, DType::f32);
  return in;
}

struct Results {
  Tensor logits, dx, dweight;
};

/// Forward and backward on `device` from copies of the inputs (dx and dweight are updated in
/// place, so each run starts from its own copy).
Results run(const Inputs& in, const Device& device, bool accumulate) {
  Results r;
  const Tensor x = on(in.x, device), weight = on(in.weight, device);
  r.logits = Tensor::empty({in.x.rows(), in.weight.rows()}, DType::f32, device);
  ops::router_logits(x, weight, r.logits);
  r.dx = on(in.dx, device).clone();
  r.dweight = on(in.dweight, device).clone();
  ops::router_logits_backward(x, weight, on(in.dlogits, device), r.dx, r.dweight, accumulate);
  return r;
}

/// The shapes: vector loads (dim a multiple of 8), element-wise loads (dim odd), one token and one
/// expert, more experts than one CTA's 16, tokens past whole kRouterTileTokens tiles.
const std::vector<Shape3> kShapes = {{1, 8, 1},     {37, 203, 3},  {333, 256, 16},
                                     {600, 96, 40}, {513, 130, 7}, {1030, 2048, 16}};

class RouterLogitsTest : public ::testing::TestWithParam<DType> {};

/// The CPU reference against sums in double: logits and both gradients within n * u * sum|terms|
/// (n the chain's length), plus one rounding of dx to its dtype; dweight overwritten or added to.
TEST_P(RouterLogitsTest, CpuMatchesDoubleSums) {
  const DType dtype = GetParam();
  std::mt19937_64 rng(fresh_seed());
  for (const Shape3& s : {Shape3{5, 19, 3}, Shape3{300, 64, 16}}) {
    SCOPED_TRACE(name(s));
    const Inputs in = draw(s, dtype, rng);
    const std::vector<float> x = to_floats(in.x), w = to_floats(in.weight),
                             dl = to_floats(in.dlogits), dx0 = to_floats(in.dx),
                             dw0 = to_floats(in.dweight);
    for (bool accumulate : {false, true}) {
      SCOPED_TRACE(accumulate ? "accumulate" : "overwrite");
      const Results r = run(in, kCpu, accumulate);
      std::vector<double> logits(s.tokens * s.experts), logits_mag(logits.size());
      for (int64_t t = 0; t < s.tokens; ++t)
        for (int64_t e = 0; e < s.experts; ++e)
          for (int64_t k = 0; k < s.dim; ++k) {
            const double term = static_cast<double>(x[t * s.dim + k]) * w[e * s.dim + k];
            logits[t * s.experts + e] += term;
            logits_mag[t * s.experts + e] += std::fabs(term) * s.dim * kF32Unit;
          }
      EXPECT_TRUE(testing::close_to(to_floats(r.logits), logits, logits_mag, 1.0, 0.0)) << "logits";
      std::vector<double> dx(s.tokens * s.dim), dx_mag(dx.size());
      for (int64_t t = 0; t < s.tokens; ++t)
        for (int64_t k = 0; k < s.dim; ++k) {
          dx[t * s.dim + k] = dx0[t * s.dim + k];
          for (int64_t e = 0; e < s.experts; ++e) {
            const double term = static_cast<double>(dl[t * s.experts + e]) * w[e * s.dim + k];
            dx[t * s.dim + k] += term;
            dx_mag[t * s.dim + k] += std::fabs(term) * (s.experts + 1) * kF32Unit;
          }
          dx_mag[t * s.dim + k] += std::fabs(dx0[t * s.dim + k]) * kF32Unit;
        }
      EXPECT_TRUE(
          testing::close_to(to_floats(r.dx), dx, dx_mag, 1.0, testing::output_rounding(dtype)))
          << "dx";
      std::vector<double> dw(s.experts * s.dim), dw_mag(dw.size());
      for (int64_t e = 0; e < s.experts; ++e)
        for (int64_t k = 0; k < s.dim; ++k) {
          const int64_t i = e * s.dim + k;
          dw[i] = accumulate ? dw0[i] : 0.0;
          dw_mag[i] = accumulate ? std::fabs(dw0[i]) * kF32Unit : 0.0;
          for (int64_t t = 0; t < s.tokens; ++t) {
            const double term = static_cast<double>(dl[t * s.experts + e]) * x[t * s.dim + k];
            dw[i] += term;
            dw_mag[i] += std::fabs(term) * (s.tokens + 2) * kF32Unit;
          }
        }
      EXPECT_TRUE(testing::close_to(to_floats(r.dweight), dw, dw_mag, 1.0, 0.0)) << "dweight";
    }
  }
}

/// CUDA = CPU, bit for bit, on every shape (each output is the same fma chain on both).
TEST_P(RouterLogitsTest, CudaMatchesCpuBitwise) {
  OCTET_SKIP_IF_UNAVAILABLE(kGpu);
  const DType dtype = GetParam();
  std::mt19937_64 rng(fresh_seed());
  for (const Shape3& s : kShapes) {
    SCOPED_TRACE(name(s));
    const Inputs in = draw(s, dtype, rng);
    for (bool accumulate : {false, true}) {
      SCOPED_TRACE(accumulate ? "accumulate" : "overwrite");
      const Results cpu = run(in, kCpu, accumulate), gpu = run(in, kGpu, accumulate);
      EXPECT_TRUE(bitwise_equal(cpu.logits, gpu.logits)) << "logits";
      EXPECT_TRUE(bitwise_equal(cpu.dx, gpu.dx)) << "dx";
      EXPECT_TRUE(bitwise_equal(cpu.dweight, gpu.dweight)) << "dweight";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, RouterLogitsTest, ::testing::Values(DType::f32, DType::bf16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(RouterLogitsErrors, NameTheTensorAndItsExpectedShape) {
  std::mt19937_64 rng(fresh_seed());
  const Inputs in = draw({4, 8, 3}, DType::bf16, rng);
  const Tensor logits = Tensor::empty({4, 3}, DType::f32);
  testing::expect_error(
      [&] {
        ops::router_logits(in.x, in.weight.slice(0, 2), Tensor::empty({4, 2}, DType::f16));
      },
      {"router_logits", "logits must be f32 [4, 2]"});
  testing::expect_error(
      [&] {
        ops::router_logits(in.x, Tensor::empty({3, 7}, DType::f32), logits);
      },
      {"router_logits", "weight must be f32 [3, 8]"});
  testing::expect_error(
      [&] {
        ops::router_logits(Tensor::empty({4, 8}, DType::f16), in.weight, logits);
      },
      {"router_logits", "expected f32 or bf16"});
  testing::expect_error(
      [&] {
        ops::router_logits_backward(in.x, in.weight, in.dlogits, Tensor::empty({4, 8}, DType::f32),
                                    in.dweight, false);
      },
      {"router_logits_backward", "dx must be bf16 [4, 8]"});
  testing::expect_error(
      [&] {
        ops::router_logits_backward(in.x, in.weight, in.dlogits.slice(0, 2), in.dx, in.dweight,
                                    false);
      },
      {"router_logits_backward", "dlogits must be f32 [4, 3]"});
}

}  // namespace
}  // namespace octet
