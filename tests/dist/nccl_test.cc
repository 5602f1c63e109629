// The NCCL communicator over the mpirun ranks, one GPU each (rank r on cuda:r), its id shared
// over MPI: sums bitwise equal on every rank, MAX keeping a NaN, reduce_scatter as all_reduce's
// shard, all_gather; the gradient buckets' sums on the side stream (one GPU suffices: a 1-rank
// communicator), and bucketed training bitwise as the single reduction. Skips without NCCL in
// the build or without a GPU per rank.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "dp_run.h"
#include "octet/dist/nccl.h"
#include "octet/ops/gemm.h"
#include "octet/train/grad_buckets.h"
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

/// The NCCL communicator of this process's GPU: over the mpirun ranks (a GPU each), or of one
/// rank on cuda:0 without mpirun. Null (with the reason) when the machine cannot run it.
std::shared_ptr<Communicator> nccl_world(Communicator& world, std::string* why) {
  if (!built_with_nccl()) *why = "built without NCCL";
  else if (cuda_device_count() < world.size()) *why = "needs a GPU per rank";
  if (!why->empty()) return nullptr;
  const Device gpu = Device::cuda(world.rank());
  if (world.size() > 1) return from_environment(gpu);
  return make_nccl_communicator(gpu, 0, 1, [](UniqueIdBytes&) {});
}

TEST(DistNccl, BucketSumsRunAfterTheirWritesAndBeforeTheirReads) {
  auto world = from_environment();
  std::string why;
  auto nccl = nccl_world(*world, &why);
  if (!nccl) GTEST_SKIP() << why;
  const Device gpu = Device::cuda(world->rank());
  const uint64_t seed = testing::world_seed(*world);
  // Awkward sizes, a bucket of a few parameters, one oversized; small integers: exact sums.
  const std::vector<int64_t> sizes = {1481, 3, 677, 5000, 64, 2333};
  const int size = world->size();
  for (const DType wire : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(wire));
    std::vector<Tensor> grads, late;
    std::vector<std::vector<float>> want;
    for (size_t i = 0; i < sizes.size(); ++i) {
      want.emplace_back(static_cast<size_t>(sizes[i]), 0.0f);
      for (int r = 0; r < size; ++r) {
        const Tensor t = testing::random_int_tensor({sizes[i]}, DType::f32, seed + 7 * i + r, 50);
        const std::vector<float> v = testing::to_floats(t);
        for (size_t j = 0; j < v.size(); ++j) want[i][j] += v[j];
        if (r == world->rank()) late.push_back(t.to(gpu));
      }
      grads.push_back(Tensor::zeros({sizes[i]}, DType::f32, gpu));
    }
    train::GradBucketReducer reducer(nccl, grads, 2000 * 4, wire);
    ASSERT_GE(reducer.buckets().size(), 3u);
    // As a backward would: slow work on the device's stream, then the gradients written, then
    // their bucket started; the side stream must wait for the writes, not race the GEMMs.
    const Tensor a = Tensor::zeros({4096, 4096}, DType::bf16, gpu);
    const Tensor c = Tensor::empty({4096, 4096}, DType::bf16, gpu);
    for (size_t i = grads.size(); i-- > 0;) {
      for (int k = 0; k < 4; ++k)
        ops::gemm(ops::GemmOperand::dense(a), ops::GemmOperand::dense(a), c);
      grads[i].copy_from(late[i]);
      reducer.gradients_ready(i);
    }
    reducer.finish();
    for (size_t i = 0; i < grads.size(); ++i)
      EXPECT_EQ(testing::to_floats(grads[i]), want[i]) << "parameter " << i;
    // The device's stream ordered after the sums: a second step reads what the first wrote.
    for (size_t i = grads.size(); i-- > 0;) reducer.gradients_ready(i);
    reducer.finish();
    for (size_t i = 0; i < grads.size(); ++i) {
      std::vector<float> twice = want[i];
      for (float& v : twice) v *= static_cast<float>(size);
      EXPECT_EQ(testing::to_floats(grads[i]), twice) << "parameter " << i << ", second step";
    }
  }
}

TEST(DistNccl, BucketedTrainingOnGpusIsBitwiseTheSingleReduction) {
  auto world = from_environment();
  if (world->size() != 2) GTEST_SKIP() << "needs mpirun -np 2 (bitwise for two ranks)";
  std::string why;
  auto nccl = nccl_world(*world, &why);
  if (!nccl) GTEST_SKIP() << why;
  const Device gpu = Device::cuda(world->rank());
  for (const std::string reduce : {"fp32", "bf16"}) {
    SCOPED_TRACE(reduce);
    train::TrainOptions o =
        train::tiny_options("fp8-delayed", world->size(), testing::world_seed(*world));
    o.device = gpu.str();
    o.grad_reduce_dtype = reduce;
    std::vector<train::TrainedRun> runs;
    for (const double mib : {0.0, 1e-9, 0.02}) {
      o.grad_bucket_mb = mib;
      train::DataParallel dp(nccl);
      dp.set_grad_reduce_dtype(reduce);
      runs.push_back(train::train_run(o, dp, gpu));
    }
    for (size_t k = 1; k < runs.size(); ++k) {
      EXPECT_EQ(runs[k].losses, runs[0].losses) << "run " << k;
      EXPECT_EQ(train::hash_of(runs[k].tensors, false), train::hash_of(runs[0].tensors, false));
      EXPECT_EQ(train::hash_of(runs[k].tensors, true), train::hash_of(runs[0].tensors, true));
      EXPECT_TRUE(train::same_on_every_rank(*world, train::hash_of(runs[k].tensors, false)));
    }
  }
}

}  // namespace
}  // namespace octet::dist
