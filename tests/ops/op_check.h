// Checks shared by the norm and activation suites: closeness to a double-precision reference with
// a bound scaled by the magnitude of the terms, central-difference gradients, and the fused FP8
// cast against ops::quantize on the unfused output.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "octet/core/error.h"
#include "octet/fp8/format.h"
#include "octet/fp8/quantized_tensor.h"
#include "octet/ops/norm.h"
#include "octet/ops/quantize.h"
#include "octet/ops/reduce.h"
#include "test_util.h"

namespace octet::testing {

/// f32 results may differ from the exact value by this fraction of the magnitude of the terms
/// that produced them (sum of |term|): a few f32 ulps (2^-24 = 6e-8) per operation, times the
/// square root of the number of summed terms (a row of 3221 columns: ~60).
inline constexpr double kF32ReductionTol = 3e-5;
/// The same for the elementwise formulas (no long sums; tanhf/expf are within 2 ulps on the host
/// and on CUDA): ~60 ulps of f32.
inline constexpr double kF32ElementwiseTol = 4e-6;
/// A bf16 output is rounded once more, to 8 significant bits: half an ulp is 2^-9 of the value;
/// the bound allows a full ulp.
inline constexpr double kBf16Rounding = 1.0 / 256;

/// Extra relative error that rounding the output to `dtype` adds.
inline double output_rounding(DType dtype) { return dtype == DType::bf16 ? kBf16Rounding : 0.0; }

/// A tensor's copy on `device`, or the tensor itself when it is already there.
inline Tensor on(const Tensor& t, const Device& device) {
  return t.device() == device ? t : t.to(device);
}

/// A CPU tensor of f32 or bf16 holding `values` (rounded to nearest even for bf16).
inline Tensor make_tensor(const std::vector<float>& values, const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::f32) {
      t.data<float>()[i] = values[i];
    } else {
      static_cast<uint16_t*>(t.raw_data())[i] = fp8::encode_bf16(values[i]);
    }
  }
  return t;
}

/// Every FP8 scaling mode, for parity suites that cover them all.
inline const std::vector<fp8::ScalingMode> kScalingModes = {
    fp8::ScalingMode::per_tensor, fp8::ScalingMode::block_1x128, fp8::ScalingMode::block_128x128,
    fp8::ScalingMode::mxfp8_1x32};

/// `n` values uniform in [lo, hi] (never exactly 0) from `rng`.
inline std::vector<float> uniform_values(int64_t n, float lo, float hi, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) {
    x = dist(rng);
    if (x == 0.0f) x = hi / 3;
  }
  return v;
}

/// n values of magnitude uniform in [lo, hi] (0 < lo < hi) with a random sign: far from zero.
inline std::vector<float> signed_magnitudes(int64_t n, float lo, float hi, std::mt19937_64& rng) {
  std::vector<float> v = uniform_values(n, lo, hi, rng);
  for (float& x : v) x = (rng() & 1) ? -x : x;
  return v;
}

/// Passes when |got - ref| <= tol * mag + rounding * |ref| for every element; otherwise reports
/// how many elements fail and the worst one.
inline ::testing::AssertionResult close_to(const std::vector<float>& got,
                                           const std::vector<double>& ref,
                                           const std::vector<double>& mag, double tol,
                                           double rounding) {
  if (got.size() != ref.size() || ref.size() != mag.size())
    return ::testing::AssertionFailure()
           << "sizes differ: " << got.size() << " results, " << ref.size() << " references";
  size_t failures = 0, worst = 0;
  double worst_ratio = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    const double bound = tol * mag[i] + rounding * std::fabs(ref[i]);
    const double ratio = std::isnan(err) ? INFINITY : err / bound;
    if (!(err <= bound)) ++failures;
    if (!(ratio <= worst_ratio)) worst_ratio = ratio, worst = i;
  }
  if (failures == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << failures << " of " << got.size() << " elements out of tolerance; worst at " << worst
         << ": got " << got[worst] << ", expected " << ref[worst] << " (error "
         << std::fabs(got[worst] - ref[worst]) << ", bound " << tol * mag[worst] << " + "
         << rounding << " * |expected|)";
}

