// Host blocks around the huge-page threshold: each aligned as allocator.h promises, all of the
// bytes asked for usable while every block is live (no block short or overlapping another), and
// counted in the host peak; freed, the live count falls back.
#include "octet/core/allocator.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "test_util.h"

namespace octet {
namespace {

bool aligned_to(const void* ptr, size_t alignment) {
  return reinterpret_cast<uintptr_t>(ptr) % alignment == 0;
}

TEST(HostAllocator, BlocksAroundTheHugePageThresholdAreAlignedWholeAndCounted) {
  const Device cpu = Device::cpu();
  const size_t huge = kHostHugePageBytes;
  const std::vector<size_t> sizes = {1, 63, 65, huge - 1, huge, huge + 1, 3 * huge + 4097};
  const uint64_t seed = testing::fresh_seed();

  reset_device_peak(cpu);
  const size_t held_before = device_peak_bytes(cpu);
  size_t asked = 0;
  std::vector<uint8_t*> blocks;
  for (size_t bytes : sizes) {
    auto* block = static_cast<uint8_t*>(device_alloc(bytes, cpu));
    blocks.push_back(block);
    asked += bytes;
    EXPECT_TRUE(aligned_to(block, kHostAlignment)) << bytes << " bytes";
    if (bytes >= huge) EXPECT_TRUE(aligned_to(block, huge)) << bytes << " bytes";
  }
  // Every byte of every block, written while all are live, then read back.
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::mt19937_64 rng(seed + i);
    for (size_t j = 0; j < sizes[i]; ++j) blocks[i][j] = static_cast<uint8_t>(rng());
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::mt19937_64 rng(seed + i);
    size_t wrong = 0;
    for (size_t j = 0; j < sizes[i]; ++j) wrong += blocks[i][j] != static_cast<uint8_t>(rng());
    EXPECT_EQ(wrong, 0u) << sizes[i] << "-byte block";
  }
  EXPECT_GE(device_peak_bytes(cpu), held_before + asked);

  for (size_t i = 0; i < blocks.size(); ++i) device_free(blocks[i], cpu);
  reset_device_peak(cpu);
  EXPECT_EQ(device_peak_bytes(cpu), held_before) << "the blocks' bytes are no longer held";
}

}  // namespace
}  // namespace octet
