// QuantizedTensor's buffers: allocate() gives the shapes and scale layouts each scaling mode
// documents; allocate_groups() carves the same buffers for many groups out of one allocation per
// kind (row-wise data, transposed data, their scales), each piece aligned and none overlapping.
#include "octet/fp8/quantized_tensor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "ops/op_check.h"
#include "test_util.h"

namespace octet {
namespace {

using fp8::QuantizedTensor;
using fp8::ScalingMode;
using fp8::Usage;
using testing::error_of;
using ::testing::HasSubstr;

constexpr int64_t kCols = 160;  // a full 128-column tile and a ragged one
/// Uneven groups, two empty, one of a single row.
const std::vector<int64_t> kGroupRows = {48, 0, 37, 1, 160, 0, 16};

uintptr_t address(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.raw_data()); }

/// Every tensor of q: its pieces, in the order allocate() names them.
std::vector<const Tensor*> pieces(const QuantizedTensor& q) {
  return {&q.data, &q.scale_inv, &q.data_t, &q.scale_inv_t};
}

struct CarveCase {
  ScalingMode mode;
  Usage usage;
};

class AllocateGroups : public ::testing::TestWithParam<CarveCase> {};

TEST_P(AllocateGroups, EachGroupIsWhatAllocateGivesCarvedFromOneBufferPerKind) {
  const auto [mode, usage] = GetParam();
  const Device cpu = Device::cpu();
  const std::vector<QuantizedTensor> groups =
      QuantizedTensor::allocate_groups(kGroupRows, kCols, DType::e5m2, mode, usage, cpu);
  ASSERT_EQ(groups.size(), kGroupRows.size());
  const bool shared_scale = mode == ScalingMode::per_tensor && usage.rowwise;
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;  // [begin, end) of every distinct piece
  const QuantizedTensor* first = nullptr;
  for (size_t g = 0; g < groups.size(); ++g) {
    SCOPED_TRACE(::testing::Message() << "group " << g << " of " << kGroupRows[g] << " rows");
    const QuantizedTensor& q = groups[g];
    if (kGroupRows[g] == 0) {
      EXPECT_FALSE(q.has_rowwise() || q.has_columnwise()) << "an empty group gets no buffers";
      continue;
    }
    const QuantizedTensor single =
        QuantizedTensor::allocate(kGroupRows[g], kCols, DType::e5m2, mode, usage, cpu);
    EXPECT_EQ(q.rows, kGroupRows[g]);
    EXPECT_EQ(q.cols, kCols);
    EXPECT_EQ(q.dtype, DType::e5m2);
    EXPECT_EQ(q.mode, mode);
    const std::vector<const Tensor*> got = pieces(q), want = pieces(single);
    for (size_t k = 0; k < got.size(); ++k) {
      SCOPED_TRACE(::testing::Message() << "piece " << k);
      ASSERT_EQ(got[k]->defined(), want[k]->defined());
      if (!got[k]->defined()) continue;
      EXPECT_EQ(got[k]->shape(), want[k]->shape());
      EXPECT_EQ(got[k]->dtype(), want[k]->dtype());
      // Aligned within its allocation (whose own start the allocator aligns).
      EXPECT_EQ((address(*got[k]) - reinterpret_cast<uintptr_t>(got[k]->storage()->data())) %
                    QuantizedTensor::kGroupAlignment,
                0u);
      if (k == 3 && shared_scale) {
        EXPECT_EQ(got[k]->raw_data(), q.scale_inv.raw_data()) << "one scale serves both copies";
        continue;
      }
      ranges.emplace_back(address(*got[k]), address(*got[k]) + got[k]->nbytes());
    }
    // One allocation per kind: every group's piece of a kind shares the first group's memory.
    if (first == nullptr) first = &q;
    for (size_t k = 0; k < got.size(); ++k) {
      if (got[k]->defined()) EXPECT_EQ(got[k]->storage(), pieces(*first)[k]->storage());
    }
    if (usage.rowwise && usage.columnwise) {
      EXPECT_NE(q.data.storage(), q.data_t.storage())
          << "the row-wise copies must be freeable apart from the transposed ones";
    }
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    EXPECT_LE(ranges[i - 1].second, ranges[i].first) << "pieces " << i - 1 << " and " << i
                                                     << " overlap";
  }
}

std::vector<CarveCase> carve_cases() {
  std::vector<CarveCase> cases;
  for (ScalingMode mode : testing::kScalingModes)
    for (Usage usage : {Usage{true, true}, Usage{true, false}, Usage{false, true}})
      cases.push_back({mode, usage});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Modes, AllocateGroups, ::testing::ValuesIn(carve_cases()),
                         [](const auto& info) {
                           const Usage u = info.param.usage;
                           return std::string(fp8::scaling_mode_name(info.param.mode)) +
                                  (u.rowwise && u.columnwise ? "_both"
                                   : u.rowwise               ? "_rowwise"
                                                             : "_columnwise");
                         });

TEST(AllocateGroupsErrors, BadShapesAndFormatsAreRefusedByName) {
  const Device cpu = Device::cpu();
  const std::vector<int64_t> negative = {4, -1};
  EXPECT_THAT(error_of([&] {
                QuantizedTensor::allocate_groups(negative, kCols, DType::e4m3,
                                                 ScalingMode::per_tensor, {}, cpu);
              }),
              HasSubstr("a group of -1 rows"));
  const std::vector<int64_t> rows = {4};
  EXPECT_THAT(error_of([&] {
                QuantizedTensor::allocate_groups(rows, kCols, DType::bf16,
                                                 ScalingMode::per_tensor, {}, cpu);
              }),
              HasSubstr("needs an FP8 dtype"));
  EXPECT_THAT(error_of([&] {
                QuantizedTensor::allocate_groups(rows, kCols, DType::e4m3,
                                                 ScalingMode::per_tensor, {false, false}, cpu);
              }),
              HasSubstr("got neither"));
  EXPECT_THAT(error_of([&] {
                QuantizedTensor::allocate(0, kCols, DType::e4m3, ScalingMode::per_tensor, {}, cpu);
              }),
              HasSubstr("needs a non-empty matrix, got [0, 160]"));
  const std::vector<int64_t> none = {0, 0};
  const std::vector<QuantizedTensor> empty = QuantizedTensor::allocate_groups(
      none, kCols, DType::e4m3, ScalingMode::per_tensor, {}, cpu);
  ASSERT_EQ(empty.size(), 2u);
  EXPECT_FALSE(empty[0].has_rowwise() || empty[1].has_rowwise());
}

}  // namespace
}  // namespace octet