/// Central differences of L(p) = sum_i w_i * out_i (accumulated in double) for every element j
/// of the f32 CPU tensor `param`: (L(p_j + h) - L(p_j - h)) / (2h) with h the step as actually
/// represented in f32. `forward` runs the op with the current contents of `param` and returns its
/// output. Passes when each difference is within abs_tol + rel_tol * |analytic_j|.
inline ::testing::AssertionResult matches_central_differences(
    const Tensor& param, const std::function<std::vector<float>()>& forward,
    const std::vector<float>& w, const std::vector<float>& analytic, float step, double abs_tol,
    double rel_tol) {
  float* p = param.data<float>();
  const auto loss = [&] {
    const std::vector<float> out = forward();
    double l = 0.0;
    for (size_t i = 0; i < out.size(); ++i) l += static_cast<double>(w[i]) * out[i];
    return l;
  };
  for (int64_t j = 0; j < param.numel(); ++j) {
    const float v = p[j];
    p[j] = v + step;
    const double up = p[j];
    const double plus = loss();
    p[j] = v - step;
    const double down = p[j];
    const double minus = loss();
    p[j] = v;
    const double numeric = (plus - minus) / (up - down);
    if (!(std::fabs(numeric - analytic[j]) <= abs_tol + rel_tol * std::fabs(analytic[j])))
      return ::testing::AssertionFailure()
             << "element " << j << " of " << param.numel() << ": analytic " << analytic[j]
             << ", central difference " << numeric;
  }
  return ::testing::AssertionSuccess();
}

/// The device a test case runs on: its `backend` member, or the first element of a tuple.
template <typename Case>
Device backend_of(const Case& c) {
  if constexpr (requires { c.backend; }) {
    return c.backend;
  } else {
    return std::get<0>(c);
  }
}

/// A parity suite over cases that name a backend (see backend_of): each test skips when that
/// backend is missing, else draws a fresh `seed` (with `rng` seeded by it) and traces it for the
/// whole test.
template <typename Case>
class SeededParityTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    OCTET_SKIP_IF_UNAVAILABLE(backend_of(this->GetParam()));
    trace_.emplace(__FILE__, __LINE__, ::testing::Message() << "seed " << seed);
  }

  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng{seed};

 private:
  std::optional<::testing::ScopedTrace> trace_;
};

/// One way of fusing an FP8 cast into an op.
struct FusedCase {
  fp8::ScalingMode mode;
  DType fp8;
  fp8::Usage usage;
};

/// Every path of the fused cast: the per-tensor row-wise cast in a norm kernel (with the amax),
/// the same plus the transposed copy (amax recorded after it), and block modes with one or both
/// copies, which norms hand to ops::quantize and activations write from their tiles.
inline std::vector<FusedCase> fused_cases() {
  return {{fp8::ScalingMode::per_tensor, DType::e4m3, {true, false}},
          {fp8::ScalingMode::per_tensor, DType::e5m2, {true, true}},
          {fp8::ScalingMode::block_1x128, DType::e4m3, {true, true}},
          {fp8::ScalingMode::block_128x128, DType::e5m2, {false, true}},
          {fp8::ScalingMode::mxfp8_1x32, DType::e4m3, {true, true}}};
}

