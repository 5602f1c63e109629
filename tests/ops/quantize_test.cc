// The parity suite of the quantize family (ggml test-backend-ops / TE style): every backend's
// amax, quantize (data, data_t, scale_inv, scale_inv_t, amax), dequantize and cast must equal the
// scalar reference of quantize_ref.h bit for bit, on fresh random inputs shaped so that
// saturation, FP8 subnormals and underflow all occur. Bad inputs must be refused by name.
#include "octet/ops/quantize.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "octet/ops/reduce.h"
#include "ops/op_check.h"
#include "ops/quantize_ref.h"
#include "test_util.h"

namespace octet {
namespace {

using fp8::QuantizedTensor;
using fp8::ScalingMode;
using fp8::Usage;
using testing::bitwise_equal;
using testing::device_name;
using testing::expect_error;
using testing::fresh_seed;
using testing::on;
using testing::representable;
namespace ref = testing::ref;

// ----------------------------------------------------------------------------
// Inputs

/// Log-uniform draws reach this many binades below the case's magnitude: more than E5M2's 32
/// binades from its max to half its smallest subnormal, so every scaling underflows some values.
constexpr float kLogBinades = 40;
/// Every kOutlierRowPeriod-th row (row 0 included) holds planted outliers.
constexpr int64_t kOutlierRowPeriod = 7;
/// Outliers relative to the magnitude: 2^12 above (crushes the rest of its block to zero) and
/// 2^-60 below (underflows whatever its block's scale).
constexpr float kHugeFactor = 4096.0f;
constexpr float kTinyFactor = 8.67361738e-19f;  // 2^-60
/// A float subnormal (below FLT_MIN = 1.18e-38), representable in bf16 as well.
constexpr float kFloatSubnormal = 1e-40f;
/// per_tensor: scale so that |x| above this fraction of the magnitude saturates (a few percent
/// of the values; see make_input's distribution).
constexpr float kSaturatingFraction = 0.9f;

/// A CPU tensor of dtype f32 or bf16 holding `values` (already representable).
Tensor make_tensor(const std::vector<float>& values, const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  if (dtype == DType::f32) {
    std::memcpy(t.raw_data(), values.data(), t.nbytes());
  } else {
    auto* bits = static_cast<uint16_t*>(t.raw_data());
    // The top half of a representable value is its bf16 (NaN payloads kept).
    for (size_t i = 0; i < values.size(); ++i)
      bits[i] = static_cast<uint16_t>(ref::to_bits(values[i]) >> 16);
  }
  return t;
}

/// rows x cols values around `magnitude`: half uniform in [-m, m], half log-uniform over
/// kLogBinades binades below m; outlier rows with huge, tiny, float-subnormal and -0 values; one
/// all-zero region that covers whole blocks of every mode (zero amax). Rounded to `dtype`.
std::vector<float> make_input(int64_t rows, int64_t cols, DType dtype, uint64_t seed,
                              float magnitude) {
  std::vector<float> x(rows * cols);
  // The zero region: a 128x128 tile (or what fits) away from the edges when there is room.
  const int64_t zr0 = rows >= 256 ? 128 : 0, zr1 = std::min(rows, zr0 + 128);
  const int64_t zc0 = cols >= 384 ? 256 : 0, zc1 = std::min(cols, zc0 + 128);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    std::mt19937_64 rng(seed ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(r + 1)));
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    const bool outlier_row = r % kOutlierRowPeriod == 0;
    for (int64_t c = 0; c < cols; ++c) {
      const uint64_t bits = rng();
      const float sign = (bits & 1) ? -1.0f : 1.0f;
      const float u = unit(rng);
      float v = (bits & 2) ? magnitude * u : magnitude * std::exp2(-kLogBinades * u);
      if (outlier_row) {
        if (c % 53 == 17) v = magnitude * kHugeFactor;
        if (c % 53 == 31) v = magnitude * kTinyFactor;
        if (c % 101 == 7) v = kFloatSubnormal;
        if (c % 101 == 50) v = 0.0f;  // signed below: -0 or +0
      }
      if (r >= zr0 && r < zr1 && c >= zc0 && c < zc1) v = 0.0f;
      x[r * cols + c] = representable(sign * v, dtype);
    }
  }
  return x;
}

/// A magnitude 2^k * (1 + f), k in [-20, 20]: not a power of two, so scales round.
float draw_magnitude(std::mt19937_64& rng) {
  std::uniform_int_distribution<int> binade(-20, 20);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  return std::ldexp(mantissa(rng), binade(rng));
}

Tensor scalar_on(float v, const Device& device) {
  return on(Tensor::from_vector({v}, {1}), device);
}

std::string shape_name(int64_t rows, int64_t cols) {
  return std::to_string(rows) + "x" + std::to_string(cols);
}
struct MatrixShape {
  int64_t rows, cols;
};
/// Awkward shapes (TE's), an aligned one, and a large one that only the GPU runs.
const std::vector<MatrixShape> kShapes = {{1, 3221}, {2333, 1}, {1481, 677}, {128, 256}};
constexpr MatrixShape kLargeGpuShape = {16384, 8192};

