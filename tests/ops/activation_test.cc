// GELU (tanh), SwiGLU and SReLU forward and backward, and the residual add, on every backend
// against an independent double-precision reference; the fused FP8 cast of y and of dx against
// ops::quantize; central-difference gradients on the CPU; the messages for bad inputs.
#include "octet/ops/activation.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "ops/op_check.h"
#include "test_util.h"

namespace octet {
namespace {

using ops::Activation;
using ops::FusedQuantize;
using testing::bitwise_equal;
using testing::close_to;
using testing::expect_error;
using testing::fresh_seed;
using testing::kF32ElementwiseTol;
using testing::make_tensor;
using testing::on;
using testing::output_rounding;
using testing::to_floats;

/// Inputs are uniform in [-kRange, kRange]: both tails of GELU and SiLU (tanh and the sigmoid
/// within a few percent of saturation) and SReLU's kink.
constexpr float kRange = 4.0f;

struct MatrixShape {
  int64_t rows, cols;  ///< of the output (swiglu's input has 2 * cols)
};
const std::vector<MatrixShape> kShapes = {{1, 3221}, {2333, 1}, {1481, 677}, {64, 768}};

struct ActCase {
  Device backend;
  DType dtype;
  MatrixShape shape;
  Activation act;
};

std::vector<ActCase> act_cases() {
  std::vector<ActCase> cases;
  for (const Device& backend : testing::all_backends())
    for (DType dtype : {DType::f32, DType::bf16})
      for (const MatrixShape& shape : kShapes)
        for (Activation act : {Activation::gelu, Activation::swiglu, Activation::srelu})
          cases.push_back({backend, dtype, shape, act});
  return cases;
}

std::string shape_name(const MatrixShape& s) {
  return std::to_string(s.rows) + "x" + std::to_string(s.cols);
}

void PrintTo(const ActCase& p, std::ostream* out) {
  *out << p.backend << " " << dtype_name(p.dtype) << " " << shape_name(p.shape) << " "
       << activation_name(p.act);
}

std::string act_case_name(const ::testing::TestParamInfo<ActCase>& info) {
  const ActCase& p = info.param;
  return testing::device_name(p.backend) + "_" + std::string(dtype_name(p.dtype)) + "_" +
         shape_name(p.shape) + "_" + activation_name(p.act);
}

// ----------------------------------------------------------------------------
// The reference: exact values (double) and the magnitude of the terms behind each

const double kGeluK0 = std::sqrt(2.0 / std::numbers::pi);
constexpr double kGeluK1 = 0.044715;

struct Value {
  double v, mag;
};

Value gelu(double x) {
  const double t = std::tanh(kGeluK0 * (x + kGeluK1 * x * x * x));
  return {0.5 * x * (1.0 + t), 0.5 * std::fabs(x) * (1.0 + std::fabs(t))};
}
Value gelu_grad(double x) {
  const double t = std::tanh(kGeluK0 * (x + kGeluK1 * x * x * x));
  const double inner = 0.5 * x * kGeluK0 * (1.0 + 3.0 * kGeluK1 * x * x);
  return {0.5 * (1.0 + t) + inner * (1.0 - t * t),
          0.5 * (1.0 + std::fabs(t)) + std::fabs(inner) * (1.0 + t * t)};
}
double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }
Value silu(double g) { return {g * sigmoid(g), std::fabs(g * sigmoid(g))}; }
Value silu_grad(double g) {
  const double s = sigmoid(g);
  return {s * (1.0 + g * (1.0 - s)), s * (1.0 + std::fabs(g) * (1.0 - s))};
}
Value srelu(double x) { return {x > 0 ? x * x : 0.0, x > 0 ? x * x : 0.0}; }
Value srelu_grad(double x) { return {x > 0 ? 2 * x : 0.0, x > 0 ? 2 * x : 0.0}; }

struct Expected {
  std::vector<double> v, mag;
  void push(Value x) { v.push_back(x.v), mag.push_back(x.mag); }
};

/// y for input values x ([rows, in_cols]).
Expected forward_reference(Activation act, const std::vector<float>& x, int64_t rows,
                           int64_t cols) {
  Expected e;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      if (act == Activation::swiglu) {
        const Value s = silu(x[r * 2 * cols + c]);
        const double up = x[r * 2 * cols + cols + c];
        e.push({s.v * up, s.mag * std::fabs(up)});
      } else {
        e.push(act == Activation::gelu ? gelu(x[r * cols + c]) : srelu(x[r * cols + c]));
      }
    }
  }
  return e;
}

