// QuantizedTensor's buffers: allocate() gives the shapes and scale layouts each scaling mode
// documents; allocate_groups() carves the same buffers for many groups out of one allocation per
// copy (the row-wise copies with their scales, the transposed ones with theirs), each piece
// aligned, none overlapping, the scales before the data.
#include "octet/fp8/quantized_tensor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "octet/core/allocator.h"
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

TEST_P(AllocateGroups, EachGroupIsWhatAllocateGivesCarvedFromOneBufferPerCopy) {
  const auto [mode, usage] = GetParam();
  const Device cpu = Device::cpu();
  const uint64_t allocations_before = device_allocations(cpu);
  const std::vector<QuantizedTensor> groups =
      QuantizedTensor::allocate_groups(kGroupRows, kCols, DType::e5m2, mode, usage, cpu);
  EXPECT_EQ(device_allocations(cpu) - allocations_before,
            (usage.rowwise ? 1u : 0u) + (usage.columnwise ? 1u : 0u))
      << "one allocation per copy";
  ASSERT_EQ(groups.size(), kGroupRows.size());
  const bool shared_scale = mode == ScalingMode::per_tensor && usage.rowwise && usage.columnwise;
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;  // [begin, end) of every distinct piece
  // Per allocation, where its scales end and its data begin.
  std::map<const Storage*, std::pair<uintptr_t, uintptr_t>> scales_end_data_begin;
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
      auto& [scales_end, data_begin] =
          scales_end_data_begin.try_emplace(got[k]->storage().get(), 0, UINTPTR_MAX).first->second;
      if (k % 2 == 0) {  // data and data_t
        data_begin = std::min(data_begin, ranges.back().first);
      } else {
        scales_end = std::max(scales_end, ranges.back().second);
      }
    }
    // One allocation per copy: every group's pieces of a copy share the first group's memory, and
    // each copy's scales live with it (per_tensor's shared one with the transposed copy).
    if (first == nullptr) first = &q;
    if (usage.rowwise) EXPECT_EQ(q.data.storage(), first->data.storage());
    if (usage.columnwise) EXPECT_EQ(q.data_t.storage(), first->data_t.storage());
    if (usage.rowwise) {
      EXPECT_EQ(q.scale_inv.storage(), shared_scale ? q.data_t.storage() : q.data.storage());
    }
    if (usage.columnwise) EXPECT_EQ(q.scale_inv_t.storage(), q.data_t.storage());
    if (usage.rowwise && usage.columnwise) {
      EXPECT_NE(q.data.storage(), q.data_t.storage())
          << "the row-wise copies must be freeable apart from the transposed ones";
    }
  }
  for (const auto& [storage, bounds] : scales_end_data_begin) {
    EXPECT_LE(bounds.first, bounds.second)
        << "the scales come first, so a data piece is followed only by data";
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