// ----------------------------------------------------------------------------
// quantize + dequantize parity

struct QuantizeCase {
  Device backend;
  DType input;
  DType fp8;
  ScalingMode mode;
  Usage usage;
  MatrixShape shape;
};

std::string usage_name(Usage u) {
  return u.rowwise && u.columnwise ? "both" : u.rowwise ? "rowwise" : "columnwise";
}

std::vector<QuantizeCase> quantize_cases() {
  const std::vector<Usage> usages = {{true, false}, {true, true}, {false, true}};
  std::vector<QuantizeCase> cases;
  for (const Device& backend : testing::all_backends()) {
    std::vector<MatrixShape> shapes = kShapes;
    if (backend.is_cuda() && !testing::small_tests_only()) shapes.push_back(kLargeGpuShape);
    for (DType input : {DType::f32, DType::bf16})
      for (DType fp8 : {DType::e4m3, DType::e5m2})
        for (ScalingMode mode : testing::kScalingModes)
          for (Usage usage : usages)
            for (MatrixShape shape : shapes) {
              // The large shape is there for the tiled fast paths; its host reference costs
              // seconds, so it runs for bf16 input with both copies (the training cast) only.
              if (shape.rows == kLargeGpuShape.rows &&
                  (input != DType::bf16 || !usage.rowwise || !usage.columnwise))
                continue;
              cases.push_back({backend, input, fp8, mode, usage, shape});
            }
  }
  return cases;
}

std::string quantize_case_name(const ::testing::TestParamInfo<QuantizeCase>& info) {
  const QuantizeCase& p = info.param;
  return device_name(p.backend) + "_" + std::string(dtype_name(p.input)) + "_" +
         std::string(dtype_name(p.fp8)) + "_" + std::string(fp8::scaling_mode_name(p.mode)) + "_" +
         usage_name(p.usage) + "_" + shape_name(p.shape.rows, p.shape.cols);
}

/// How many elements of a quantized copy hit each edge of the FP8 range.
struct Coverage {
  int64_t saturated = 0;  ///< at +-fp8_max
  int64_t subnormal = 0;  ///< FP8 subnormal codes
  int64_t underflow = 0;  ///< nonzero inputs that became zero
};

Coverage coverage(const ref::Copy& k, const std::vector<float>& x, DType dtype) {
  const int mantissa_bits = dtype == DType::e4m3 ? 3 : 2;
  const uint8_t max_code = fp8::encode_fp8(fp8::fp8_max(dtype), dtype);
  Coverage c;
  for (size_t i = 0; i < k.q.size(); ++i) {
    const uint8_t magnitude = k.q[i] & 0x7F;
    c.saturated += magnitude == max_code;
    c.subnormal += magnitude != 0 && (magnitude >> mantissa_bits) == 0;
    c.underflow += magnitude == 0 && x[i] != 0.0f;
  }
  return c;
}

/// Compares data, data_t, scale_inv and scale_inv_t (those allocated) with the reference.
void expect_matches_reference(const ref::Quantized& expected, const QuantizedTensor& q) {
  if (q.has_rowwise()) {
    EXPECT_TRUE(bitwise_equal(expected.tensor.data, q.data)) << "data";
    EXPECT_TRUE(bitwise_equal(expected.tensor.scale_inv, q.scale_inv)) << "scale_inv";
  }
  if (q.has_columnwise()) {
    EXPECT_TRUE(bitwise_equal(expected.tensor.data_t, q.data_t)) << "data_t";
    EXPECT_TRUE(bitwise_equal(expected.tensor.scale_inv_t, q.scale_inv_t)) << "scale_inv_t";
  }
}

using QuantizeParity = testing::SeededParityTest<QuantizeCase>;