/// dx for output gradient dy ([rows, cols]) and input x.
Expected backward_reference(Activation act, const std::vector<float>& dy,
                            const std::vector<float>& x, int64_t rows, int64_t cols) {
  Expected e;
  const auto times = [](double a, Value b) { return Value{a * b.v, std::fabs(a) * b.mag}; };
  for (int64_t r = 0; r < rows; ++r) {
    if (act == Activation::swiglu) {
      for (int64_t c = 0; c < cols; ++c) {  // dgate
        const double g = dy[r * cols + c], up = x[r * 2 * cols + cols + c];
        e.push(times(g * up, silu_grad(x[r * 2 * cols + c])));
      }
      for (int64_t c = 0; c < cols; ++c)  // dup
        e.push(times(dy[r * cols + c], silu(x[r * 2 * cols + c])));
    } else {
      for (int64_t c = 0; c < cols; ++c) {
        const double xv = x[r * cols + c];
        e.push(times(dy[r * cols + c], act == Activation::gelu ? gelu_grad(xv) : srelu_grad(xv)));
      }
    }
  }
  return e;
}

/// CPU tensor of `shape` uniform in [-kRange, kRange], and its values.
std::pair<Tensor, std::vector<float>> make_input(const Shape& shape, DType dtype,
                                                 std::mt19937_64& rng, float range = kRange) {
  Tensor t =
      make_tensor(testing::uniform_values(shape_numel(shape), -range, range, rng), shape, dtype);
  return {t, to_floats(t)};
}

// ----------------------------------------------------------------------------
// Parity with the reference

using ActivationParity = testing::SeededParityTest<ActCase>;

TEST_P(ActivationParity, ForwardMatchesDoubleReference) {
  const ActCase& p = GetParam();
  const int64_t rows = p.shape.rows, cols = p.shape.cols;
  const auto [x, xv] = make_input({rows, ops::activation_input_cols(p.act, cols)}, p.dtype, rng);
  const Tensor y = Tensor::empty({rows, cols}, p.dtype, p.backend);
  ops::activation_forward(p.act, on(x, p.backend), y);
  const Expected e = forward_reference(p.act, xv, rows, cols);
  EXPECT_TRUE(close_to(to_floats(y), e.v, e.mag, kF32ElementwiseTol, output_rounding(p.dtype)));
}

TEST_P(ActivationParity, BackwardMatchesDoubleReference) {
  const ActCase& p = GetParam();
  const int64_t rows = p.shape.rows, cols = p.shape.cols;
  const Shape in_shape = {rows, ops::activation_input_cols(p.act, cols)};
  const auto [x, xv] = make_input(in_shape, p.dtype, rng);
  const auto [dy, dyv] = make_input({rows, cols}, p.dtype, rng, 1.0f);
  const Tensor dx = Tensor::empty(in_shape, p.dtype, p.backend);
  ops::activation_backward(p.act, on(dy, p.backend), on(x, p.backend), dx);
  const Expected e = backward_reference(p.act, dyv, xv, rows, cols);
  EXPECT_TRUE(close_to(to_floats(dx), e.v, e.mag, kF32ElementwiseTol, output_rounding(p.dtype)));
}