/// Runs `run` (the op writing `out` on `device`) unfused followed by ops::quantize(out), then
/// fused, and expects the outputs, the FP8 copies, their scales, the amax and the column sums
/// (args.column_sums, vs sum_rows(out)) to be bitwise equal. The per-tensor scale makes the
/// largest values saturate. `run_fp8_only`, when given, runs the op fused without its
/// high-precision output, which must give the same FP8 results.
inline void expect_fused_matches_unfused(
    const Device& device, const Tensor& out,
    const std::function<void(const ops::FusedQuantize*)>& run, const FusedCase& c,
    const std::function<void(const ops::FusedQuantize*)>& run_fp8_only = {}) {
  SCOPED_TRACE(::testing::Message() << "fused cast " << fp8::scaling_mode_name(c.mode) << " "
                                    << dtype_name(c.fp8) << (c.usage.columnwise ? " +data_t" : ""));
  /// The scale maps this fraction of max|out| to the FP8 maximum, so the top values saturate.
  constexpr float kSaturatingFraction = 0.9f;
  /// amax starts below max|out|, so the call must raise it.
  constexpr float kAmaxBefore = 1e-3f;
  run(nullptr);
  const Tensor unfused = out.clone();
  float max_abs = 0.0f;
  for (float v : to_floats(unfused)) max_abs = std::max(max_abs, std::fabs(v));
  ASSERT_GT(max_abs, kAmaxBefore);
  const Tensor scale =
      on(Tensor::from_vector({fp8::fp8_max(c.fp8) / (kSaturatingFraction * max_abs)}, {1}), device);
  const int64_t rows = out.rows(), cols = out.cols();

  auto fresh = [&] {
    return fp8::QuantizedTensor::allocate(rows, cols, c.fp8, c.mode, c.usage, device);
  };
  fp8::QuantizedTensor expected = fresh();
  const Tensor expected_amax = on(Tensor::from_vector({kAmaxBefore}, {1}), device);
  ops::quantize(unfused, expected, ops::QuantizeArgs{scale, expected_amax});

  const Tensor expected_sums = Tensor::zeros({cols}, DType::f32, device);
  ops::sum_rows(unfused, expected_sums, /*accumulate=*/true);

  const auto check = [&](const std::function<void(const ops::FusedQuantize*)>& fused_run,
                         const char* what) {
    SCOPED_TRACE(what);
    fp8::QuantizedTensor actual = fresh();
    const Tensor actual_amax = on(Tensor::from_vector({kAmaxBefore}, {1}), device);
    ops::QuantizeArgs args{scale, actual_amax};
    args.column_sums = Tensor::zeros({cols}, DType::f32, device);
    const ops::FusedQuantize fused{&actual, args};
    fused_run(&fused);
    if (c.usage.rowwise) {
      EXPECT_TRUE(bitwise_equal(expected.data, actual.data)) << "data";
      EXPECT_TRUE(bitwise_equal(expected.scale_inv, actual.scale_inv)) << "scale_inv";
    }
    if (c.usage.columnwise) {
      EXPECT_TRUE(bitwise_equal(expected.data_t, actual.data_t)) << "data_t";
      EXPECT_TRUE(bitwise_equal(expected.scale_inv_t, actual.scale_inv_t)) << "scale_inv_t";
    }
    EXPECT_TRUE(bitwise_equal(expected_amax, actual_amax)) << "amax";
    EXPECT_GT(to_floats(actual_amax)[0], kAmaxBefore) << "amax was not raised";
    EXPECT_TRUE(bitwise_equal(expected_sums, args.column_sums)) << "column sums";
  };
  check(run, "with the op's output");
  EXPECT_TRUE(bitwise_equal(unfused, out)) << "the op's own output";
  if (run_fp8_only) check(run_fp8_only, "FP8 output only");
}

/// Expects `run` to throw octet::Error with every one of `parts` in its message.
template <typename Run>
void expect_error(Run&& run, std::initializer_list<std::string> parts) {
  try {
    run();
    ADD_FAILURE() << "expected an octet::Error mentioning \"" << *parts.begin() << "\"";
  } catch (const Error& e) {
    for (const std::string& part : parts) EXPECT_THAT(e.what(), ::testing::HasSubstr(part));
  }
}

/// Rounds v to what a tensor of `dtype` (f32 or bf16) holds.
inline float representable(float v, DType dtype) {
  return dtype == DType::bf16 ? fp8::decode_bf16(fp8::encode_bf16(v)) : v;
}

}  // namespace octet::testing
