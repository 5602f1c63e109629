#include "octet/ops/reduce.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "ops/op_check.h"
#include "test_util.h"

namespace octet {
namespace {

using testing::bitwise_equal;
using testing::fresh_seed;
using ::testing::HasSubstr;
using testing::to_floats;

/// The documented order computed independently: per tile, the in-order sum of its runs'
/// sequential sums; then the tiles' partials in order after `initial`. Every backend must produce
/// exactly these bits.
std::vector<float> reference_sum_rows(const std::vector<float>& x, int64_t rows, int64_t cols,
                                      const std::vector<float>& initial, bool accumulate) {
  std::vector<float> out(cols);
  for (int64_t c = 0; c < cols; ++c) {
    float sum = accumulate ? initial[c] : 0.0f;
    for (int64_t tile = 0; tile < rows; tile += ops::kSumRowsTileRows) {
      const int64_t tile_end = std::min(rows, tile + ops::kSumRowsTileRows);
      float partial = 0.0f;
      for (int64_t run = tile; run < tile_end; run += ops::kSumRowsRunRows) {
        float run_sum = 0.0f;
        for (int64_t r = run; r < std::min(tile_end, run + ops::kSumRowsRunRows); ++r)
          run_sum += x[r * cols + c];
        partial += run_sum;
      }
      sum += partial;
    }
    out[c] = sum;
  }
  return out;
}

struct Extent {
  int64_t rows, cols;
};

using SumRowsParam = std::tuple<Device, DType, Extent, bool>;

using SumRowsTest = testing::SeededParityTest<SumRowsParam>;

TEST_P(SumRowsTest, MatchesFixedOrderReferenceBitwiseAndFloat64Closely) {
  const auto [device, dtype, extent, accumulate] = GetParam();
  Tensor x = testing::random_tensor({extent.rows, extent.cols}, dtype, seed).to(device);
  Tensor initial = testing::random_tensor({extent.cols}, DType::f32, seed + 1);
  Tensor out = initial.to(device);

  ops::sum_rows(x, out, accumulate);

  const std::vector<float> xs = to_floats(x);
  const std::vector<float> expected =
      reference_sum_rows(xs, extent.rows, extent.cols, to_floats(initial), accumulate);
  EXPECT_TRUE(bitwise_equal(Tensor::from_vector(expected, {extent.cols}), out));
  // And the fixed order is an accurate sum: against float64, |error| <= rows * eps * sum|x|.
  const std::vector<float> got = to_floats(out);
  const std::vector<float> init = to_floats(initial);
  for (int64_t c = 0; c < extent.cols; ++c) {
    double exact = accumulate ? init[c] : 0.0, magnitude = std::fabs(exact);
    for (int64_t r = 0; r < extent.rows; ++r) {
      exact += xs[r * extent.cols + c];
      magnitude += std::fabs(xs[r * extent.cols + c]);
    }
    const double bound = (extent.rows + 1) * 0x1p-24 * magnitude;
    ASSERT_LE(std::fabs(got[c] - exact), bound) << "column " << c;
  }
}

TEST_P(SumRowsTest, RepeatsBitwise) {
  const auto [device, dtype, extent, accumulate] = GetParam();
  Tensor x = testing::random_tensor({extent.rows, extent.cols}, dtype, seed).to(device);
  Tensor first = Tensor::zeros({extent.cols}, DType::f32, device);
  ops::sum_rows(x, first, accumulate);
  for (int run = 0; run < 3; ++run) {
    Tensor again = Tensor::zeros({extent.cols}, DType::f32, device);
    ops::sum_rows(x, again, accumulate);
    ASSERT_TRUE(bitwise_equal(first, again)) << "run " << run;
  }
}

std::string param_name(const ::testing::TestParamInfo<SumRowsParam>& info) {
  const auto& [device, dtype, extent, accumulate] = info.param;
  std::string name = device.is_cpu() ? "cpu" : "cuda" + std::to_string(device.index);
  return name + "_" + std::string(dtype_name(dtype)) + "_" + std::to_string(extent.rows) + "x" +
         std::to_string(extent.cols) + (accumulate ? "_acc" : "_set");
}

INSTANTIATE_TEST_SUITE_P(Shapes, SumRowsTest,
                         ::testing::Combine(::testing::ValuesIn(testing::all_backends()),
                                            ::testing::Values(DType::f32, DType::bf16),
                                            ::testing::Values(Extent{1, 3221}, Extent{2333, 1},
                                                              Extent{1481, 677}, Extent{128, 64},
                                                              Extent{129, 3}),
                                            ::testing::Bool()),
                         param_name);

TEST(SumRows, IntegerInputsAreExact) {
  for (const Device& device : testing::all_backends()) {
    if (device.is_cuda() && cuda_device_count() == 0) continue;
    SCOPED_TRACE(device.str());
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    Tensor x = testing::random_int_tensor({1000, 37}, DType::bf16, seed).to(device);
    Tensor out = Tensor::zeros({37}, DType::f32, device);
    ops::sum_rows(x, out, false);
    const std::vector<float> xs = to_floats(x), got = to_floats(out);
    for (int64_t c = 0; c < 37; ++c) {
      float exact = 0;
      for (int64_t r = 0; r < 1000; ++r) exact += xs[r * 37 + c];
      EXPECT_EQ(got[c], exact) << "column " << c;
    }
  }
}

TEST(SumRows, NoRowsGivesZeroOrKeepsOut) {
  Tensor x = Tensor::empty({0, 3}, DType::f32);
  Tensor out = Tensor::from_vector({1, 2, 3}, {3});
  ops::sum_rows(x, out, true);
  EXPECT_EQ(to_floats(out), (std::vector<float>{1, 2, 3}));
  ops::sum_rows(x, out, false);
  EXPECT_EQ(to_floats(out), (std::vector<float>{0, 0, 0}));
}

TEST(SumRows, RejectsBadArguments) {
  Tensor x = testing::random_tensor({4, 3}, DType::f32, fresh_seed());
  try {
    ops::sum_rows(x, Tensor::zeros({4}, DType::f32), false);
    FAIL() << "expected an error for a wrong out shape";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("out must be f32[3]"));
    EXPECT_THAT(e.what(), HasSubstr("f32[4]"));
  }
  try {
    ops::sum_rows(Tensor::zeros({4, 3}, DType::i32), Tensor::zeros({3}, DType::f32), false);
    FAIL() << "expected an error for an integer input";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("x must be f32 or bf16, got i32[4, 3]"));
  }
  try {
    ops::sum_rows(x, Tensor::zeros({3}, DType::bf16), false);
    FAIL() << "expected an error for a bf16 out";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("got bf16[3]"));
  }
}

}  // namespace
}  // namespace octet