TEST_P(ActivationParity, FusedCastMatchesUnfused) {
  const ActCase& p = GetParam();
  const int64_t rows = p.shape.rows, cols = p.shape.cols;
  const Shape in_shape = {rows, ops::activation_input_cols(p.act, cols)};
  const Tensor x = on(make_input(in_shape, p.dtype, rng).first, p.backend);
  const Tensor dy = on(make_input({rows, cols}, p.dtype, rng, 1.0f).first, p.backend);
  const Tensor y = Tensor::empty({rows, cols}, p.dtype, p.backend);
  const Tensor dx = Tensor::empty(in_shape, p.dtype, p.backend);
  for (const testing::FusedCase& c : testing::fused_cases()) {
    SCOPED_TRACE("forward");
    testing::expect_fused_matches_unfused(
        p.backend, y, [&](const FusedQuantize* f) { ops::activation_forward(p.act, x, y, f); }, c,
        [&](const FusedQuantize* f) { ops::activation_forward(p.act, x, Tensor(), f); });
  }
  for (const testing::FusedCase& c : testing::fused_cases()) {
    SCOPED_TRACE("backward");
    testing::expect_fused_matches_unfused(
        p.backend, dx,
        [&](const FusedQuantize* f) { ops::activation_backward(p.act, dy, x, dx, f); }, c,
        [&](const FusedQuantize* f) { ops::activation_backward(p.act, dy, x, Tensor(), f); });
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, ActivationParity, ::testing::ValuesIn(act_cases()), act_case_name);

// ----------------------------------------------------------------------------
// Residual add

struct AddCase {
  Device backend;
  DType dtype;
  MatrixShape shape;
};

std::vector<AddCase> add_cases() {
  std::vector<AddCase> cases;
  for (const Device& backend : testing::all_backends())
    for (DType dtype : {DType::f32, DType::bf16})
      for (const MatrixShape& shape : kShapes) cases.push_back({backend, dtype, shape});
  return cases;
}

void PrintTo(const AddCase& p, std::ostream* out) {
  *out << p.backend << " " << dtype_name(p.dtype) << " " << shape_name(p.shape);
}

class AddParity : public ::testing::TestWithParam<AddCase> {};

/// a + b is one correctly rounded f32 addition, then (bf16) one rounding to bf16: the result is
/// exactly what the host computes with the same two steps. Also in place (out aliasing a).
TEST_P(AddParity, MatchesRoundedSumAlsoInPlace) {
  const AddCase& p = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(p.backend);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const Shape shape = {p.shape.rows, p.shape.cols};
  const auto [a, av] = make_input(shape, p.dtype, rng);
  const auto [b, bv] = make_input(shape, p.dtype, rng);
  std::vector<float> sum(av.size());
  for (size_t i = 0; i < sum.size(); ++i) sum[i] = av[i] + bv[i];
  const Tensor expected = make_tensor(sum, shape, p.dtype);
  const Tensor da = on(a, p.backend), db = on(b, p.backend);
  const Tensor out = Tensor::empty(shape, p.dtype, p.backend);
  ops::add(da, db, out);
  EXPECT_TRUE(bitwise_equal(expected, out));
  const Tensor in_place = da.clone();
  ops::add(in_place, db, in_place);
  EXPECT_TRUE(bitwise_equal(expected, in_place)) << "in place";
}

INSTANTIATE_TEST_SUITE_P(Ops, AddParity, ::testing::ValuesIn(add_cases()),
                         [](const ::testing::TestParamInfo<AddCase>& info) {
                           const AddCase& p = info.param;
                           return testing::device_name(p.backend) + "_" +
                                  std::string(dtype_name(p.dtype)) + "_" + shape_name(p.shape);
                         });

// ----------------------------------------------------------------------------
// Gradients by central differences (CPU, f32)

/// Central differences with step h: f32 rounding of the loss stays ~1e-5 after dividing by 2h,
/// the O(h^2) truncation (third derivatives of order 1) likewise.
constexpr float kFdStep = 1e-2f;
constexpr double kFdAbsTol = 1e-3;
constexpr double kFdRelTol = 1e-3;
/// SReLU's second derivative jumps at 0, where a central difference has an O(h) error: inputs
/// are kept this far from 0.
constexpr float kFdKinkMargin = 4 * kFdStep;

class ActivationGradient : public ::testing::TestWithParam<Activation> {};

TEST_P(ActivationGradient, MatchesCentralDifferences) {
  const Activation act = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const int64_t rows = 3, cols = 11;
  const Shape in_shape = {rows, ops::activation_input_cols(act, cols)};
  Tensor x = make_input(in_shape, DType::f32, rng).first;
  for (int64_t i = 0; i < x.numel(); ++i) {
    float& v = x.data<float>()[i];
    if (std::fabs(v) < kFdKinkMargin) v = std::copysign(kFdKinkMargin, v);
  }
  const auto [dy, w] = make_input({rows, cols}, DType::f32, rng, 1.0f);
  const Tensor dx = Tensor::empty(in_shape, DType::f32);
  ops::activation_backward(act, dy, x, dx);
  const auto forward = [&] {
    const Tensor y = Tensor::empty({rows, cols}, DType::f32);
    ops::activation_forward(act, x, y);
    return to_floats(y);
  };
  EXPECT_TRUE(testing::matches_central_differences(x, forward, w, to_floats(dx), kFdStep, kFdAbsTol,
                                                   kFdRelTol));
}

INSTANTIATE_TEST_SUITE_P(Ops, ActivationGradient,
                         ::testing::Values(Activation::gelu, Activation::swiglu, Activation::srelu),
                         [](const auto& info) { return std::string(activation_name(info.param)); });

// ----------------------------------------------------------------------------
// Bad inputs

TEST(ActivationBadInput, RefusedWithMessages) {
  const Tensor x = Tensor::zeros({4, 8}, DType::f32);
  const Tensor y = Tensor::empty({4, 8}, DType::f32);
  expect_error([&] { ops::activation_forward(Activation::swiglu, x, y); },
               {"activation_forward", "shape mismatch: swiglu with y [4, 8] expects x [4, 16]",
                "f32[4, 8]"});
  expect_error(
      [&] {
        ops::activation_forward(Activation::gelu, x, Tensor::empty({4, 7}, DType::f32));
      },
      {"shape mismatch: gelu with y [4, 7] expects x [4, 7]"});
  expect_error(
      [&] {
        ops::activation_forward(Activation::gelu, x, Tensor::empty({4, 8}, DType::bf16));
      },
      {"dtype mismatch: y must have the dtype of x", "bf16[4, 8]"});
  expect_error(
      [&] {
        ops::activation_forward(Activation::srelu, Tensor::zeros({4, 8}, DType::i32), y);
      },
      {"unsupported dtype for x: expected f32 or bf16", "i32[4, 8]"});
  expect_error(
      [&] {
        ops::activation_backward(Activation::srelu, Tensor::zeros({4, 8}, DType::bf16), x, y);
      },
      {"activation_backward", "dtype mismatch: dy must have the dtype of x"});
  expect_error(
      [&] {
        ops::activation_backward(Activation::gelu, x, x, Tensor::empty({8, 4}, DType::f32));
      },
      {"activation_backward", "shape mismatch: dx expected shape [4, 8]"});
  expect_error(
      [&] {
        ops::activation_forward(Activation::gelu, Tensor::zeros({4, 0}, DType::f32),
                                Tensor::zeros({4, 0}, DType::f32));
      },
      {"activation_forward", "x is an empty tensor"});
  expect_error(
      [&] {
        ops::add(x, Tensor::zeros({4, 9}, DType::f32), y);
      },
      {"add", "shape mismatch: b expected shape [4, 8] (as a)", "f32[4, 9]"});
  expect_error(
      [&] {
        ops::add(x, x, Tensor::empty({4, 8}, DType::bf16));
      },
      {"add", "dtype mismatch: out must have the dtype of a"});
  fp8::QuantizedTensor q = fp8::QuantizedTensor::allocate(
      4, 16, DType::e4m3, fp8::ScalingMode::per_tensor, {}, Device::cpu());
  const FusedQuantize fused{&q, {Tensor::from_vector({1.0f}, {1}), {}}};
  expect_error([&] { ops::activation_forward(Activation::gelu, x, y, &fused); },
               {"activation_forward", "allocated for a [4, 16] matrix, expected [4, 8]"});
}

TEST(ActivationBadInput, MixedDevicesRefused) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  const Tensor x = Tensor::zeros({4, 8}, DType::f32, gpu);
  const Tensor y = Tensor::empty({4, 8}, DType::f32);  // on the CPU
  expect_error([&] { ops::activation_forward(Activation::gelu, x, y); },
               {"activation_forward", "all tensors must be on one device", "cuda:0", "cpu"});
  expect_error([&] { ops::add(x, x, y); }, {"add", "all tensors must be on one device"});
}

}  // namespace
}  // namespace octet