TEST_P(QuantizeParity, MatchesReferenceBitExactly) {
  const QuantizeCase& p = GetParam();
  const float magnitude = draw_magnitude(rng);
  const int64_t rows = p.shape.rows, cols = p.shape.cols;
  const std::vector<float> values = make_input(rows, cols, p.input, rng(), magnitude);
  const Tensor x = on(make_tensor(values, {rows, cols}, p.input), p.backend);
  const float tensor_scale = fp8::fp8_max(p.fp8) / (kSaturatingFraction * magnitude);
  const float amax_before = magnitude / 8;  // below max|x|: the call must raise it

  const bool block_mode =
      p.mode == ScalingMode::block_1x128 || p.mode == ScalingMode::block_128x128;
  for (bool power_of_2 : block_mode ? std::vector<bool>{true, false} : std::vector<bool>{true}) {
    SCOPED_TRACE(::testing::Message() << "power_of_2_block_scales " << power_of_2);
    QuantizedTensor q = QuantizedTensor::allocate(rows, cols, p.fp8, p.mode, p.usage, p.backend);
    ops::QuantizeArgs args;
    args.power_of_2_block_scales = power_of_2;
    if (p.mode == ScalingMode::per_tensor) args.scale = scalar_on(tensor_scale, p.backend);
    args.amax = scalar_on(amax_before, p.backend);
    ops::quantize(x, q, args);

    const ref::Quantized expected =
        ref::quantize(values, rows, cols, p.fp8, p.mode, p.usage, tensor_scale, power_of_2);
    expect_matches_reference(expected, q);
    EXPECT_TRUE(
        bitwise_equal(Tensor::from_vector({ref::amax(values, amax_before)}, {1}), args.amax))
        << "amax";
    // The claim holds only if the edges of the format were reached. Per-block scales never
    // saturate, and a 1-wide block is all amax, so those cases are not held to this.
    if (p.mode == ScalingMode::per_tensor || (rows > 1 && cols > 1)) {
      const Coverage c =
          coverage(p.usage.rowwise ? expected.rowwise : expected.columnwise, values, p.fp8);
      EXPECT_GT(c.subnormal, 0);
      EXPECT_GT(c.underflow, 0);
      if (p.mode == ScalingMode::per_tensor) {
        EXPECT_GT(c.saturated, 0);
      }
    }

    // Round trips of each copy, into the other high-precision dtype than x's (both are covered
    // across the suite at half the time).
    const DType out_dtype = p.input == DType::f32 ? DType::bf16 : DType::f32;
    if (q.has_rowwise()) {
      Tensor out = Tensor::empty({rows, cols}, out_dtype, p.backend);
      ops::dequantize(q, out, false);
      EXPECT_TRUE(bitwise_equal(ref::dequantize(expected.rowwise, p.fp8, out_dtype, false), out))
          << "dequantize data";
    }
    if (q.has_columnwise()) {
      Tensor out = Tensor::empty({cols, rows}, out_dtype, p.backend);
      ops::dequantize(q, out, true);
      EXPECT_TRUE(bitwise_equal(ref::dequantize(expected.columnwise, p.fp8, out_dtype, true), out))
          << "dequantize data_t";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, QuantizeParity, ::testing::ValuesIn(quantize_cases()),
                         quantize_case_name);

// ----------------------------------------------------------------------------
// quantize with NaN, inf, FLT_MAX, float subnormals and zero tiles in the input

struct SpecialCase {
  Device backend;
  DType input;
  DType fp8;
  ScalingMode mode;
};

std::vector<SpecialCase> special_cases() {
  std::vector<SpecialCase> cases;
  for (const Device& backend : testing::all_backends())
    for (DType input : {DType::f32, DType::bf16})
      for (DType fp8 : {DType::e4m3, DType::e5m2})
        for (ScalingMode mode : testing::kScalingModes) cases.push_back({backend, input, fp8, mode});
  return cases;
}

using QuantizeSpecialValues = testing::SeededParityTest<SpecialCase>;

TEST_P(QuantizeSpecialValues, MatchesReferenceBitExactly) {
  const SpecialCase& p = GetParam();
  // Partial 128-tiles on both edges; rows [128, 256) x cols [128, 256) is one whole zero tile.
  constexpr int64_t kRows = 300, kCols = 260, kPlantRows = 128;
  std::mt19937_64 rng(seed);
  std::vector<float> values = make_input(kRows, kCols, p.input, rng(), 1.0f);
  for (int64_t r = 128; r < 256; ++r)
    for (int64_t c = 128; c < 256; ++c) values[r * kCols + c] = 0.0f;
  // The edge tile rows [256, 300) x cols [0, 128) holds only float subnormals: every block there
  // has fp8_max / amax = inf, clamped to FLT_MAX.
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (int64_t r = 256; r < kRows; ++r)
    for (int64_t c = 0; c < 128; ++c)
      values[r * kCols + c] = representable(unit(rng) * kFloatSubnormal, p.input);
  // Specials only in the first 128 rows, so other blocks keep finite amaxes.
  const float specials[] = {NAN, -NAN, INFINITY, -INFINITY, FLT_MAX, -FLT_MAX, 1e-42f, -3e-39f};
  std::uniform_int_distribution<int64_t> row(0, kPlantRows - 1), col(0, kCols - 1);
  for (float v : specials)
    for (int k = 0; k < 3; ++k) values[row(rng) * kCols + col(rng)] = representable(v, p.input);

  const Tensor x = on(make_tensor(values, {kRows, kCols}, p.input), p.backend);
  QuantizedTensor q =
      QuantizedTensor::allocate(kRows, kCols, p.fp8, p.mode, {true, true}, p.backend);
  ops::QuantizeArgs args;
  const float tensor_scale = 2.5f;
  if (p.mode == ScalingMode::per_tensor) args.scale = scalar_on(tensor_scale, p.backend);
  args.amax = scalar_on(0.0f, p.backend);
  ops::quantize(x, q, args);
  const ref::Quantized expected =
      ref::quantize(values, kRows, kCols, p.fp8, p.mode, {true, true}, tensor_scale, true);
  expect_matches_reference(expected, q);
  const Tensor amax = Tensor::from_vector({ref::amax(values, 0.0f)}, {1});
  EXPECT_TRUE(std::isnan(amax.data<float>()[0]));
  EXPECT_TRUE(bitwise_equal(amax, args.amax));
  // Dequantized to bf16, whose encoder makes every NaN 0x7FFF: bit-exact even where NaN
  // payloads (unspecified in f32 results) could differ between backends.
  for (bool transposed : {false, true}) {
    const Tensor out = transposed ? Tensor::empty({kCols, kRows}, DType::bf16, p.backend)
                                  : Tensor::empty({kRows, kCols}, DType::bf16, p.backend);
    ops::dequantize(q, out, transposed);
    EXPECT_TRUE(bitwise_equal(ref::dequantize(transposed ? expected.columnwise : expected.rowwise,
                                              p.fp8, DType::bf16, transposed),
                              out))
        << "dequantize, transposed " << transposed;
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, QuantizeSpecialValues, ::testing::ValuesIn(special_cases()),
                         [](const ::testing::TestParamInfo<SpecialCase>& info) {
                           return device_name(info.param.backend) + "_" +
                                  std::string(dtype_name(info.param.input)) + "_" +
                                  std::string(dtype_name(info.param.fp8)) + "_" +
                                  std::string(fp8::scaling_mode_name(info.param.mode));
                         });

// ----------------------------------------------------------------------------
// Backend x dtype cases shared by amax, cast and the matrix-view test

struct DTypeCase {
  Device backend;
  DType input;
  DType output;  ///< cast only
  MatrixShape shape;
};

std::vector<DTypeCase> dtype_cases(bool with_output) {
  std::vector<DTypeCase> cases;
  for (const Device& backend : testing::all_backends()) {
    std::vector<MatrixShape> shapes(kShapes.begin(), kShapes.begin() + 3);
    if (backend.is_cuda() && !testing::small_tests_only()) shapes.push_back(kLargeGpuShape);
    for (DType input : {DType::f32, DType::bf16})
      for (DType output : with_output ? std::vector<DType>{DType::f32, DType::bf16}
                                      : std::vector<DType>{DType::f32})
        for (MatrixShape shape : shapes) cases.push_back({backend, input, output, shape});
  }
  return cases;
}

std::string dtype_case_name(const ::testing::TestParamInfo<DTypeCase>& info) {
  const DTypeCase& p = info.param;
  return device_name(p.backend) + "_" + std::string(dtype_name(p.input)) + "_" +
         std::string(dtype_name(p.output)) + "_" + shape_name(p.shape.rows, p.shape.cols);
}

// ----------------------------------------------------------------------------
// amax

using AmaxParity = testing::SeededParityTest<DTypeCase>;

TEST_P(AmaxParity, RaisesElementZeroToMaxAbs) {
  const DTypeCase& p = GetParam();
  const float magnitude = draw_magnitude(rng);
  const std::vector<float> values =
      make_input(p.shape.rows, p.shape.cols, p.input, rng(), magnitude);
  const Tensor x = on(make_tensor(values, {p.shape.rows, p.shape.cols}, p.input), p.backend);
  // Below max|x| (the call raises it), then above (it stays); element 1 is never touched.
  for (float before : {magnitude / 8, magnitude * 1e6f}) {
    SCOPED_TRACE(::testing::Message() << "amax before " << before);
    const Tensor amax_out = on(Tensor::from_vector({before, -7.0f}, {2}), p.backend);
    ops::amax(x, amax_out);
    EXPECT_TRUE(
        bitwise_equal(Tensor::from_vector({ref::amax(values, before), -7.0f}, {2}), amax_out));
  }
  // The maximum planted at the first, the last and a random element: no element is skipped.
  const int64_t n = p.shape.rows * p.shape.cols;
  for (int64_t at : {int64_t{0}, n - 1, std::uniform_int_distribution<int64_t>(0, n - 1)(rng)}) {
    SCOPED_TRACE(::testing::Message() << "maximum at element " << at);
    std::vector<float> planted = values;
    planted[at] = representable(-magnitude * kHugeFactor * kHugeFactor, p.input);
    const Tensor amax_out = scalar_on(0.0f, p.backend);
    ops::amax(on(make_tensor(planted, {p.shape.rows, p.shape.cols}, p.input), p.backend), amax_out);
    EXPECT_TRUE(bitwise_equal(Tensor::from_vector({-planted[at]}, {1}), amax_out));
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, AmaxParity, ::testing::ValuesIn(dtype_cases(false)), dtype_case_name);

// ----------------------------------------------------------------------------
// column sums fused into the quantize (a Linear's bias gradient from its grad_output's cast)

using QuantizeColumnSums = testing::SeededParityTest<DTypeCase>;

TEST_P(QuantizeColumnSums, AddSumRowsBitsAndLeaveTheCopiesAlone) {
  const DTypeCase& p = GetParam();
  const int64_t rows = p.shape.rows, cols = p.shape.cols;
  const float magnitude = draw_magnitude(rng);
  const std::vector<float> values = make_input(rows, cols, p.input, rng(), magnitude);
  const Tensor x = on(make_tensor(values, {rows, cols}, p.input), p.backend);
  const Tensor initial = testing::random_tensor({cols}, DType::f32, rng(), magnitude);
  Tensor expected_sums = on(initial.clone(), p.backend);
  ops::sum_rows(x, expected_sums, /*accumulate=*/true);
  Tensor expected_fresh_sums = Tensor::zeros({cols}, DType::f32, p.backend);
  ops::sum_rows(x, expected_fresh_sums, /*accumulate=*/true);
  // The fused column pass (both copies), and the fallbacks without a transposed copy.
  const std::pair<ScalingMode, Usage> layouts[] = {
      {ScalingMode::per_tensor, {true, true}},  {ScalingMode::per_tensor, {false, true}},
      {ScalingMode::block_1x128, {true, true}}, {ScalingMode::mxfp8_1x32, {true, true}},
      {ScalingMode::per_tensor, {true, false}}, {ScalingMode::block_128x128, {true, false}}};
  for (const auto& [mode, usage] : layouts) {
    SCOPED_TRACE(::testing::Message() << fp8::scaling_mode_name(mode) << " " << usage_name(usage));
    const auto quantize = [&](const Tensor& column_sums, bool accumulate = true) {
      QuantizedTensor q =
          QuantizedTensor::allocate(rows, cols, DType::e5m2, mode, usage, p.backend);
      ops::QuantizeArgs args;
      if (mode == ScalingMode::per_tensor) args.scale = scalar_on(57344.0f / magnitude, p.backend);
      args.amax = scalar_on(0.0f, p.backend);
      args.column_sums = column_sums;
      args.accumulate_column_sums = accumulate;
      ops::quantize(x, q, args);
      return std::make_pair(q, args.amax);
    };
    const Tensor sums = on(initial.clone(), p.backend);
    const auto [fused, fused_amax] = quantize(sums);
    const auto [plain, plain_amax] = quantize(Tensor());
    EXPECT_TRUE(bitwise_equal(expected_sums, sums)) << "column sums";
    // Overwriting (a gradient's first write) gives bitwise the sums added to zeros.
    const Tensor overwritten = on(initial.clone(), p.backend);
    quantize(overwritten, /*accumulate=*/false);
    EXPECT_TRUE(bitwise_equal(expected_fresh_sums, overwritten)) << "overwritten column sums";
    EXPECT_TRUE(bitwise_equal(plain_amax, fused_amax)) << "amax";
    if (usage.rowwise) EXPECT_TRUE(bitwise_equal(plain.data, fused.data)) << "data";
    if (usage.columnwise) EXPECT_TRUE(bitwise_equal(plain.data_t, fused.data_t)) << "data_t";
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, QuantizeColumnSums, ::testing::ValuesIn(dtype_cases(false)),
                         dtype_case_name);

TEST(QuantizeErrors, ColumnSumsMustBeF32OfTheColumns) {
  const Tensor x = testing::random_tensor({8, 16}, DType::f32, fresh_seed());
  QuantizedTensor q = QuantizedTensor::allocate(8, 16, DType::e4m3, ScalingMode::block_1x128,
                                                Usage{true, true}, Device::cpu());
  ops::QuantizeArgs args;
  args.column_sums = Tensor::zeros({8}, DType::f32);
  expect_error([&] { ops::quantize(x, q, args); }, {"args.column_sums", "f32[16]"});
  args.column_sums = Tensor::zeros({16}, DType::bf16);
  expect_error([&] { ops::quantize(x, q, args); }, {"args.column_sums", "f32[16]"});
}

// ----------------------------------------------------------------------------
// count_fp8_codes: the FP8 statistics' saturated / underflow / nonzero counts

using CountFp8Codes = testing::SeededParityTest<DTypeCase>;

TEST_P(CountFp8Codes, CountsSaturatedUnderflowAndNonzeroLikeANaiveScan) {
  const DTypeCase& p = GetParam();
  const float magnitude = draw_magnitude(rng);
  std::vector<float> values = make_input(p.shape.rows, p.shape.cols, p.input, rng(), magnitude);
  // Some exact zeros and some values far below the format's reach, so every count is exercised.
  std::uniform_int_distribution<int> pick(0, 7);
  for (float& v : values) {
    const int k = pick(rng);
    if (k == 0) v = 0.0f;
    if (k == 1) v = representable(v * 1e-12f, p.input);
  }
  const Shape shape{p.shape.rows, p.shape.cols};
  const Tensor x = on(make_tensor(values, shape, p.input), p.backend);
  for (DType fp8_dtype : {DType::e4m3, DType::e5m2}) {
    SCOPED_TRACE(dtype_name(fp8_dtype));
    // A scale that sends the upper half of the magnitudes past the format's largest value.
    const float scale = 2.0f * fp8::fp8_max(fp8_dtype) / magnitude;
    QuantizedTensor q = QuantizedTensor::allocate(p.shape.rows, p.shape.cols, fp8_dtype,
                                                  ScalingMode::per_tensor, Usage{}, p.backend);
    ops::QuantizeArgs args;
    args.scale = scalar_on(scale, p.backend);
    ops::quantize(x, q, args);
    Tensor initial = Tensor::zeros({3}, DType::i64);  // counts accumulate: start from 5, 6, 7
    for (int j = 0; j < 3; ++j) initial.data<int64_t>()[j] = 5 + j;
    const Tensor counts = on(initial, p.backend);
    ops::count_fp8_codes(x, q.data, counts);

    const std::vector<float> x_host = testing::to_floats(x);
    const Tensor codes = q.data.to(Device::cpu());
    const auto* c = static_cast<const uint8_t*>(codes.raw_data());
    const uint8_t max_code = fp8::encode_fp8(fp8::fp8_max(fp8_dtype), fp8_dtype);
    int64_t saturated = 5, underflow = 6, nonzero = 7;
    for (size_t i = 0; i < x_host.size(); ++i) {
      saturated += (c[i] & 0x7F) == max_code;
      nonzero += x_host[i] != 0.0f;
      underflow += x_host[i] != 0.0f && (c[i] & 0x7F) == 0;
    }
    EXPECT_GT(saturated, 5);
    EXPECT_GT(underflow, 6);
    const Tensor got = counts.to(Device::cpu());
    EXPECT_EQ(got.data<int64_t>()[ops::kSaturatedCodes], saturated);
    EXPECT_EQ(got.data<int64_t>()[ops::kUnderflowCodes], underflow);
    EXPECT_EQ(got.data<int64_t>()[ops::kNonzeroInputs], nonzero);
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, CountFp8Codes, ::testing::ValuesIn(dtype_cases(false)),
                         dtype_case_name);

TEST(QuantizeErrors, CountFp8CodesChecksItsArguments) {
  const Tensor x = Tensor::zeros({4, 8}, DType::f32);
  const Tensor counts = Tensor::zeros({3}, DType::i64);
  expect_error(
      [&] {
        ops::count_fp8_codes(x, Tensor::zeros({4, 8}, DType::f32), counts);
      },
      {"count_fp8_codes: codes must be e4m3 or e5m2", "f32[4, 8]"});
  expect_error(
      [&] {
        ops::count_fp8_codes(x, Tensor::zeros({4, 7}, DType::e4m3), counts);
      },
      {"codes hold 28 elements but x has 32"});
  expect_error(
      [&] {
        ops::count_fp8_codes(x, Tensor::zeros({32}, DType::e4m3), Tensor::zeros({3}, DType::f32));
      },
      {"counts must be i64[3]"});
}

using AmaxNaN = testing::SeededParityTest<DTypeCase>;

TEST_P(AmaxNaN, NaNWinsWhereverItIs) {
  const DTypeCase& p = GetParam();
  const int64_t n = p.shape.rows * p.shape.cols;
  std::vector<float> values = make_input(p.shape.rows, p.shape.cols, p.input, rng(), 1.0f);
  // Two quiet NaNs with different payloads, one negative, and an inf: the larger |NaN| pattern
  // wins over inf and over the stored value.
  std::uniform_int_distribution<int64_t> index(0, n - 1);
  values[index(rng)] = INFINITY;
  values[index(rng)] = ref::from_bits(0xFFC10000u);  // -NaN, payload representable in bf16
  values[index(rng)] = ref::from_bits(0x7FC20000u);
  const Tensor x = on(make_tensor(values, {p.shape.rows, p.shape.cols}, p.input), p.backend);
  const Tensor amax_out = scalar_on(FLT_MAX, p.backend);
  ops::amax(x, amax_out);
  const Tensor expected = Tensor::from_vector({ref::amax(values, FLT_MAX)}, {1});
  EXPECT_TRUE(std::isnan(expected.data<float>()[0]));
  EXPECT_TRUE(bitwise_equal(expected, amax_out));
}

INSTANTIATE_TEST_SUITE_P(Ops, AmaxNaN, ::testing::ValuesIn(dtype_cases(false)), dtype_case_name);

// ----------------------------------------------------------------------------
// cast

using CastParity = testing::SeededParityTest<DTypeCase>;

TEST_P(CastParity, RoundsToNearestEven) {
  const DTypeCase& p = GetParam();
  const Shape shape = {p.shape.rows, p.shape.cols};
  const int64_t n = shape_numel(shape);
  // Every bit pattern is fair: NaNs, infinities, subnormals; plus the two bf16 ties.
  Tensor input = Tensor::empty(shape, p.input);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(rng());
    if (p.input == DType::f32) {
      std::memcpy(input.data<float>() + i, &bits, 4);
    } else {
      static_cast<uint16_t*>(input.raw_data())[i] = static_cast<uint16_t>(bits);
    }
  }
  if (p.input == DType::f32 && n >= 2) {
    input.data<float>()[0] = ref::from_bits(0x3F808000u);  // tie, rounds down to even
    input.data<float>()[1] = ref::from_bits(0x3F818000u);  // tie, rounds up to even
  }
  // Same dtype: a byte copy (NaN payloads kept); otherwise decode_bf16 or encode_bf16.
  Tensor expected = Tensor::empty(shape, p.output);
  if (p.input == p.output) {
    std::memcpy(expected.raw_data(), input.raw_data(), input.nbytes());
  } else if (p.input == DType::bf16) {
    for (int64_t i = 0; i < n; ++i)
      expected.data<float>()[i] =
          fp8::decode_bf16(static_cast<const uint16_t*>(input.raw_data())[i]);
  } else {
    for (int64_t i = 0; i < n; ++i)
      static_cast<uint16_t*>(expected.raw_data())[i] = fp8::encode_bf16(input.data<float>()[i]);
  }
  const Tensor out = Tensor::empty(shape, p.output, p.backend);
  ops::cast(on(input, p.backend), out);
  EXPECT_TRUE(bitwise_equal(expected, out));
}

INSTANTIATE_TEST_SUITE_P(Ops, CastParity, ::testing::ValuesIn(dtype_cases(true)), dtype_case_name);

// The device rounds f32 to bf16 by the hardware conversion (fp8::encode_bf16, encode_bf16x2), the
// host by the formula: they must agree on every sign, exponent and kept mantissa (all 2^16 high
// halves: every NaN and infinity, both parities of the last kept bit), each with the low halves
// that decide the rounding (zero, just above it, below, at and above the tie, all ones) and two
// drawn at random. A tail of 8 random floats, shorter than a 16-element run, takes the kernel's
// scalar path; the rest go by pairs.
TEST(CastCuda, F32ToBf16EqualsTheHostEncoder) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  constexpr uint32_t kRoundingLows[] = {0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF};
  constexpr int64_t kFixedLows = static_cast<int64_t>(std::size(kRoundingLows));
  constexpr int64_t kLows = kFixedLows + 2;
  constexpr int64_t kHighs = int64_t{1} << 16;
  constexpr int64_t kTail = 8;
  const int64_t n = kHighs * kLows + kTail;
  Tensor input = Tensor::empty({n}, DType::f32);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t high = static_cast<uint32_t>(i / kLows), j = static_cast<uint32_t>(i % kLows);
    input.data<float>()[i] =
        i >= kHighs * kLows ? ref::from_bits(static_cast<uint32_t>(rng()))
        : j < kFixedLows    ? ref::from_bits(high << 16 | kRoundingLows[j])
                            : ref::from_bits(high << 16 | (static_cast<uint32_t>(rng()) & 0xFFFFu));
  }
  Tensor expected = Tensor::empty({n}, DType::bf16);
  for (int64_t i = 0; i < n; ++i)
    static_cast<uint16_t*>(expected.raw_data())[i] = fp8::encode_bf16(input.data<float>()[i]);
  const Tensor out = Tensor::empty({n}, DType::bf16, gpu);
  ops::cast(input.to(gpu), out);
  EXPECT_TRUE(bitwise_equal(expected, out));
}

// ----------------------------------------------------------------------------
// A higher-rank x is quantized as its [rows, cols] matrix view

class QuantizeMatrixView : public ::testing::TestWithParam<Device> {};

TEST_P(QuantizeMatrixView, FoldsLeadingDimsIntoRows) {
  const Device backend = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(backend);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const std::vector<float> values = make_input(6, 130, DType::f32, seed, 3.0f);
  const Tensor x = on(make_tensor(values, {2, 3, 130}, DType::f32), backend);
  QuantizedTensor q = QuantizedTensor::allocate(6, 130, DType::e4m3, ScalingMode::block_1x128,
                                                {true, true}, backend);
  ops::quantize(x, q);
  const ref::Quantized expected =
      ref::quantize(values, 6, 130, DType::e4m3, ScalingMode::block_1x128, {true, true}, 1, true);
  expect_matches_reference(expected, q);
}

INSTANTIATE_TEST_SUITE_P(Ops, QuantizeMatrixView, ::testing::ValuesIn(testing::all_backends()),
                         [](const ::testing::TestParamInfo<Device>& info) {
                           return device_name(info.param);
                         });

// ----------------------------------------------------------------------------
// Bad inputs are refused with messages that name what was expected and what was received

Tensor small_input(DType dtype = DType::f32) {
  return testing::random_tensor({5, 40}, dtype, fresh_seed());
}

QuantizedTensor small_output(ScalingMode mode, Usage usage = {true, true},
                             const Device& device = Device::cpu()) {
  return QuantizedTensor::allocate(5, 40, DType::e4m3, mode, usage, device);
}

TEST(QuantizeErrors, MismatchedShapes) {
  const Tensor x = small_input();
  QuantizedTensor wrong = QuantizedTensor::allocate(40, 5, DType::e4m3, ScalingMode::block_1x128,
                                                    {true, false}, Device::cpu());
  expect_error([&] { ops::quantize(x, wrong); },
               {"shape mismatch", "[40, 5] matrix", "f32[5, 40] on cpu"});

  QuantizedTensor q = small_output(ScalingMode::block_1x128);
  q.data = Tensor::empty({5, 41}, DType::e4m3);
  expect_error([&] { ops::quantize(x, q); },
               {"shape mismatch", "data expected e4m3[5, 40]", "received e4m3[5, 41]"});

  q = small_output(ScalingMode::block_1x128);
  q.scale_inv_t = Tensor::empty({40, 2}, DType::f32);
  expect_error([&] { ops::quantize(x, q); },
               {"shape mismatch", "scale_inv_t expected f32[40, 1]", "received f32[40, 2]"});

  q = small_output(ScalingMode::mxfp8_1x32);
  q.scale_inv = Tensor::empty({5, 2}, DType::f32);
  expect_error([&] { ops::quantize(x, q); },
               {"dtype mismatch", "scale_inv expected e8m0[5, 2]", "received f32[5, 2]"});

  q = small_output(ScalingMode::block_128x128);
  ops::quantize(x, q);
  expect_error(
      [&] {
        ops::dequantize(q, Tensor::empty({5, 40}, DType::f32), true);
      },
      {"shape mismatch", "expected [40, 5]", "(transposed)", "f32[5, 40]"});

  expect_error(
      [&] {
        ops::cast(x, Tensor::empty({40, 5}, DType::bf16));
      },
      {"shape mismatch", "expected shape [5, 40]", "bf16[40, 5]"});
}

TEST(QuantizeErrors, UnsupportedDType) {
  const Tensor ints = Tensor::zeros({5, 40}, DType::i32);
  QuantizedTensor q = small_output(ScalingMode::block_1x128);
  expect_error([&] { ops::quantize(ints, q); }, {"unsupported dtype i32", "expected f32 or bf16"});
  expect_error([&] { ops::amax(ints, Tensor::zeros({1}, DType::f32)); },
               {"unsupported dtype i32", "expected f32 or bf16"});
  expect_error(
      [&] {
        ops::cast(ints, Tensor::empty({5, 40}, DType::f32));
      },
      {"unsupported dtype i32", "expected f32 or bf16"});

  q.dtype = DType::bf16;  // not an FP8 format
  expect_error([&] { ops::quantize(small_input(), q); },
               {"unsupported dtype bf16", "expected e4m3 or e5m2"});

  q = small_output(ScalingMode::block_1x128);
  ops::quantize(small_input(), q);
  expect_error(
      [&] {
        ops::dequantize(q, Tensor::empty({5, 40}, DType::e5m2));
      },
      {"unsupported dtype e5m2", "expected f32 or bf16"});

  ops::QuantizeArgs args;
  args.amax = Tensor::zeros({1}, DType::i64);
  expect_error([&] { ops::quantize(small_input(), q, args); },
               {"dtype mismatch", "args.amax expected f32", "i64[1]"});
}

TEST(QuantizeErrors, EmptyTensor) {
  const Tensor empty = Tensor::empty({0, 40}, DType::f32);
  QuantizedTensor q = small_output(ScalingMode::per_tensor);
  ops::QuantizeArgs args;
  args.scale = Tensor::from_vector({1.0f}, {1});
  expect_error([&] { ops::quantize(empty, q, args); }, {"empty tensor x", "f32[0, 40]"});
  expect_error([&] { ops::amax(empty, Tensor::zeros({1}, DType::f32)); },
               {"empty tensor x", "f32[0, 40]"});
  expect_error([&] { ops::amax(small_input(), Tensor::zeros({0}, DType::f32)); },
               {"amax_out expected at least 1 element", "f32[0]"});
}

TEST(QuantizeErrors, MissingOrWrongScale) {
  const Tensor x = small_input();
  QuantizedTensor q = small_output(ScalingMode::per_tensor);
  expect_error([&] { ops::quantize(x, q); },
               {"per_tensor scaling needs args.scale (f32[1])", "undefined tensor"});
  ops::QuantizeArgs args;
  args.scale = Tensor::from_vector({1.0f, 2.0f}, {2});
  expect_error([&] { ops::quantize(x, q, args); }, {"args.scale expected f32[1]", "f32[2]"});
}

TEST(QuantizeErrors, MissingCopy) {
  const Tensor x = small_input();
  QuantizedTensor q = small_output(ScalingMode::mxfp8_1x32, {true, false});
  ops::quantize(x, q);
  expect_error(
      [&] {
        ops::dequantize(q, Tensor::empty({40, 5}, DType::f32), true);
      },
      {"transposed=true needs data_t"});
  q.data = Tensor();
  expect_error([&] { ops::quantize(x, q); }, {"neither data nor data_t"});
}

TEST(QuantizeErrors, TensorsOnDifferentDevices) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  const Tensor x = small_input();
  QuantizedTensor q = small_output(ScalingMode::block_1x128, {true, true}, gpu);
  expect_error([&] { ops::quantize(x, q); },
               {"all tensors must be on one device", "on cpu", "on cuda:0"});
  QuantizedTensor on_cpu = small_output(ScalingMode::per_tensor);
  ops::QuantizeArgs args;
  args.scale = scalar_on(1.0f, gpu);
  expect_error([&] { ops::quantize(x, on_cpu, args); },
               {"all tensors must be on one device", "on cuda:0"});
  expect_error([&] { ops::amax(x, scalar_on(0.0f, gpu)); },
               {"all tensors must be on one device", "on cuda:0"});
  expect_error(
      [&] {
        ops::cast(x, Tensor::empty({5, 40}, DType::bf16, gpu));
      },
      {"all tensors must be on one device", "on cuda:0"});
  ops::quantize(x.to(gpu), q);
  expect_error(
      [&] {
        ops::dequantize(q, Tensor::empty({5, 40}, DType::f32));
      },
      {"all tensors must be on one device", "on cpu"});
}

}  // namespace
}  // namespace octet
