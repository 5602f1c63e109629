// Tests of the copy family on every backend: copy_tensors moves every pair of a mixed list (dtypes,
// sizes past one CTA's chunk, odd sizes, slices at unaligned offsets, shapes that differ with
// the element count) bit for bit and touches no byte outside the destinations; a list longer than
// one CUDA launch takes; and every bad argument gets its message before anything is written.
#include "octet/ops/copy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "ops/copy_backend.h"
#include "ops/op_check.h"
#include "test_util.h"

namespace octet {
namespace {

using testing::expect_error;
using testing::to_bytes;

/// Extra elements on each side of a slice, so a copy that strays past its tensor shows.
constexpr int64_t kGuard = 8;

/// One pair of a list: src and dst are slices `src_offset` and `dst_offset` elements into buffers
/// of their own with kGuard elements beyond them, viewed as `src_shape` and `dst_shape`.
struct PairCase {
  DType dtype;
  Shape src_shape, dst_shape;
  int64_t src_offset = 0, dst_offset = 0;
};

/// A pair's buffers and its views into them.
struct Placed {
  Tensor src_buffer, dst_buffer, src, dst;
};

/// A 1-D buffer of `numel` elements of `dtype` on `device`, every byte drawn from `rng`.
Tensor random_buffer(int64_t numel, DType dtype, const Device& device, std::mt19937_64& rng) {
  Tensor t = Tensor::empty({numel}, dtype);
  auto* bytes = static_cast<uint8_t*>(t.raw_data());
  for (size_t i = 0; i < t.nbytes(); ++i) bytes[i] = static_cast<uint8_t>(rng());
  return t.to(device);
}

/// `shape` viewed `offset` elements into a fresh random buffer with kGuard elements after it.
Tensor place(const Shape& shape, int64_t offset, DType dtype, const Device& device,
             std::mt19937_64& rng, Tensor& buffer) {
  const int64_t numel = shape_numel(shape);
  buffer = random_buffer(offset + numel + kGuard, dtype, device, rng);
  return buffer.slice(offset, offset + numel).view(shape);
}

/// Copies every pair of `cases` with one copy_tensors call on `device`, then checks each dst
/// buffer: the slice holds src's bytes and every other byte is as it was; src is untouched.
void check_copies(const std::vector<PairCase>& cases, const Device& device, std::mt19937_64& rng) {
  std::vector<Placed> pairs(cases.size());
  std::vector<Tensor> src, dst;
  for (size_t i = 0; i < cases.size(); ++i) {
    const PairCase& c = cases[i];
    Placed& p = pairs[i];
    p.src = place(c.src_shape, c.src_offset, c.dtype, device, rng, p.src_buffer);
    p.dst = place(c.dst_shape, c.dst_offset, c.dtype, device, rng, p.dst_buffer);
    src.push_back(p.src);
    dst.push_back(p.dst);
  }
  std::vector<std::vector<uint8_t>> src_before, expected;
  for (size_t i = 0; i < cases.size(); ++i) {
    src_before.push_back(to_bytes(pairs[i].src_buffer));
    expected.push_back(to_bytes(pairs[i].dst_buffer));
    const size_t element = dtype_size(cases[i].dtype);
    const std::vector<uint8_t> bytes = to_bytes(pairs[i].src);
    std::copy(bytes.begin(), bytes.end(), expected[i].begin() + cases[i].dst_offset * element);
  }

  ops::copy_tensors(src, dst);

  for (size_t i = 0; i < cases.size(); ++i) {
    const PairCase& c = cases[i];
    SCOPED_TRACE("pair " + std::to_string(i) + ": " + pairs[i].src.describe() + " at element " +
                 std::to_string(c.src_offset) + " -> " + pairs[i].dst.describe() + " at element " +
                 std::to_string(c.dst_offset));
    const std::vector<uint8_t> got = to_bytes(pairs[i].dst_buffer);
    ASSERT_EQ(got.size(), expected[i].size());
    const auto [at, _] = std::mismatch(got.begin(), got.end(), expected[i].begin());
    ASSERT_TRUE(at == got.end()) << "dst buffer byte " << (at - got.begin()) << " of " << got.size()
                                 << " differs (the slice starts at byte "
                                 << c.dst_offset * static_cast<int64_t>(dtype_size(c.dtype)) << ")";
    ASSERT_EQ(to_bytes(pairs[i].src_buffer), src_before[i]) << "src was written";
  }
}

/// The backend, as a tuple for SeededParityTest.
using CopyCase = std::tuple<Device>;
using CopyTensors = testing::SeededParityTest<CopyCase>;

TEST_P(CopyTensors, CopiesAMixedListBitwiseAndNothingElse) {
  const int64_t chunk = ops::kCopyChunkBytes;
  const std::vector<PairCase> cases = {
      {DType::f32, {1}, {1}},                                        // a scale
      {DType::f32, {1024}, {1024}},                                  // an amax history
      {DType::f32, {2, 3}, {6}},                                     // shapes differ, numel agrees
      {DType::f32, {4097}, {4097}, 1, 0},                            // 4-byte aligned source
      {DType::f32, {2 * chunk / 4 + 5}, {2 * chunk / 4 + 5}, 2, 2},  // 8-byte, 3 chunks
      {DType::f32, {chunk / 4}, {chunk / 4}},                        // exactly one chunk
      {DType::bf16, {3221}, {3221}, 1, 3},                           // 2-byte aligned
      {DType::bf16, {1481, 7}, {7, 1481}},
      {DType::i32, {333}, {333}, 0, 1},
      {DType::i64, {9}, {3, 3}},
      {DType::u8, {chunk + 13}, {chunk + 13}, 1, 0},  // odd addresses, past a chunk
      {DType::u8, {1}, {1}, 3, 5},
      {DType::e4m3, {17}, {17}, 0, 8},
      {DType::f32, {0}, {0}},  // nothing to copy
      {DType::bf16, {5, 0}, {0}},
  };
  check_copies(cases, std::get<0>(GetParam()), rng);
}

TEST_P(CopyTensors, TakesAListLongerThanOneLaunch) {
  const DType dtypes[] = {DType::f32, DType::bf16, DType::i32, DType::u8};
  std::uniform_int_distribution<int64_t> numel(1, 48), offset(0, 3);
  std::vector<PairCase> cases;
  for (int i = 0; i < 2 * ops::kCopyMaxPairsPerLaunch + 7; ++i) {
    const int64_t n = numel(rng);
    cases.push_back({dtypes[i % 4], {n}, {n}, offset(rng), offset(rng)});
  }
  check_copies(cases, std::get<0>(GetParam()), rng);
}

TEST_P(CopyTensors, AnEmptyListDoesNothing) {
  ops::copy_tensors({}, {});
  std::vector<Tensor> none;
  ops::copy_tensors(none, none);
}

TEST_P(CopyTensors, RefusesBadListsBeforeWritingAnything) {
  const Device device = std::get<0>(GetParam());
  const auto f32 = [&](int64_t n) { return Tensor::zeros({n}, DType::f32, device); };
  const Tensor a = f32(4), b = f32(4), c = f32(4);
  const Tensor ones = Tensor::from_vector({1, 1, 1, 1}, {4}).to(device);
  const Tensor whole = Tensor::from_vector({0, 0, 0, 0, 1, 2, 3, 4}, {8}).to(device);
  const auto run = [&](std::vector<Tensor> src, std::vector<Tensor> dst) {
    return [src, dst] { ops::copy_tensors(src, dst); };
  };
  // Every refused list would copy ones into a first.
  expect_error(run({ones, b}, {a}), {"copy_tensors: src holds 2 tensors but dst holds 1"});
  expect_error(run({ones, Tensor()}, {a, b}), {"copy_tensors: src[1] is an undefined tensor"});
  expect_error(run({ones, b}, {a, Tensor()}), {"copy_tensors: dst[1] is an undefined tensor"});
  expect_error(run({ones, b}, {a, Tensor::zeros({4}, DType::i32, device)}),
               {"copy_tensors: dtype mismatch: dst[1] is i32[4]", "src[1] is f32[4]"});
  expect_error(run({ones, b}, {a, f32(5)}),
               {"copy_tensors: dst[1] holds 5 elements but src[1] holds 4"});
  // Overlaps: a dst listed twice, a dst that is another pair's source or its own, partial
  // overlaps of slices of one buffer.
  expect_error(run({ones, b}, {a, a}), {"copy_tensors: dst[1] overlaps dst[0] in memory"});
  expect_error(run({ones, b}, {a, ones}), {"copy_tensors: dst[1] overlaps src[0] in memory"});
  expect_error(run({ones, b}, {a, b}), {"copy_tensors: dst[1] overlaps src[1] in memory"});
  expect_error(run({ones, whole.slice(0, 4)}, {a, whole.slice(3, 7)}),
               {"copy_tensors: dst[1] overlaps src[1]"});
  expect_error(run({ones, b, c}, {a, whole.slice(0, 4), whole.slice(3, 7)}),
               {"copy_tensors: dst[2] overlaps dst[1]"});
  EXPECT_EQ(testing::to_floats(a), std::vector<float>(4, 0.0f));
  EXPECT_EQ(testing::to_floats(whole), std::vector<float>({0, 0, 0, 0, 1, 2, 3, 4}));
  // Adjacent slices do not overlap; sources may overlap each other.
  ops::copy_tensors(std::vector<Tensor>{whole.slice(4, 8), ones, ones},
                    std::vector<Tensor>{whole.slice(0, 4), a, c});
  EXPECT_EQ(testing::to_floats(whole), std::vector<float>({1, 2, 3, 4, 1, 2, 3, 4}));
  EXPECT_EQ(testing::to_floats(a), std::vector<float>(4, 1.0f));
  EXPECT_EQ(testing::to_floats(c), std::vector<float>(4, 1.0f));
}

/// Tensors on two devices: needs a GPU (the CPU and cuda:0).
TEST(CopyTensorsDevices, RefusesTensorsOnTwoDevices) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  const Tensor host = Tensor::zeros({4}, DType::f32), device = Tensor::zeros({4}, DType::f32, gpu);
  const Tensor other = Tensor::zeros({4}, DType::f32, gpu);
  expect_error([&] { ops::copy_tensors(std::vector{device}, std::vector{host}); },
               {"copy_tensors: all tensors must be on one device, got src[0] on cuda:0 and dst[0] "
                "f32[4] on cpu"});
  expect_error(
      [&] {
        ops::copy_tensors(std::vector{device, host}, std::vector{other, host.clone()});
      },
      {"copy_tensors: all tensors must be on one device, got src[0] on cuda:0 and src[1]"});
}

INSTANTIATE_TEST_SUITE_P(Ops, CopyTensors,
                         ::testing::Combine(::testing::ValuesIn(testing::all_backends())),
                         [](const ::testing::TestParamInfo<CopyCase>& info) {
                           return testing::device_name(std::get<0>(info.param));
                         });

}  // namespace
}  // namespace octet
