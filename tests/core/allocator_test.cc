// The CUDA allocator's host-side cache of small blocks (src/core/allocator.cc): a freed small
// block is handed out again without a CUDA call, and its reuse keeps stream order.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "octet/core/allocator.h"
#include "test_util.h"

namespace octet {
namespace {

using testing::fresh_seed;

/// Skips the calling test without a GPU or when OCTET_SMALL_BLOCK_CACHE=0 turned the cache off.
#define SKIP_WITHOUT_CACHE(gpu)                                                         \
  do {                                                                                  \
    OCTET_SKIP_IF_UNAVAILABLE(gpu);                                                     \
    const char* env = std::getenv("OCTET_SMALL_BLOCK_CACHE");                           \
    if (env != nullptr && std::strcmp(env, "0") == 0)                                   \
      GTEST_SKIP() << "OCTET_SMALL_BLOCK_CACHE=0";                                      \
  } while (false)

TEST(SmallBlockCache, AFreedSmallBlockIsHandedOutAgainForItsSizeClass) {
  const Device gpu = Device::cuda(0);
  SKIP_WITHOUT_CACHE(gpu);
  // The class edges: up to 256 bytes, 257 to 512, ..., up to 64 KiB.
  for (const size_t bytes : {size_t{0}, size_t{4}, size_t{256}, size_t{257}, size_t{4096},
                             size_t{65536}}) {
    void* first = device_alloc(bytes, gpu);
    device_free(first, bytes, gpu);
    void* again = device_alloc(bytes, gpu);
    EXPECT_EQ(again, first) << bytes << " bytes";
    device_free(again, bytes, gpu);
  }
  // Another class does not get the block: 300 bytes are kept with the 512-byte blocks.
  void* mid = device_alloc(300, gpu);
  device_free(mid, 300, gpu);
  void* small = device_alloc(200, gpu);
  EXPECT_NE(small, mid);
  device_free(small, 200, gpu);
}

TEST(SmallBlockCache, AReusedBlockKeepsStreamOrder) {
  const Device gpu = Device::cuda(0);
  SKIP_WITHOUT_CACHE(gpu);
  const Tensor a_host = testing::random_tensor({64}, DType::f32, fresh_seed());
  const Tensor b_host = testing::random_tensor({64}, DType::f32, fresh_seed());
  Tensor out = Tensor::empty({64}, DType::f32, gpu);
  const void* freed = nullptr;
  {
    const Tensor a = a_host.to(gpu);
    freed = a.raw_data();
    out.copy_from(a);  // queued on octet's stream; a's block is freed before it may have run
  }
  Tensor b = Tensor::empty({64}, DType::f32, gpu);
  ASSERT_EQ(b.raw_data(), freed) << "the freed block was not reused: the test shows nothing";
  b.copy_from(b_host);  // written after the queued read of the block's old contents
  EXPECT_TRUE(testing::bitwise_equal(a_host, out.to(Device::cpu())));
  EXPECT_TRUE(testing::bitwise_equal(b_host, b.to(Device::cpu())));
}

}  // namespace
}  // namespace octet
