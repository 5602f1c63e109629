// Gradient buckets (train/grad_buckets.h) over the mpirun ranks: the reductions started during
// the backward, a bucket per parameter, a few parameters a bucket, or one bucket, must train
// bitwise the same weights, moments and losses as the single collective after the backward
// (--grad-bucket-mb 0), in fp32 and bf16 reductions, with and without ZeRO-1, and every rank
// must end with the same bits.
#include <gtest/gtest.h>

#include <cstring>

#include "dp_run.h"
#include "world_seed.h"

namespace octet::train {
namespace {

struct BucketCase {
  std::string name;
  std::string model;      ///< "tiny" (GPT-2, tied head), "llama-1b", "moe-tiny", all shrunk
  std::string precision;  ///< fp8-delayed: amax all-reduces run while the buckets are in flight
  std::string reduce;     ///< --grad-reduce-dtype
  int64_t zero;
};

/// Bucket sizes in MiB: a byte (a bucket per parameter), about 20 KB (a few parameters of the
/// dim-32 model, the embedding alone), the default (one bucket, started by the last backward).
constexpr double kBucketMiB[] = {1e-9, 0.02, 25};

class GradBuckets : public ::testing::TestWithParam<BucketCase> {};

TEST_P(GradBuckets, TrainBitwiseAsTheSingleReductionOnEveryRank) {
  auto comm = dist::from_environment();
  if (comm->size() < 2) GTEST_SKIP() << "needs mpirun -np 2 (or more) ranks";
  if (comm->size() > 2) GTEST_SKIP() << "bitwise only for two ranks (grad_buckets.h)";
  const BucketCase& c = GetParam();
  TrainOptions o = tiny_options(c.precision, comm->size(), testing::world_seed(*comm));
  o.model = c.model;
  o = resolve_defaults(o);
  o.grad_reduce_dtype = c.reduce;
  o.zero = c.zero;
  o.grad_bucket_mb = 0;
  const auto run_with = [&](const TrainOptions& options, size_t* buckets) {
    DataParallel dp(comm);
    dp.check_run(options);
    dp.set_grad_reduce_dtype(options.grad_reduce_dtype);
    TrainedRun run = train_run(options, dp);
    *buckets = dp.bucket_count();
    return run;
  };
  size_t buckets = 0;
  const TrainedRun single = run_with(o, &buckets);
  size_t previous = 0;
  for (const double mib : kBucketMiB) {
    SCOPED_TRACE("--grad-bucket-mb " + std::to_string(mib));
    o.grad_bucket_mb = mib;
    const TrainedRun bucketed = run_with(o, &buckets);
    if (comm->rank() == 0)
      std::printf("[ %s ] --grad-bucket-mb %g: %zu bucket(s)\n", c.name.c_str(), mib, buckets);
    if (mib == kBucketMiB[0])
      EXPECT_EQ(buckets, single.state.params.size()) << "a bucket per parameter";
    else
      EXPECT_LT(buckets, previous) << "larger buckets, fewer of them";
    previous = buckets;
    ASSERT_EQ(bucketed.losses.size(), single.losses.size());
    for (size_t i = 0; i < single.losses.size(); ++i)
      EXPECT_EQ(std::memcmp(&bucketed.losses[i], &single.losses[i], sizeof(double)), 0)
          << "step " << i + 1 << ": " << bucketed.losses[i] << " vs " << single.losses[i];
    // Every tensor a checkpoint holds: weights, (gathered) moments, the FP8 state.
    ASSERT_EQ(bucketed.tensors.size(), single.tensors.size());
    for (size_t i = 0; i < single.tensors.size(); ++i)
      EXPECT_EQ(testing::to_bytes(bucketed.tensors[i].second),
                testing::to_bytes(single.tensors[i].second))
          << single.tensors[i].first;
    EXPECT_TRUE(same_on_every_rank(*comm, hash_of(bucketed.tensors, false)))
        << "weights or moments differ between ranks";
    EXPECT_TRUE(same_on_every_rank(*comm, hash_of(bucketed.tensors, true)))
        << "FP8 state differs between ranks";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Runs, GradBuckets,
    ::testing::Values(BucketCase{"fp32_reduce", "tiny", "fp8-delayed", "fp32", 0},
                      BucketCase{"bf16_reduce", "tiny", "fp8-delayed", "bf16", 0},
                      BucketCase{"fp32_reduce_zero1", "tiny", "fp8-delayed", "fp32", 1},
                      BucketCase{"bf16_reduce_zero1", "tiny", "fp8-delayed", "bf16", 1},
                      BucketCase{"llama_untied_head", "llama-1b", "bf16", "fp32", 0},
                      BucketCase{"moe", "moe-tiny", "fp8-current", "bf16", 1}),
    [](const auto& info) { return info.param.name; });

TEST(DistGradBuckets, ANegativeSizeFailsOnEveryRankWithTheFix) {
  auto comm = dist::from_environment();
  DataParallel dp(comm);
  TrainOptions o;
  o.accum = comm->size();
  o.grad_bucket_mb = -1;
  const std::string e = testing::error_of([&] { dp.check_run(o); });
  EXPECT_NE(e.find("--grad-bucket-mb takes a bucket size in MiB, 0 or more (0: one bucket after "
                   "the backward), got -1"),
            std::string::npos)
      << e;
}

}  // namespace
}  // namespace octet::train
