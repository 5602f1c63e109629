// The NCCL communicator as a group of one on one GPU: every collective on device tensors (and a
// host tensor, staged through the device) against the values it must leave. Skips without a GPU
// or without NCCL in the build; tests/dist/nccl_test.cc has the 2-rank case.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "octet/dist/nccl.h"
#include "test_util.h"

namespace octet::dist {
namespace {

TEST(DistNcclSingleRank, CollectivesOnDeviceTensorsLeaveTheValuesOfAGroupOfOne) {
  if (!built_with_nccl()) GTEST_SKIP() << "built without NCCL";
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  const Device gpu = Device::cuda(0);
  auto comm = make_nccl_communicator(gpu, 0, 1, [](UniqueIdBytes&) {});
  EXPECT_EQ(comm->size(), 1);
  const uint64_t seed = testing::fresh_seed();
  const Tensor a = testing::random_tensor({1481}, DType::f32, seed);
  const Tensor b = testing::random_tensor({3, 7}, DType::f32, seed + 1);
  Tensor da = a.to(gpu), db = b.to(gpu), host = Tensor::from_vector({2.5f}, {1});
  std::vector<Tensor> mixed{da, db, host};
  comm->all_reduce(mixed, ReduceOp::sum);
  EXPECT_EQ(testing::to_bytes(da), testing::to_bytes(a));
  EXPECT_EQ(testing::to_bytes(db), testing::to_bytes(b));
  EXPECT_EQ(testing::to_floats(host)[0], 2.5f);

  Tensor nan_row = Tensor::from_vector({1.0f, std::numeric_limits<float>::quiet_NaN(), -2.0f}, {3});
  Tensor dnan = nan_row.to(gpu);
  comm->all_reduce(std::span(&dnan, 1), ReduceOp::max);
  const std::vector<float> maxed = testing::to_floats(dnan);
  EXPECT_EQ(maxed[0], 1.0f);
  EXPECT_TRUE(std::isnan(maxed[1])) << "the MAX keeps a NaN";
  EXPECT_EQ(maxed[2], -2.0f) << "negative values survive the ordered keys";

  comm->reduce_scatter(mixed);
  EXPECT_EQ(testing::to_bytes(da), testing::to_bytes(a));
  comm->all_gather(mixed);
  EXPECT_EQ(testing::to_bytes(db), testing::to_bytes(b));
  Tensor ints = Tensor::from_vector({7.0f, 8.0f}, {2}).to(gpu);
  comm->broadcast(std::span(&ints, 1), 0);
  EXPECT_EQ(testing::to_floats(ints), (std::vector<float>{7.0f, 8.0f}));
  comm->barrier();
}

TEST(DistNcclSingleRank, WithoutNcclTheBuildRefusesWithOneClearError) {
  if (built_with_nccl()) GTEST_SKIP() << "built with NCCL";
  EXPECT_NE(testing::error_of([] {
              make_nccl_communicator(Device::cuda(0), 0, 2, [](UniqueIdBytes&) {});
            }).find("built without NCCL"),
            std::string::npos);
}

}  // namespace
}  // namespace octet::dist
