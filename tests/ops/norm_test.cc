// LayerNorm and RMSNorm on every backend against an independent double-precision reference:
// forward (y, mean, rstd), backward (dx, accumulated dgamma and dbeta), accumulation across
// calls, the fused FP8 cast against ops::quantize, central-difference gradients on the CPU,
// bitwise-repeatable dgamma/dbeta on the GPU, and the messages for bad inputs.
#include "octet/ops/norm.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "octet/ops/activation.h"
#include "ops/op_check.h"
#include "test_util.h"

namespace octet {
namespace {

using ops::FusedQuantize;
using testing::bitwise_equal;
using testing::close_to;
using testing::expect_error;
using testing::fresh_seed;
using testing::kF32ReductionTol;
using testing::make_tensor;
using testing::on;
using testing::output_rounding;
using testing::to_bytes;
using testing::to_floats;

/// PyTorch's LayerNorm default and GPT-2's value.
constexpr float kEps = 1e-5f;
/// x = kMeanOffset + uniform(-kSpread, kSpread): the offset makes LayerNorm's mean matter (and
/// a one-pass variance lose digits), the spread keeps rstd near 1.
constexpr float kMeanOffset = 1.5f;
constexpr float kSpread = 2.0f;
/// Smallest |gamma| and |beta| drawn (see make_inputs).
constexpr float kGammaMin = 0.25f;
constexpr float kBetaMin = 0.05f;

enum class Norm { layer, rms };

const char* norm_name(Norm n) { return n == Norm::layer ? "layernorm" : "rmsnorm"; }
void PrintTo(Norm n, std::ostream* out) { *out << norm_name(n); }

struct MatrixShape {
  int64_t rows, cols;
};
/// TE's awkward shapes (2333x1: a norm over one column), and a GPT-2 small activation.
/// Awkward shapes for the general kernels; {64, 768}, {77, 264} and {160, 1600} are rows that fit
/// a warp's registers (the CUDA warp-row forward), with a partial 32-row tile for 77 rows.
const std::vector<MatrixShape> kShapes = {{1, 3221}, {2333, 1}, {1481, 677},
                                          {64, 768}, {77, 264}, {160, 1600}};

struct NormCase {
  Device backend;
  DType dtype;
  MatrixShape shape;
  Norm norm;
};

std::vector<NormCase> norm_cases() {
  std::vector<NormCase> cases;
  for (const Device& backend : testing::all_backends())
    for (DType dtype : {DType::f32, DType::bf16})
      for (const MatrixShape& shape : kShapes)
        for (Norm norm : {Norm::layer, Norm::rms}) cases.push_back({backend, dtype, shape, norm});
  return cases;
}

void PrintTo(const NormCase& p, std::ostream* out) {
  *out << p.backend << " " << dtype_name(p.dtype) << " " << p.shape.rows << "x" << p.shape.cols
       << " " << norm_name(p.norm);
}

std::string norm_case_name(const ::testing::TestParamInfo<NormCase>& info) {
  const NormCase& p = info.param;
  return testing::device_name(p.backend) + "_" + std::string(dtype_name(p.dtype)) + "_" +
         std::to_string(p.shape.rows) + "x" + std::to_string(p.shape.cols) + "_" +
         norm_name(p.norm);
}

// ----------------------------------------------------------------------------
// Inputs, op runners and the reference

/// CPU tensors of one case and the values they hold (rounded to the dtype).
struct Inputs {
  Tensor x, dy, gamma, beta;
  std::vector<float> xv, dyv, gv, bv;
};

Inputs make_inputs(int64_t rows, int64_t cols, DType dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Inputs in;
  std::vector<float> x = testing::uniform_values(rows * cols, -kSpread, kSpread, rng);
  for (float& v : x) v += kMeanOffset;
  in.x = make_tensor(x, {rows, cols}, dtype);
  in.dy = make_tensor(testing::uniform_values(rows * cols, -1.0f, 1.0f, rng), {rows, cols}, dtype);
  // gamma and beta stay away from zero: a norm over one column outputs beta (LayerNorm) or
  // +-gamma (RMSNorm) on every row, and that output must not be ~0 (the fused-cast check raises
  // amax from a small value, and a vanishing output would test nothing).
  in.gamma =
      make_tensor(testing::signed_magnitudes(cols, kGammaMin, 1.5f, rng), {cols}, DType::f32);
  in.beta = make_tensor(testing::signed_magnitudes(cols, kBetaMin, 0.5f, rng), {cols}, DType::f32);
  in.xv = to_floats(in.x);
  in.dyv = to_floats(in.dy);
  in.gv = to_floats(in.gamma);
  in.bv = to_floats(in.beta);
  return in;
}

struct Forward {
  Tensor y, mean, rstd;  // mean stays undefined for RMSNorm
};

Forward alloc_forward(Norm norm, const Tensor& x) {
  Forward f;
  f.y = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (norm == Norm::layer) f.mean = Tensor::empty({x.rows()}, DType::f32, x.device());
  f.rstd = Tensor::empty({x.rows()}, DType::f32, x.device());
  return f;
}

void run_forward(Norm norm, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                 const Forward& f, const FusedQuantize* fused = nullptr) {
  if (norm == Norm::layer) {
    ops::layernorm_forward(x, gamma, beta, kEps, f.y, f.mean, f.rstd, fused);
  } else {
    ops::rmsnorm_forward(x, gamma, kEps, f.y, f.rstd, fused);
  }
}

struct Backward {
  Tensor dx, dgamma, dbeta;  // dbeta stays undefined for RMSNorm
};

/// dgamma and dbeta start from `grad_init` (f32 [cols] on the device; copied).
Backward alloc_backward(Norm norm, const Tensor& x, const Tensor& grad_init) {
  Backward b;
  b.dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  b.dgamma = grad_init.clone();
  if (norm == Norm::layer) b.dbeta = grad_init.clone();
  return b;
}

void run_backward(Norm norm, const Tensor& dy, const Tensor& x, const Tensor& gamma,
                  const Forward& f, const Backward& b, const Tensor& residual = Tensor(),
                  bool accumulate = true) {
  if (norm == Norm::layer) {
    ops::layernorm_backward(dy, x, gamma, f.mean, f.rstd, b.dx, b.dgamma, b.dbeta, residual,
                            accumulate);
  } else {
    ops::rmsnorm_backward(dy, x, gamma, f.rstd, b.dx, b.dgamma, residual, accumulate);
  }
}

/// Exact (double) results and the magnitude of the terms behind each (see close_to).
struct Reference {
  std::vector<double> y, y_mag, mean, mean_mag, rstd, rstd_mag;
  std::vector<double> dx, dx_mag, dgamma, dgamma_mag, dbeta, dbeta_mag;
};

Reference reference(Norm norm, const Inputs& in, int64_t rows, int64_t cols) {
  Reference r;
  const size_t n = static_cast<size_t>(rows * cols);
  r.y.resize(n), r.y_mag.resize(n), r.dx.resize(n), r.dx_mag.resize(n);
  r.dgamma.assign(cols, 0.0), r.dgamma_mag.assign(cols, 0.0);
  r.dbeta.assign(cols, 0.0), r.dbeta_mag.assign(cols, 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    const float* x = &in.xv[i * cols];
    const float* dy = &in.dyv[i * cols];
    double mean = 0.0, mean_abs = 0.0, var = 0.0;
    if (norm == Norm::layer) {
      for (int64_t c = 0; c < cols; ++c) mean += x[c], mean_abs += std::fabs(x[c]);
      mean /= cols, mean_abs /= cols;
    }
    for (int64_t c = 0; c < cols; ++c) var += (x[c] - mean) * (x[c] - mean);
    var /= cols;
    const double rstd = 1.0 / std::sqrt(var + kEps);
    r.mean.push_back(mean), r.mean_mag.push_back(mean_abs);
    r.rstd.push_back(rstd), r.rstd_mag.push_back(rstd);
    double m1 = 0.0, m2 = 0.0, a1 = 0.0, a2 = 0.0;  // mean(dxhat), mean(dxhat xhat), and |.|
    for (int64_t c = 0; c < cols; ++c) {
      const double xhat = (x[c] - mean) * rstd, dxhat = double(dy[c]) * in.gv[c];
      m1 += dxhat, a1 += std::fabs(dxhat), m2 += dxhat * xhat, a2 += std::fabs(dxhat * xhat);
    }
    m1 /= cols, a1 /= cols, m2 /= cols, a2 /= cols;
    if (norm == Norm::rms) m1 = a1 = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      const size_t k = static_cast<size_t>(i * cols + c);
      const double xhat = (x[c] - mean) * rstd;
      const double xhat_mag = (std::fabs(x[c]) + std::fabs(mean)) * rstd;
      const double beta = norm == Norm::layer ? in.bv[c] : 0.0;
      const double dxhat = double(dy[c]) * in.gv[c];
      r.y[k] = xhat * in.gv[c] + beta;
      r.y_mag[k] = xhat_mag * std::fabs(in.gv[c]) + std::fabs(beta);
      r.dx[k] = rstd * (dxhat - m1 - xhat * m2);
      r.dx_mag[k] = rstd * (std::fabs(dxhat) + a1 + xhat_mag * a2);
      r.dgamma[c] += dy[c] * xhat, r.dgamma_mag[c] += std::fabs(dy[c]) * xhat_mag;
      r.dbeta[c] += dy[c], r.dbeta_mag[c] += std::fabs(dy[c]);
    }
  }
  return r;
}

/// ref + init, with |init| added to the magnitude.
void add_initial(std::vector<double>& ref, std::vector<double>& mag,
                 const std::vector<float>& init) {
  for (size_t c = 0; c < ref.size(); ++c) ref[c] += init[c], mag[c] += std::fabs(init[c]);
}

// ----------------------------------------------------------------------------
// Parity with the reference

using NormParity = testing::SeededParityTest<NormCase>;

TEST_P(NormParity, ForwardMatchesDoubleReference) {
  const NormCase& p = GetParam();
  const int64_t rows = p.shape.rows, cols = p.shape.cols;
  const Inputs in = make_inputs(rows, cols, p.dtype, seed);
  const Reference ref = reference(p.norm, in, rows, cols);
  const Tensor x = on(in.x, p.backend);
  const Forward f = alloc_forward(p.norm, x);
  run_forward(p.norm, x, on(in.gamma, p.backend), on(in.beta, p.backend), f);

  EXPECT_TRUE(
      close_to(to_floats(f.y), ref.y, ref.y_mag, kF32ReductionTol, output_rounding(p.dtype)))
      << "y";
  EXPECT_TRUE(close_to(to_floats(f.rstd), ref.rstd, ref.rstd_mag, kF32ReductionTol, 0.0)) << "rstd";
  if (p.norm == Norm::layer)
    EXPECT_TRUE(close_to(to_floats(f.mean), ref.mean, ref.mean_mag, kF32ReductionTol, 0.0))
        << "mean";
}

TEST_P(NormParity, BackwardMatchesDoubleReference) {
  const NormCase& p = GetParam();
  const int64_t rows = p.shape.rows, cols = p.shape.cols;
  const Inputs in = make_inputs(rows, cols, p.dtype, seed);
  Reference ref = reference(p.norm, in, rows, cols);
  const Tensor x = on(in.x, p.backend), gamma = on(in.gamma, p.backend);
  const Forward f = alloc_forward(p.norm, x);
  run_forward(p.norm, x, gamma, on(in.beta, p.backend), f);
  // The parameter gradients accumulate: start them from earlier values.
  const Tensor init = testing::random_tensor({cols}, DType::f32, seed + 1);
  const std::vector<float> init_values = to_floats(init);
  const Backward b = alloc_backward(p.norm, x, on(init, p.backend));
  run_backward(p.norm, on(in.dy, p.backend), x, gamma, f, b);

  EXPECT_TRUE(
      close_to(to_floats(b.dx), ref.dx, ref.dx_mag, kF32ReductionTol, output_rounding(p.dtype)))
      << "dx";
  add_initial(ref.dgamma, ref.dgamma_mag, init_values);
  EXPECT_TRUE(close_to(to_floats(b.dgamma), ref.dgamma, ref.dgamma_mag, kF32ReductionTol, 0.0))
      << "dgamma";
  if (p.norm == Norm::layer) {
    add_initial(ref.dbeta, ref.dbeta_mag, init_values);
    EXPECT_TRUE(close_to(to_floats(b.dbeta), ref.dbeta, ref.dbeta_mag, kF32ReductionTol, 0.0))
        << "dbeta";
  }
}

/// Two backward calls from zero leave exactly twice the first call's gradients: each call adds
/// its whole sum once, and computes the same sum both times. A third call without accumulation
/// (a step's first write, ZeroGrad::on_next_write) leaves bitwise the first call's gradients,
/// whatever they held.
TEST_P(NormParity, GradientsAccumulateAcrossCallsOrAreOverwritten) {
  const NormCase& p = GetParam();
  const int64_t rows = p.shape.rows, cols = p.shape.cols;
  const Inputs in = make_inputs(rows, cols, p.dtype, seed);
  const Tensor x = on(in.x, p.backend), gamma = on(in.gamma, p.backend);
  const Tensor dy = on(in.dy, p.backend);
  const Forward f = alloc_forward(p.norm, x);
  run_forward(p.norm, x, gamma, on(in.beta, p.backend), f);
  const Backward b = alloc_backward(p.norm, x, Tensor::zeros({cols}, DType::f32, p.backend));
  run_backward(p.norm, dy, x, gamma, f, b);
  const Tensor dx_once = b.dx.clone();
  const std::vector<float> dgamma_once = to_floats(b.dgamma);
  const std::vector<float> dbeta_once = p.norm == Norm::layer ? to_floats(b.dbeta) : dgamma_once;
  run_backward(p.norm, dy, x, gamma, f, b);

  EXPECT_TRUE(bitwise_equal(dx_once, b.dx)) << "dx of the second call";
  std::vector<float> twice(cols);
  for (int64_t c = 0; c < cols; ++c) twice[c] = dgamma_once[c] + dgamma_once[c];
  EXPECT_TRUE(bitwise_equal(Tensor::from_vector(twice, {cols}), b.dgamma)) << "dgamma";
  if (p.norm == Norm::layer) {
    for (int64_t c = 0; c < cols; ++c) twice[c] = dbeta_once[c] + dbeta_once[c];
    EXPECT_TRUE(bitwise_equal(Tensor::from_vector(twice, {cols}), b.dbeta)) << "dbeta";
  }

  run_backward(p.norm, dy, x, gamma, f, b, Tensor(), /*accumulate=*/false);
  EXPECT_TRUE(bitwise_equal(dx_once, b.dx)) << "dx of the overwriting call";
  EXPECT_TRUE(bitwise_equal(Tensor::from_vector(dgamma_once, {cols}), b.dgamma))
      << "overwritten dgamma";
  if (p.norm == Norm::layer) {
    EXPECT_TRUE(bitwise_equal(Tensor::from_vector(dbeta_once, {cols}), b.dbeta))
        << "overwritten dbeta";
  }
}

TEST_P(NormParity, ResidualIsAddedAsASeparateAddWould) {
  const NormCase& p = GetParam();
  const int64_t rows = p.shape.rows, cols = p.shape.cols;
  const Inputs in = make_inputs(rows, cols, p.dtype, seed);
  const Tensor x = on(in.x, p.backend), gamma = on(in.gamma, p.backend);
  const Tensor dy = on(in.dy, p.backend);
  const Tensor residual =
      on(make_tensor(testing::uniform_values(rows * cols, -2.0f, 2.0f, rng), {rows, cols}, p.dtype),
         p.backend);
  const Forward f = alloc_forward(p.norm, x);
  run_forward(p.norm, x, gamma, on(in.beta, p.backend), f);
  const Tensor zeros = Tensor::zeros({cols}, DType::f32, p.backend);
  const Backward plain = alloc_backward(p.norm, x, zeros);
  run_backward(p.norm, dy, x, gamma, f, plain);
  ops::add(plain.dx, residual, plain.dx);
  const Backward fused = alloc_backward(p.norm, x, zeros);
  run_backward(p.norm, dy, x, gamma, f, fused, residual);
  EXPECT_TRUE(bitwise_equal(plain.dx, fused.dx)) << "dx";
  EXPECT_TRUE(bitwise_equal(plain.dgamma, fused.dgamma)) << "dgamma";
  if (p.norm == Norm::layer) EXPECT_TRUE(bitwise_equal(plain.dbeta, fused.dbeta)) << "dbeta";
}

TEST_P(NormParity, FusedCastMatchesUnfused) {
  const NormCase& p = GetParam();
  const Inputs in = make_inputs(p.shape.rows, p.shape.cols, p.dtype, seed);
  const Tensor x = on(in.x, p.backend), gamma = on(in.gamma, p.backend);
  const Tensor beta = on(in.beta, p.backend);
  const Forward f = alloc_forward(p.norm, x);
  Forward fp8_only = f;  // no y: only the FP8 copies are wanted
  fp8_only.y = Tensor();
  for (const testing::FusedCase& c : testing::fused_cases()) {
    testing::expect_fused_matches_unfused(
        p.backend, f.y,
        [&](const FusedQuantize* fused) { run_forward(p.norm, x, gamma, beta, f, fused); }, c,
        [&](const FusedQuantize* fused) { run_forward(p.norm, x, gamma, beta, fp8_only, fused); });
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, NormParity, ::testing::ValuesIn(norm_cases()), norm_case_name);

/// Leading dimensions fold into rows: a [2, 3, cols] input normalizes like its [6, cols] view.
TEST(NormShapes, FoldsLeadingDimsIntoRows) {
  for (const Device& backend : testing::all_backends()) {
    if (backend.is_cuda() && cuda_device_count() == 0) continue;
    SCOPED_TRACE(backend.str());
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    const Inputs in = make_inputs(6, 40, DType::f32, seed);
    const Tensor x2 = on(in.x, backend), gamma = on(in.gamma, backend);
    const Tensor beta = on(in.beta, backend);
    const Tensor x3 = x2.view({2, 3, 40});
    const Forward f2 = alloc_forward(Norm::layer, x2), f3 = alloc_forward(Norm::layer, x3);
    run_forward(Norm::layer, x2, gamma, beta, f2);
    run_forward(Norm::layer, x3, gamma, beta, f3);
    EXPECT_TRUE(bitwise_equal(f2.y.view({2, 3, 40}), f3.y));
    EXPECT_TRUE(bitwise_equal(f2.rstd, f3.rstd));
  }
}

// ----------------------------------------------------------------------------
// Gradients by central differences (CPU, f32)

/// Small rows keep the 2 x numel forward calls cheap; 1 column checks the degenerate row.
const std::vector<MatrixShape> kGradientShapes = {{3, 7}, {4, 32}, {5, 1}};
/// Step of the central differences: large enough that f32 rounding of the loss (~1e-7
/// relative) stays small after dividing by 2h, small enough that the O(h^2) truncation does.
constexpr float kFdStep = 1e-2f;
constexpr double kFdAbsTol = 2e-3;
constexpr double kFdRelTol = 2e-3;
/// RMSNorm over one column is steep near x = 0 (dy/dx = gamma eps / (x^2 + eps)^1.5, ~9 gamma at
/// |x| = 0.01), where a central difference of step kFdStep is meaningless: inputs are kept this
/// far from 0.
constexpr float kFdMinAbsX = 0.25f;

class NormGradient : public ::testing::TestWithParam<std::tuple<Norm, int>> {};

TEST_P(NormGradient, MatchesCentralDifferences) {
  const auto [norm, shape_index] = GetParam();
  const MatrixShape shape = kGradientShapes[shape_index];
  const int64_t rows = shape.rows, cols = shape.cols;
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << ", " << rows << "x" << cols);
  const Inputs in = make_inputs(rows, cols, DType::f32, seed);
  const Tensor x = in.x.clone(), gamma = in.gamma.clone(), beta = in.beta.clone();
  for (int64_t i = 0; i < x.numel(); ++i) {
    float& v = x.data<float>()[i];
    if (std::fabs(v) < kFdMinAbsX) v = std::copysign(kFdMinAbsX, v);
  }
  const Forward f = alloc_forward(norm, x);
  run_forward(norm, x, gamma, beta, f);
  const Backward b = alloc_backward(norm, x, Tensor::zeros({cols}, DType::f32));
  run_backward(norm, in.dy, x, gamma, f, b);

  // L = sum(dy * y), so dL/dp is what backward returns for output gradient dy.
  const auto forward = [&] {
    const Forward out = alloc_forward(norm, x);
    run_forward(norm, x, gamma, beta, out);
    return to_floats(out.y);
  };
  EXPECT_TRUE(testing::matches_central_differences(x, forward, in.dyv, to_floats(b.dx), kFdStep,
                                                   kFdAbsTol, kFdRelTol))
      << "dx";
  EXPECT_TRUE(testing::matches_central_differences(gamma, forward, in.dyv, to_floats(b.dgamma),
                                                   kFdStep, kFdAbsTol, kFdRelTol))
      << "dgamma";
  if (norm == Norm::layer) {
    EXPECT_TRUE(testing::matches_central_differences(beta, forward, in.dyv, to_floats(b.dbeta),
                                                     kFdStep, kFdAbsTol, kFdRelTol))
        << "dbeta";
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, NormGradient,
                         ::testing::Combine(::testing::Values(Norm::layer, Norm::rms),
                                            ::testing::Values(0, 1, 2)),
                         [](const auto& info) {
                           const MatrixShape s = kGradientShapes[std::get<1>(info.param)];
                           return std::string(norm_name(std::get<0>(info.param))) + "_" +
                                  std::to_string(s.rows) + "x" + std::to_string(s.cols);
                         });

// ----------------------------------------------------------------------------
// Determinism (GPU)

/// Large enough that an order depending on scheduling would show (FIELD-NOTES.md section 3:
/// small shapes were stable by luck): 4096 rows reduce into every column.
constexpr MatrixShape kDeterminismShape = {4096, 1024};
constexpr int kDeterminismRuns = 3;

class NormDeterminism : public ::testing::TestWithParam<std::tuple<DType, Norm>> {};

TEST_P(NormDeterminism, RepeatedRunsAreBitwiseEqual) {
  const auto [dtype, norm] = GetParam();
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const int64_t rows = kDeterminismShape.rows, cols = kDeterminismShape.cols;
  const Inputs in = make_inputs(rows, cols, dtype, seed);
  const Tensor x = on(in.x, gpu), gamma = on(in.gamma, gpu), beta = on(in.beta, gpu);
  const Tensor dy = on(in.dy, gpu);
  const Tensor init = on(testing::random_tensor({cols}, DType::f32, seed + 1), gpu);
  std::vector<std::vector<uint8_t>> first;
  for (int run = 0; run < kDeterminismRuns; ++run) {
    const Forward f = alloc_forward(norm, x);
    run_forward(norm, x, gamma, beta, f);
    const Backward b = alloc_backward(norm, x, init);
    run_backward(norm, dy, x, gamma, f, b);
    std::vector<std::vector<uint8_t>> bytes = {to_bytes(f.y), to_bytes(f.rstd), to_bytes(b.dx),
                                               to_bytes(b.dgamma)};
    if (norm == Norm::layer) bytes.push_back(to_bytes(b.dbeta));
    for (float v : to_floats(b.dgamma)) ASSERT_TRUE(std::isfinite(v)) << "dgamma not finite";
    if (run == 0) {
      first = bytes;
      continue;
    }
    const char* names[] = {"y", "rstd", "dx", "dgamma", "dbeta"};
    for (size_t i = 0; i < bytes.size(); ++i)
      EXPECT_TRUE(bytes[i] == first[i]) << names[i] << " of run " << run << " differs from run 0";
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, NormDeterminism,
                         ::testing::Combine(::testing::Values(DType::f32, DType::bf16),
                                            ::testing::Values(Norm::layer, Norm::rms)),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) + "_" +
                                  norm_name(std::get<1>(info.param));
                         });

// ----------------------------------------------------------------------------
// Bad inputs

TEST(NormBadInput, RefusedWithMessages) {
  const Tensor x = Tensor::zeros({4, 8}, DType::f32);
  const Tensor gamma = Tensor::zeros({8}, DType::f32), beta = Tensor::zeros({8}, DType::f32);
  const Tensor y = Tensor::empty({4, 8}, DType::f32);
  const Tensor mean = Tensor::empty({4}, DType::f32), rstd = Tensor::empty({4}, DType::f32);
  expect_error(
      [&] {
        ops::layernorm_forward(x, gamma, beta, kEps, Tensor::empty({4, 9}, DType::f32), mean, rstd);
      },
      {"layernorm_forward", "shape mismatch: y expected shape [4, 8]", "f32[4, 9]"});
  expect_error(
      [&] {
        ops::layernorm_forward(x, gamma, beta, kEps, Tensor::empty({4, 8}, DType::bf16), mean,
                               rstd);
      },
      {"layernorm_forward", "dtype mismatch: y", "bf16[4, 8]"});
  expect_error([&] { ops::rmsnorm_forward(x, gamma, kEps, Tensor(), rstd); },
               {"rmsnorm_forward", "y is an undefined tensor", "or a fused FP8 output"});
  expect_error(
      [&] {
        ops::rmsnorm_forward(Tensor::zeros({4, 8}, DType::e4m3), gamma, kEps, y, rstd);
      },
      {"rmsnorm_forward", "unsupported dtype for x: expected f32 or bf16", "e4m3[4, 8]"});
  expect_error(
      [&] { ops::layernorm_forward(x, Tensor::zeros({7}, DType::f32), beta, kEps, y, mean, rstd); },
      {"shape mismatch: gamma expected f32[8]", "f32[7]"});
  expect_error([&] { ops::rmsnorm_forward(x, Tensor::zeros({8}, DType::bf16), kEps, y, rstd); },
               {"unsupported dtype for gamma: expected f32[8]", "bf16[8]"});
  expect_error(
      [&] {
        ops::layernorm_forward(x, gamma, beta, kEps, y, Tensor::empty({5}, DType::f32), rstd);
      },
      {"shape mismatch: mean expected f32[4]", "f32[5]"});
  expect_error([&] { ops::layernorm_forward(x, gamma, beta, -1.0f, y, mean, rstd); },
               {"eps must be finite and >= 0", "-1"});
  expect_error(
      [&] {
        ops::rmsnorm_forward(Tensor::zeros({0, 8}, DType::f32), gamma, kEps,
                             Tensor::zeros({0, 8}, DType::f32), Tensor::zeros({0}, DType::f32));
      },
      {"rmsnorm_forward", "x is an empty tensor", "f32[0, 8]"});
  expect_error(
      [&] {
        ops::layernorm_backward(x, x, gamma, mean, rstd, y, Tensor::zeros({8}, DType::f32),
                                Tensor::zeros({3}, DType::f32));
      },
      {"layernorm_backward", "shape mismatch: dbeta expected f32[8]", "f32[3]"});
  expect_error(
      [&] {
        ops::rmsnorm_backward(Tensor::zeros({4, 8}, DType::bf16), x, gamma, rstd, y,
                              Tensor::zeros({8}, DType::f32));
      },
      {"rmsnorm_backward", "dtype mismatch: dy must have the dtype of x", "bf16[4, 8]"});
  // A fused FP8 output for the wrong shape.
  fp8::QuantizedTensor q = fp8::QuantizedTensor::allocate(
      8, 4, DType::e4m3, fp8::ScalingMode::per_tensor, {}, Device::cpu());
  const FusedQuantize fused{&q, {Tensor::from_vector({1.0f}, {1}), {}}};
  expect_error([&] { ops::layernorm_forward(x, gamma, beta, kEps, y, mean, rstd, &fused); },
               {"layernorm_forward",
                "the fused FP8 output is allocated for a [8, 4] matrix, expected [4, 8]"});
  const FusedQuantize no_out{nullptr, {}};
  expect_error([&] { ops::rmsnorm_forward(x, gamma, kEps, y, rstd, &no_out); },
               {"rmsnorm_forward", "fused.out is null"});
}

TEST(NormBadInput, MixedDevicesRefused) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  const Tensor x = Tensor::zeros({4, 8}, DType::f32, gpu);
  const Tensor gamma = Tensor::zeros({8}, DType::f32);  // on the CPU
  const Tensor y = Tensor::empty({4, 8}, DType::f32, gpu),
               rstd = Tensor::empty({4}, DType::f32, gpu);
  expect_error([&] { ops::rmsnorm_forward(x, gamma, kEps, y, rstd); },
               {"rmsnorm_forward", "all tensors must be on one device", "cuda:0", "cpu"});
  // The fused output's buffers must be on the op's device too.
  const Tensor gpu_gamma = on(gamma, gpu);
  fp8::QuantizedTensor q = fp8::QuantizedTensor::allocate(
      4, 8, DType::e4m3, fp8::ScalingMode::per_tensor, {}, Device::cpu());
  const FusedQuantize fused{&q, {Tensor::from_vector({1.0f}, {1}), {}}};
  expect_error([&] { ops::rmsnorm_forward(x, gpu_gamma, kEps, y, rstd, &fused); },
               {"rmsnorm_forward", "the fused FP8 output's data is on cpu, expected cuda:0"});
}

}  // namespace
}  // namespace octet
