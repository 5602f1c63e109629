// ZeRO-1 (train/zero.h) against data parallelism without it: the same ranks, the same steps, the
// AdamW moments sharded. The gradients are all-reduced whole either way and AdamW is elementwise,
// so losses, weights and moments must be equal bit for bit, not within a tolerance.
#include <gtest/gtest.h>

#include <cstring>

#include "dp_run.h"
#include "octet/train/zero.h"
#include "world_seed.h"

namespace octet::train {
namespace {

class ZeroTraining : public ::testing::TestWithParam<std::string> {};

TEST_P(ZeroTraining, EqualsDataParallelWithoutZeroBitwise) {
  auto comm = dist::from_environment();
  if (comm->size() < 2) GTEST_SKIP() << "needs mpirun -np 2 (or more) ranks";
  TrainOptions o = tiny_options(GetParam(), comm->size(), testing::world_seed(*comm));
  DataParallel dp(comm);
  const TrainedRun plain = train_run(o, dp);
  o.zero = 1;
  const TrainedRun sharded = train_run(o, dp);

  ASSERT_EQ(sharded.losses.size(), plain.losses.size());
  for (size_t i = 0; i < plain.losses.size(); ++i)
    EXPECT_EQ(std::memcmp(&sharded.losses[i], &plain.losses[i], sizeof(double)), 0)
        << "step " << i + 1 << ": " << sharded.losses[i] << " vs " << plain.losses[i];
  // Every tensor a checkpoint holds: parameters, the (gathered) moments, the FP8 state, except
  // the forward amax histories: without ZeRO the optimizer writes the next step's weight cast and
  // records its amax at the end of the step; under ZeRO the next forward's recast records the
  // same amax later, so the histories after the last step differ in that pending entry (the
  // losses above, which every scale feeds, are bitwise equal).
  ASSERT_EQ(sharded.tensors.size(), plain.tensors.size());
  for (size_t i = 0; i < plain.tensors.size(); ++i) {
    const auto& [name, want] = plain.tensors[i];
    ASSERT_EQ(sharded.tensors[i].first, name);
    if (name.ends_with(".fwd.amax_history")) continue;
    EXPECT_EQ(testing::to_bytes(sharded.tensors[i].second), testing::to_bytes(want)) << name;
  }
  EXPECT_TRUE(same_on_every_rank(*comm, hash_of(sharded.tensors, false)))
      << "weights or moments differ between ranks";
}

INSTANTIATE_TEST_SUITE_P(Precisions, ZeroTraining,
                         ::testing::Values("bf16", "fp8-delayed", "fp8-current"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n)
                             if (c == '-') c = '_';
                           return n;
                         });

TEST(DistZero, EachRankHoldsItsShareOfTheMomentBytes) {
  auto comm = dist::from_environment();
  const TrainOptions o = tiny_options("bf16", comm->size(), testing::world_seed(*comm));
  auto data = make_token_source("builtin", o.seed);
  const ModelConfig config = resolve_model_config(o, data->vocab_size());
  TrainState s = make_train_state(config, Precision::from_name(o.precision), Device::cpu(), o.seed,
                                  false);
  int64_t full_bytes = 0;
  for (size_t i = 0; i < s.params.size(); ++i)
    full_bytes += static_cast<int64_t>(s.adam_m[i].nbytes() + s.adam_v[i].nbytes());
  ZeroOptimizer zero(comm, s, o.weight_decay);
  for (const Tensor& m : s.adam_m) EXPECT_FALSE(m.defined()) << "the whole moments are released";
  // Two f32 moments per element of the shard; the shards are ceil(P / N) elements (the last
  // one shorter), so N ranks together hold the moments exactly once.
  const int64_t parameters = config.parameter_count();
  EXPECT_EQ(full_bytes, 8 * parameters);
  EXPECT_EQ(zero.moment_bytes(), 8 * zero.shard().size());
  EXPECT_LE(zero.moment_bytes(), 8 * ((parameters + comm->size() - 1) / comm->size()));
  Tensor total = Tensor::from_vector({static_cast<float>(zero.shard().size())}, {1});
  comm->all_reduce(std::span(&total, 1), dist::ReduceOp::sum);  // exact: an integer < 2^24
  EXPECT_EQ(static_cast<int64_t>(testing::to_floats(total)[0]), parameters);
  if (comm->rank() == 0)
    std::printf("ZeRO-1 over %d rank(s): AdamW moments %lld of %lld bytes per rank\n",
                comm->size(), (long long)zero.moment_bytes(), (long long)full_bytes);
  // A checkpoint asks for whole moments: refused until they are gathered.
  EXPECT_NE(testing::error_of([&] { checkpoint_tensors(s); }).find("gather them first"),
            std::string::npos);
  zero.gather_moments(s);
  EXPECT_EQ(checkpoint_tensors(s).size(), 3 * s.params.size());
}

}  // namespace
}  // namespace octet::train
