// TensorCarver: the placed pieces, of mixed dtypes, view one allocation, each at its alignment,
// none overlapping; a second target views the same piece; nothing placed allocates nothing; a bad
// alignment is refused by name.
#include "octet/core/carve.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>

#include "octet/core/allocator.h"
#include "test_util.h"

namespace octet {
namespace {

using testing::error_of;
using ::testing::HasSubstr;

uintptr_t offset_in_allocation(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.raw_data()) -
         reinterpret_cast<uintptr_t>(t.storage()->data());
}

TEST(TensorCarver, PiecesShareOneAllocationAlignedAndApart) {
  const Device cpu = Device::cpu();
  Tensor a, b, b_also, c;
  TensorCarver carver(cpu, 64);
  carver.place({3, 5}, DType::f32, &a);
  carver.place({1}, DType::u8, &b, &b_also);
  carver.place({2, 2, 2}, DType::bf16, &c);
  const uint64_t before = device_allocations(cpu);
  carver.allocate();
  EXPECT_EQ(device_allocations(cpu), before + 1) << "one allocation for every piece";
  EXPECT_EQ(a.shape(), (Shape{3, 5}));
  EXPECT_EQ(c.shape(), (Shape{2, 2, 2}));
  EXPECT_EQ(a.dtype(), DType::f32);
  EXPECT_EQ(b.dtype(), DType::u8);
  EXPECT_EQ(c.dtype(), DType::bf16);
  EXPECT_EQ(a.storage(), c.storage());
  EXPECT_EQ(b.raw_data(), b_also.raw_data());
  // Offsets 0, 64 (after 60 bytes) and 128 (after 1 more): aligned, in order, apart.
  EXPECT_EQ(offset_in_allocation(a), 0u);
  EXPECT_EQ(offset_in_allocation(b), 64u);
  EXPECT_EQ(offset_in_allocation(c), 128u);
  EXPECT_EQ(a.storage()->bytes(), 128u + c.nbytes()) << "no padding after the last piece";
}

TEST(TensorCarver, NothingPlacedAllocatesNothingAndBadAlignmentsAreRefused) {
  const Device cpu = Device::cpu();
  TensorCarver empty(cpu, 256);
  const uint64_t before = device_allocations(cpu);
  empty.allocate();
  EXPECT_EQ(device_allocations(cpu), before);
  Tensor t;
  EXPECT_THAT(error_of([&] { TensorCarver(cpu, 6).place({2}, DType::f32, &t); }),
              HasSubstr("an alignment of 6 bytes is not a multiple of f32's 4"));
  EXPECT_THAT(error_of([&] { TensorCarver(cpu, 0); }),
              HasSubstr("an alignment of 0 bytes is not positive"));
}

}  // namespace
}  // namespace octet
