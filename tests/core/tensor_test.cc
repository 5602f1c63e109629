#include "octet/core/tensor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <numeric>
#include <utility>

#include "test_util.h"

namespace octet {
namespace {

using testing::error_of;
using ::testing::HasSubstr;

Tensor iota(const Shape& shape) {
  std::vector<float> values(shape_numel(shape));
  std::iota(values.begin(), values.end(), 1.0f);
  return Tensor::from_vector(values, shape);
}

TEST(Tensor, ViewSharesStorage) {
  Tensor t = Tensor::from_vector({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor v = t.view({3, -1});
  EXPECT_EQ(v.shape(), (Shape{3, 2}));
  v.data<float>()[0] = 42;
  EXPECT_EQ(t.data<float>()[0], 42);
}

TEST(Tensor, ViewInfersOneExtent) {
  Tensor t = iota({2, 3, 4});
  EXPECT_EQ(t.view({-1}).shape(), (Shape{24}));
  EXPECT_EQ(t.view({4, -1, 2}).shape(), (Shape{4, 3, 2}));
  EXPECT_EQ(t.view({24, 1}).shape(), (Shape{24, 1}));
  EXPECT_EQ(t.view({-1, 4}).raw_data(), t.raw_data());
}

TEST(Tensor, ViewRejectsBadShapes) {
  Tensor t = iota({2, 3});
  EXPECT_THAT(error_of([&] {
                t.view({4, 2});
              }),
              HasSubstr("cannot view f32[2, 3] on cpu as [4, 2]: element counts differ"));
  EXPECT_THAT(error_of([&] {
                t.view({-1, -1});
              }),
              HasSubstr("view shape [-1, -1] has more than one -1"));
  EXPECT_THAT(error_of([&] {
                t.view({4, -1});
              }),
              HasSubstr("cannot view f32[2, 3] on cpu as [4, -1]"));
  EXPECT_THAT(error_of([&] {
                t.view({0, -1});
              }),
              HasSubstr("cannot view f32[2, 3] on cpu as [0, -1]"));
}

TEST(Tensor, ShapeQueries) {
  Tensor t = iota({2, 3, 5});
  EXPECT_EQ(t.ndim(), 3);
  EXPECT_EQ(t.numel(), 30);
  EXPECT_EQ(t.nbytes(), 120u);
  EXPECT_EQ(t.size(0), 2);
  EXPECT_EQ(t.size(-1), 5);
  EXPECT_EQ(t.size(-3), 2);
  EXPECT_EQ(t.rows(), 6);  // leading dims fold into rows
  EXPECT_EQ(t.cols(), 5);
  EXPECT_EQ(iota({7}).rows(), 1);
  EXPECT_EQ(iota({7}).cols(), 7);
  EXPECT_THAT(error_of([&] { t.size(3); }),
              HasSubstr("dimension 3 out of range for shape [2, 3, 5]"));
  EXPECT_THAT(error_of([&] { t.size(-4); }), HasSubstr("dimension -4 out of range"));
  Tensor scalar = Tensor::zeros({}, DType::f32);
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_THAT(error_of([&] { scalar.rows(); }), HasSubstr("at least 1 dimension, got shape []"));
  EXPECT_EQ(shape_str({}), "[]");
  EXPECT_EQ(shape_str({1481, 677}), "[1481, 677]");
  EXPECT_EQ(shape_numel({2333, 0}), 0);
  EXPECT_EQ(t.describe(), "f32[2, 3, 5] on cpu");
  EXPECT_EQ(Tensor::zeros({1, 3221}, DType::e4m3).describe(), "e4m3[1, 3221] on cpu");
}

TEST(Tensor, SliceSharesStorageAndOffsets) {
  Tensor t = iota({4, 3});
  Tensor s = t.slice(1, 3);
  EXPECT_EQ(s.shape(), (Shape{2, 3}));
  EXPECT_EQ(s.data<float>()[0], 4.0f);  // row 1 starts at element 3
  EXPECT_EQ(s.data<float>()[5], 9.0f);
  s.data<float>()[1] = -1;
  EXPECT_EQ(t.data<float>()[4], -1.0f);
  // A slice of a slice accumulates the offset.
  EXPECT_EQ(s.slice(1, 2).data<float>()[0], 7.0f);
  EXPECT_EQ(t.slice(4, 4).numel(), 0);
  EXPECT_EQ(t.slice(0, 4).raw_data(), t.raw_data());
}

TEST(Tensor, SliceOutOfRange) {
  Tensor t = iota({4, 3});
  EXPECT_THAT(error_of([&] { t.slice(2, 5); }),
              HasSubstr("slice [2, 5) out of range for f32[4, 3] on cpu"));
  EXPECT_THAT(error_of([&] { t.slice(-1, 2); }), HasSubstr("slice [-1, 2) out of range"));
  EXPECT_THAT(error_of([&] { t.slice(3, 2); }), HasSubstr("slice [3, 2) out of range"));
  EXPECT_THAT(error_of([&] { Tensor::zeros({}, DType::f32).slice(0, 1); }),
              HasSubstr("slice of a scalar tensor"));
}

TEST(Tensor, ViewOfTypesBytesAtAnOffsetInsideTheStorage) {
  const Tensor bytes = Tensor::from_vector({1.0f, 2.0f, 3.0f, 4.0f}, {4});  // 16 bytes
  const Tensor tail = Tensor::view_of(bytes.storage(), 8, {2}, DType::f32);
  EXPECT_EQ(tail.storage(), bytes.storage());
  EXPECT_EQ(tail.data<float>()[0], 3.0f);
  EXPECT_EQ(Tensor::view_of(bytes.storage(), 2, {7}, DType::bf16).nbytes(), 14u);
  EXPECT_EQ(Tensor::view_of(bytes.storage(), 16, {0}, DType::f32).numel(), 0);
  EXPECT_THAT(error_of([&] { Tensor::view_of(bytes.storage(), 12, {2}, DType::f32); }),
              HasSubstr("8 bytes of f32 at byte 12 do not fit, aligned, in a storage of 16"));
  EXPECT_THAT(error_of([&] { Tensor::view_of(bytes.storage(), 2, {1}, DType::f32); }),
              HasSubstr("at byte 2 do not fit, aligned"));
  EXPECT_THAT(error_of([&] { Tensor::view_of(bytes.storage(), 20, {0}, DType::u8); }),
              HasSubstr("at byte 20 do not fit"));
  EXPECT_THAT(error_of([&] { Tensor::view_of(nullptr, 0, {1}, DType::u8); }),
              HasSubstr("needs a storage"));
}

TEST(Tensor, UndefinedTensorMisuse) {
  Tensor t;
  EXPECT_FALSE(t.defined());
  EXPECT_EQ(t.describe(), "undefined tensor");
  for (auto misuse : std::vector<std::function<void()>>{[&] { t.device(); }, [&] { t.raw_data(); },
                                                        [&] { t.data<float>(); },
                                                        [&] { t.view({1}); }, [&] { t.zero(); }}) {
    EXPECT_THAT(error_of(misuse), HasSubstr("use of an undefined tensor"));
  }
  EXPECT_THAT(error_of([&] { iota({2}).copy_from(t); }),
              HasSubstr("copy_from expects f32[2] on cpu, got undefined tensor"));
  Tensor good = iota({2});
  EXPECT_THAT(error_of([&] {
                common_device({&good, &t}, "my_op");
              }),
              HasSubstr("my_op: received an undefined tensor"));
}

TEST(Tensor, DataChecksTheElementType) {
  Tensor f = iota({2});
  EXPECT_NO_THROW(f.data<float>());
  EXPECT_THAT(error_of([&] { f.data<int32_t>(); }), HasSubstr("expected dtype i32, got f32"));
  EXPECT_THAT(error_of([&] { f.data<double>(); }),
              HasSubstr("element type of size 8 does not match tensor dtype f32"));
  Tensor b = Tensor::zeros({2}, DType::bf16);
  EXPECT_THAT(error_of([&] { b.data<uint16_t>(); }), HasSubstr("expected dtype u16, got bf16"));
  EXPECT_NO_THROW(Tensor::zeros({2}, DType::e4m3).data<uint8_t>());  // no mapping: size only
  EXPECT_NO_THROW(Tensor::zeros({2}, DType::i64).data<int64_t>());
}

TEST(Tensor, NegativeExtentIsRejected) {
  EXPECT_THAT(error_of([] {
                Tensor::empty({2, -1}, DType::f32);
              }),
              HasSubstr("tensor extents must be non-negative, got shape [2, -1]"));
  EXPECT_THAT(error_of([] { Tensor::zeros({-3}, DType::bf16); }), HasSubstr("got shape [-3]"));
}

TEST(Tensor, FromVectorChecksTheCount) {
  EXPECT_THAT(error_of([] {
                Tensor::from_vector({1, 2, 3}, {2, 2});
              }),
              HasSubstr("shape [2, 2] holds 4 elements, got 3 values"));
}

TEST(Tensor, CopyFromChecksShapeAndDtype) {
  Tensor dst = Tensor::zeros({2, 3}, DType::f32);
  EXPECT_THAT(error_of([&] {
                dst.copy_from(iota({3, 2}));
              }),
              HasSubstr("copy_from expects f32[2, 3] on cpu, got f32[3, 2] on cpu"));
  EXPECT_THAT(error_of([&] {
                dst.copy_from(Tensor::zeros({2, 3}, DType::bf16));
              }),
              HasSubstr("copy_from expects f32[2, 3] on cpu, got bf16[2, 3] on cpu"));
}

TEST(Tensor, CudaWithoutTheBackend) {
  if (built_with_cuda()) GTEST_SKIP() << "built with CUDA";
  EXPECT_THAT(error_of([] { Tensor::empty({2}, DType::f32, Device::cuda(0)); }),
              HasSubstr("cannot allocate on cuda:0: octet was built without CUDA"));
}

// ---------------------------------------------------------------------------------------------
// Every backend: placement, copies, zeroing, slicing.

class TensorOnDevice : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override { OCTET_SKIP_IF_UNAVAILABLE(GetParam()); }
};

TEST_P(TensorOnDevice, ToAndBackPreservesBytes) {
  const Device device = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (const Shape& shape : {Shape{1, 3221}, Shape{2333, 1}, Shape{1481, 677}}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + shape_str(shape));
      Tensor host = testing::random_tensor(shape, dtype, seed);
      Tensor on_device = host.to(device);
      EXPECT_EQ(on_device.device(), device);
      EXPECT_EQ(on_device.shape(), shape);
      EXPECT_EQ(on_device.dtype(), dtype);
      EXPECT_NE(on_device.raw_data(), host.raw_data());  // always a new allocation
      EXPECT_TRUE(testing::bitwise_equal(host, on_device.to(Device::cpu())));
      Tensor twin = on_device.clone();
      EXPECT_NE(twin.raw_data(), on_device.raw_data());
      EXPECT_TRUE(testing::bitwise_equal(host, twin));
    }
  }
}

TEST_P(TensorOnDevice, CopyFromAnyDevice) {
  const Device device = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Tensor src = testing::random_tensor({37, 41}, DType::f32, seed);
  Tensor dst = Tensor::zeros({37, 41}, DType::f32, device);
  dst.copy_from(src);  // host -> device
  EXPECT_TRUE(testing::bitwise_equal(src, dst));
  Tensor back = Tensor::zeros({37, 41}, DType::f32);
  back.copy_from(dst);  // device -> host
  EXPECT_TRUE(testing::bitwise_equal(src, back));
  Tensor same = Tensor::zeros({37, 41}, DType::f32, device);
  same.copy_from(dst);  // device -> device
  EXPECT_TRUE(testing::bitwise_equal(src, same));
}

TEST_P(TensorOnDevice, ZeroAndZeros) {
  const Device device = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Tensor t = testing::random_tensor({13, 7}, DType::bf16, seed).to(device);
  t.zero();
  for (uint8_t byte : testing::to_bytes(t)) ASSERT_EQ(byte, 0);
  for (uint8_t byte : testing::to_bytes(Tensor::zeros({5, 3}, DType::e4m3, device)))
    ASSERT_EQ(byte, 0);
}

TEST_P(TensorOnDevice, SliceAndViewOnDevice) {
  const Device device = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Tensor host = testing::random_tensor({10, 6}, DType::f32, seed);
  Tensor t = host.to(device);
  Tensor rows = t.slice(3, 7);
  EXPECT_EQ(rows.device(), device);
  EXPECT_TRUE(testing::bitwise_equal(host.slice(3, 7), rows));
  rows.zero();  // writes through to the parent, and only to rows 3..6
  std::vector<float> values = testing::to_floats(t);
  std::vector<float> original = testing::to_floats(host);
  for (int64_t i = 0; i < 60; ++i) {
    const bool zeroed = i >= 18 && i < 42;
    EXPECT_EQ(values[i], zeroed ? 0.0f : original[i]) << "element " << i;
  }
  EXPECT_TRUE(
      testing::bitwise_equal(host.slice(7, 10).view({3, 2, 3}), t.slice(7, 10).view({3, 2, 3})));
}

INSTANTIATE_TEST_SUITE_P(Backends, TensorOnDevice, ::testing::ValuesIn(testing::all_backends()),
                         [](const auto& info) { return info.param.is_cpu() ? "cpu" : "cuda0"; });

// A copy between GPU buffers returns before it runs: it must still read the source as it was when
// asked, and deliver before later work reads the destination. 64 MiB keeps the copy in flight
// while the host queues the source's overwrite. Between two GPUs (when there are two) this is the
// events' job; on one GPU, the stream's.
TEST(TensorCuda, CopiesBetweenGpuBuffersAreOrderedOnTheStreams) {
  const Device gpu0 = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu0);
  const Device gpu1 = cuda_device_count() > 1 ? Device::cuda(1) : gpu0;
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + ", second GPU " + gpu1.str());
  const Tensor host = testing::random_tensor({4096, 4096}, DType::f32, seed);
  for (const auto& [from, to] :
       {std::pair{gpu0, gpu1}, std::pair{gpu1, gpu0}, std::pair{gpu0, gpu0}}) {
    SCOPED_TRACE(from.str() + " -> " + to.str());
    Tensor src = host.to(from);
    Tensor dst = src.to(to);
    src.zero();  // queued behind the copy's read
    Tensor again = Tensor::zeros(host.shape(), DType::f32, to);
    again.copy_from(dst);  // reads dst after the copy wrote it
    src = Tensor();        // its memory goes back to the pool, behind the copy
    EXPECT_TRUE(testing::bitwise_equal(host, dst));
    EXPECT_TRUE(testing::bitwise_equal(host, again));
  }
}

TEST(Tensor, CommonDevice) {
  Tensor a = iota({2}), b = iota({3});
  EXPECT_EQ(common_device({&a, &b}, "op"), Device::cpu());
  EXPECT_EQ(common_device({&a, nullptr}, "op"), Device::cpu());  // null entries are skipped
  EXPECT_THAT(error_of([] { common_device({nullptr}, "op"); }), HasSubstr("op: no tensors given"));
}

TEST(Tensor, CommonDeviceRejectsMixedDevices) {
  Tensor a = iota({2}), b = iota({3});
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  Tensor c = b.to(gpu);
  EXPECT_THAT(error_of([&] {
                common_device({&a, &c}, "my_op");
              }),
              HasSubstr("my_op: all tensors must be on one device, got f32[2] on cpu and f32[3] "
                        "on cuda:0"));
}

}  // namespace
}  // namespace octet
