// The NCCL communicator over the mpirun ranks, one GPU each (rank r on cuda:r), its id shared
// over MPI: sums bitwise equal on every rank, MAX keeping a NaN, reduce_scatter as all_reduce's
// shard, all_gather. Skips without NCCL in the build or without a GPU per rank.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "octet/dist/nccl.h"
#include "test_util.h"
#include "world_seed.h"

namespace octet::dist {
namespace {

TEST(DistNccl, CollectivesOverTwoOrMoreGpusMatchTheCpuReference) {
  auto world = from_environment();
  if (world->size() < 2) GTEST_SKIP() << "needs mpirun -np 2 (or more) ranks";
  if (!built_with_nccl()) GTEST_SKIP() << "built without NCCL";
  if (cuda_device_count() < world->size()) GTEST_SKIP() << "needs a GPU per rank";
  const Device gpu = Device::cuda(world->rank());
  auto nccl = from_environment(gpu);
  ASSERT_EQ(nccl->size(), world->size());
  ASSERT_EQ(nccl->rank(), world->rank());
  const uint64_t seed = testing::world_seed(*world);
  const int64_t n = 2333;
  // Small integers: their sums are exact in any order, so every rank can check the values.
  std::vector<Tensor> inputs;
  for (int r = 0; r < world->size(); ++r)
    inputs.push_back(testing::random_int_tensor({n}, DType::f32, seed + r, 50));
  std::vector<float> sum(static_cast<size_t>(n), 0.0f), max = testing::to_floats(inputs[0]);
  for (const Tensor& t : inputs) {
    const std::vector<float> v = testing::to_floats(t);
    for (int64_t i = 0; i < n; ++i) {
      sum[i] += v[i];
      max[i] = std::max(max[i], v[i]);
    }
  }
  Tensor mine = inputs[world->rank()].to(gpu);
  nccl->all_reduce(std::span(&mine, 1), ReduceOp::sum);
  EXPECT_EQ(testing::to_floats(mine), sum);
  Tensor maxed = inputs[world->rank()].to(gpu);
  nccl->all_reduce(std::span(&maxed, 1), ReduceOp::max);
  EXPECT_EQ(testing::to_floats(maxed), max);

  // Normal floats: reduce_scatter's shard bitwise all_reduce's, on every rank the same.
  Tensor floats = testing::random_tensor({n}, DType::f32, seed * 31 + world->rank()).to(gpu);
  Tensor scattered = floats.to(gpu);
  nccl->all_reduce(std::span(&floats, 1), ReduceOp::sum);
  nccl->reduce_scatter(std::span(&scattered, 1));
  const ShardRange shard = shard_range(n, world->size(), world->rank());
  const std::vector<uint8_t> all = testing::to_bytes(floats), part = testing::to_bytes(scattered);
  EXPECT_EQ(std::memcmp(all.data() + shard.begin * 4, part.data() + shard.begin * 4,
                        shard.size() * 4),
            0);
  Tensor gathered = floats.to(gpu);  // all_gather of the all-reduced values gives them back
  nccl->all_gather(std::span(&gathered, 1));
  EXPECT_EQ(testing::to_bytes(gathered), all);
  Tensor root_bytes = Tensor::from_vector({static_cast<float>(world->rank())}, {1});
  nccl->broadcast(std::span(&root_bytes, 1), world->size() - 1);
  EXPECT_EQ(testing::to_floats(root_bytes)[0], static_cast<float>(world->size() - 1));
}

}  // namespace
}  // namespace octet::dist
