// ops::quantize_groups: every group's result (both copies, scales, amax, column sums) is bitwise
// what ops::quantize on the CPU gives for that group's rows alone, on every backend, scaling mode
// and input dtype; empty groups, groups the caller skips, rows past the last offset and more
// groups than one CUDA launch takes are covered, as are targets carved from one allocation; bad
// offsets and targets are refused by name.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "octet/ops/quantize.h"
#include "ops/op_check.h"
#include "test_util.h"

namespace octet {
namespace {

using fp8::QuantizedTensor;
using fp8::ScalingMode;
using fp8::Usage;
using testing::bitwise_equal;
using testing::device_name;
using testing::error_of;
using testing::on;

constexpr int64_t kCols = 160;  // a full 128-column tile and a ragged one
/// Rows per group: uneven, one empty, one not a multiple of 16, one past a 128-row tile; 20
/// groups with the tail, more than the 16 of one CUDA launch.
const std::vector<int64_t> kGroupRows = {48, 0, 37, 16, 160, 0, 128, 5, 16, 32,
                                         64, 16, 0, 48, 16, 16, 96, 16, 33, 16};
/// Rows after the last group: never read (they hold NaN).
constexpr int64_t kPaddingRows = 24;
/// The group the caller quantizes another way (a null target).
constexpr size_t kSkippedGroup = 3;

std::vector<int64_t> offsets_of(const std::vector<int64_t>& rows) {
  std::vector<int64_t> offsets{0};
  for (int64_t r : rows) offsets.push_back(offsets.back() + r);
  return offsets;
}

struct GroupCase {
  Device backend;
  DType input;
  ScalingMode mode;
  Usage usage;
  bool column_sums;
};

std::vector<GroupCase> group_cases() {
  std::vector<GroupCase> cases;
  for (const Device& backend : testing::all_backends())
    for (DType input : {DType::f32, DType::bf16})
      for (ScalingMode mode : testing::kScalingModes)
        for (Usage usage : {Usage{true, true}, Usage{true, false}})
          for (bool sums : {false, true}) cases.push_back({backend, input, mode, usage, sums});
  return cases;
}

std::string group_case_name(const ::testing::TestParamInfo<GroupCase>& info) {
  const GroupCase& p = info.param;
  return device_name(p.backend) + "_" + std::string(dtype_name(p.input)) + "_" +
         std::string(fp8::scaling_mode_name(p.mode)) +
         (p.usage.columnwise ? "_both" : "_rowwise") +
         (p.column_sums ? "_sums" : "");
}

/// One group's target on `device`: its own FP8 dtype (they alternate, so CUDA splits the
/// launches where the dtype changes), scale, amax slot and column sums.
struct Target {
  QuantizedTensor q;
  ops::QuantizeArgs args;
};

/// Group g's scale, amax slot and column sums on `device`.
ops::QuantizeArgs make_args(const GroupCase& p, size_t g, const Device& device,
                            const std::vector<float>& column_start) {
  ops::QuantizeArgs args;
  if (p.mode == ScalingMode::per_tensor)
    args.scale = Tensor::from_vector({0.5f + static_cast<float>(g)}, {1}).to(device);
  args.amax = Tensor::from_vector({0.25f}, {1}).to(device);
  args.power_of_2_block_scales = g % 2 == 0;
  if (p.column_sums) {
    args.column_sums = Tensor::from_vector(column_start, {kCols}).to(device);
    args.accumulate_column_sums = g % 2 == 1;
  }
  return args;
}

Target make_target(const GroupCase& p, int64_t rows, size_t g, const Device& device,
                   const std::vector<float>& column_start) {
  const DType fp8 = g % 3 == 2 ? DType::e5m2 : DType::e4m3;
  return {QuantizedTensor::allocate(rows, kCols, fp8, p.mode, p.usage, device),
          make_args(p, g, device, column_start)};
}

void expect_target_equal(const Target& expected, const Target& got) {
  const QuantizedTensor& a = expected.q;
  const QuantizedTensor& b = got.q;
  if (a.has_rowwise()) {
    EXPECT_TRUE(bitwise_equal(a.data, b.data)) << "data";
    EXPECT_TRUE(bitwise_equal(a.scale_inv, b.scale_inv)) << "scale_inv";
  }
  if (a.has_columnwise()) {
    EXPECT_TRUE(bitwise_equal(a.data_t, b.data_t)) << "data_t";
    EXPECT_TRUE(bitwise_equal(a.scale_inv_t, b.scale_inv_t)) << "scale_inv_t";
  }
  EXPECT_TRUE(bitwise_equal(expected.args.amax, got.args.amax)) << "amax";
  if (expected.args.column_sums.defined())
    EXPECT_TRUE(bitwise_equal(expected.args.column_sums, got.args.column_sums)) << "column sums";
}

using QuantizeGroups = testing::SeededParityTest<GroupCase>;

TEST_P(QuantizeGroups, EachGroupIsBitwiseTheCpuQuantizeOfItsRows) {
  const GroupCase& p = GetParam();
  const std::vector<int64_t> offsets = offsets_of(kGroupRows);
  const int64_t grouped = offsets.back();
  std::vector<float> values = testing::signed_magnitudes(grouped * kCols, 1e-3f, 8.0f, rng);
  values.resize(static_cast<size_t>((grouped + kPaddingRows) * kCols),
                std::numeric_limits<float>::quiet_NaN());
  const Tensor x_cpu = testing::make_tensor(values, {grouped + kPaddingRows, kCols}, p.input);
  const Tensor x = on(x_cpu, p.backend);
  const std::vector<float> column_start = testing::uniform_values(kCols, -1.0f, 1.0f, rng);

  std::vector<Target> expected, got;
  std::vector<ops::FusedQuantize> targets(kGroupRows.size());
  for (size_t g = 0; g < kGroupRows.size(); ++g) {
    const int64_t rows = std::max<int64_t>(kGroupRows[g], 1);  // an empty group's unused target
    expected.push_back(make_target(p, rows, g, Device::cpu(), column_start));
    got.push_back(make_target(p, rows, g, p.backend, column_start));
  }
  for (size_t g = 0; g < kGroupRows.size(); ++g) {
    if (g != kSkippedGroup) targets[g] = {&got[g].q, got[g].args};
    if (kGroupRows[g] == 0 || g == kSkippedGroup) continue;
    ops::quantize(x_cpu.slice(offsets[g], offsets[g + 1]), expected[g].q, expected[g].args);
  }
  ops::quantize_groups(x, offsets, targets);

  for (size_t g = 0; g < kGroupRows.size(); ++g) {
    SCOPED_TRACE(::testing::Message() << "group " << g << " of " << kGroupRows[g] << " rows");
    if (kGroupRows[g] == 0 || g == kSkippedGroup) {  // untouched: amax and sums as they were
      EXPECT_TRUE(bitwise_equal(expected[g].args.amax, got[g].args.amax)) << "amax";
      if (p.column_sums)
        EXPECT_TRUE(bitwise_equal(expected[g].args.column_sums, got[g].args.column_sums));
      continue;
    }
    expect_target_equal(expected[g], got[g]);
    EXPECT_TRUE(std::isfinite(testing::to_floats(got[g].args.amax)[0]))
        << "the NaN rows past the last offset were read";
  }
}

/// Targets carved from one allocation per kind (QuantizedTensor::allocate_groups, as GroupedLinear
/// makes its experts') are written exactly as separately allocated ones: same bits, and no group
/// writes past its own piece.
TEST_P(QuantizeGroups, CarvedTargetsGetWhatSeparateOnesGet) {
  const GroupCase& p = GetParam();
  const std::vector<int64_t> offsets = offsets_of(kGroupRows);
  const Tensor x = on(testing::make_tensor(
                          testing::signed_magnitudes(offsets.back() * kCols, 1e-3f, 8.0f, rng),
                          {offsets.back(), kCols}, p.input),
                      p.backend);
  const std::vector<float> column_start = testing::uniform_values(kCols, -1.0f, 1.0f, rng);
  std::vector<QuantizedTensor> carved = QuantizedTensor::allocate_groups(
      kGroupRows, kCols, DType::e4m3, p.mode, p.usage, p.backend);
  std::vector<Target> separate, in_carved;
  separate.reserve(kGroupRows.size());  // the targets point into both
  in_carved.reserve(kGroupRows.size());
  std::vector<ops::FusedQuantize> separate_targets(kGroupRows.size()),
      carved_targets(kGroupRows.size());
  for (size_t g = 0; g < kGroupRows.size(); ++g) {
    if (kGroupRows[g] == 0) continue;
    separate.push_back({QuantizedTensor::allocate(kGroupRows[g], kCols, DType::e4m3, p.mode,
                                                  p.usage, p.backend),
                        make_args(p, g, p.backend, column_start)});
    in_carved.push_back({std::move(carved[g]), make_args(p, g, p.backend, column_start)});
    separate_targets[g] = {&separate.back().q, separate.back().args};
    carved_targets[g] = {&in_carved.back().q, in_carved.back().args};
  }
  ops::quantize_groups(x, offsets, separate_targets);
  ops::quantize_groups(x, offsets, carved_targets);
  for (size_t t = 0; t < separate.size(); ++t) {
    SCOPED_TRACE(::testing::Message() << "non-empty group " << t);
    expect_target_equal(separate[t], in_carved[t]);
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, QuantizeGroups, ::testing::ValuesIn(group_cases()),
                         group_case_name);

class QuantizeGroupsErrors : public ::testing::TestWithParam<Device> {};

TEST_P(QuantizeGroupsErrors, BadOffsetsAndTargetsAreRefusedByName) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const Tensor x = testing::random_tensor({32, kCols}, DType::bf16, testing::fresh_seed())
                       .to(device);
  QuantizedTensor q = QuantizedTensor::allocate(16, kCols, DType::e4m3, ScalingMode::block_1x128,
                                                {true, true}, device);
  const std::vector<ops::FusedQuantize> two = {{&q, {}}, {&q, {}}};
  const std::vector<int64_t> too_few = {0, 16};
  EXPECT_THAT(error_of([&] { ops::quantize_groups(x, too_few, two); }),
              ::testing::HasSubstr("expected 3 group offsets for 2 targets, got 2"));
  const std::vector<int64_t> decreasing = {0, 16, 8};
  EXPECT_THAT(error_of([&] { ops::quantize_groups(x, decreasing, two); }),
              ::testing::HasSubstr("must not decrease, got 8 after 16 (group 1)"));
  const std::vector<int64_t> past_end = {0, 16, 48};
  EXPECT_THAT(error_of([&] { ops::quantize_groups(x, past_end, two); }),
              ::testing::HasSubstr("end at row 48 but x has 32 rows"));
  const std::vector<int64_t> wrong_rows = {0, 16, 24};
  EXPECT_THAT(error_of([&] { ops::quantize_groups(x, wrong_rows, two); }),
              ::testing::HasSubstr("quantize_groups (group 1): shape mismatch"));
  const Tensor f16_like = Tensor::empty({32, kCols}, DType::e4m3, device);
  const std::vector<int64_t> fine = {0, 16, 32};
  EXPECT_THAT(error_of([&] { ops::quantize_groups(f16_like, fine, two); }),
              ::testing::HasSubstr("expected f32 or bf16"));
}

INSTANTIATE_TEST_SUITE_P(AllBackends, QuantizeGroupsErrors,
                         ::testing::ValuesIn(testing::all_backends()),
                         [](const auto& info) { return device_name(info.param); });

}  // namespace
}  // namespace octet
