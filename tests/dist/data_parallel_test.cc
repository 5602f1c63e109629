// Data-parallel training against one process: the tiny model trained a few steps by N ranks
// with --accum 2N (two microbatches per rank) and, in each rank's own process, by one process
// with the same --accum, which reads the same microbatches (data_parallel.h). The step is the
// one `octet train` runs (train_step).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "dp_run.h"
#include "octet/dist/communicator.h"
#include "octet/train/train_step.h"
#include "test_util.h"
#include "world_seed.h"

namespace octet::train {
namespace {

struct Tolerance {
  double loss;    ///< relative, per step
  double weight;  ///< relative L2 of all parameters together after the last step
};

// Why these tolerances. Measured on 2 ranks, 4 steps, over two seeds (a fixed 4242 and the
// tests' own): bf16 losses within 1e-6 and weights 2.2e-4 (relative L2); fp8-delayed losses
// within 1.0e-4 and weights 8.3e-3; fp8-current, -block and -mxfp8 losses within 7e-8 and
// weights 6e-9. A run that lost half the batch moves the losses by 4e-3 to 1.6e-2 and the weights
// by 3.6e-2 to 5.0e-2, which ALostRanksGradientWouldBeCaught demands stay outside.
// bf16: the same microbatches and the same FP32 gradient terms, summed in another order (per
// rank, then across ranks, instead of each backward adding to the previous one's sums), so
// only FP32 rounding differs. The loss sees that directly (1e-5). The weights see it through
// AdamW, whose update is about lr whatever a gradient's size: the attention's key bias has a
// zero gradient in exact arithmetic (softmax ignores a constant shift), so its gradient is
// rounding noise that AdamW turns into updates of up to lr (measured: up to 0.3 lr), and the
// next steps carry that on: hence 2e-3, not 1e-6.
// fp8-delayed: each microbatch's FP8 casts take their scales from the amax history, which under
// DP holds one reduced row per rank and pass instead of one row per microbatch, and a rank's
// first microbatch is cast before its partner's amax arrives; so some casts quantize with other
// scales (an E4M3 step is 6-12% of a value): FP8 noise, not an error, hence the looser bounds.
// The other FP8 recipes scale each cast from its own tensor, with no history: bf16's bounds.
Tolerance tolerance_for(const std::string& precision) {
  return precision == "fp8-delayed" ? Tolerance{5e-4, 2e-2} : Tolerance{1e-5, 2e-3};
}

class DataParallelTraining : public ::testing::TestWithParam<std::string> {};

TEST_P(DataParallelTraining, EqualsOneProcessWithTheSameGlobalBatch) {
  auto comm = dist::from_environment();
  if (comm->size() < 2) GTEST_SKIP() << "needs mpirun -np 2 (or more) ranks";
  const std::string precision = GetParam();
  const TrainOptions o = tiny_options(precision, comm->size(), testing::world_seed(*comm));

  DataParallel dp(comm);
  dp.check_run(o);
  const TrainedRun parallel = train_run(o, dp);
  DataParallel single;  // this process alone, all 2N microbatches
  const TrainedRun alone = train_run(o, single);

  const Tolerance tol = tolerance_for(precision);
  ASSERT_EQ(parallel.losses.size(), alone.losses.size());
  double worst = 0;
  for (size_t i = 0; i < alone.losses.size(); ++i) {
    worst = std::max(worst, std::abs(parallel.losses[i] - alone.losses[i]) / alone.losses[i]);
    EXPECT_NEAR(parallel.losses[i], alone.losses[i], tol.loss * std::abs(alone.losses[i]))
        << "step " << i + 1;
  }
  const double rel = param_relative_l2(parallel, alone);
  EXPECT_LE(rel, tol.weight);
  if (comm->rank() == 0)
    std::printf("[ %s ] %d ranks vs 1 process: losses within %.3g relative, weights %.3g\n",
                precision.c_str(), comm->size(), worst, rel);

  // The replicas are identical: weights and AdamW moments, and every byte of the FP8 state.
  EXPECT_TRUE(same_on_every_rank(*comm, hash_of(parallel.tensors, false)))
      << "weights or moments differ between ranks";
  EXPECT_TRUE(same_on_every_rank(*comm, hash_of(parallel.tensors, true)))
      << "FP8 state differs between ranks";
  for (double loss : parallel.losses) {
    uint64_t bits;
    std::memcpy(&bits, &loss, sizeof bits);
    EXPECT_TRUE(same_on_every_rank(*comm, bits)) << "the reported loss differs between ranks";
  }
}

TEST_P(DataParallelTraining, ALostRanksGradientWouldBeCaught) {
  // The tolerances above are a claim only if a wrong reduction breaks them: one process trained
  // on half the global batch (about what a rank that reduced nothing trains on) must miss them.
  auto comm = dist::from_environment();
  if (comm->size() < 2) GTEST_SKIP() << "needs mpirun -np 2 (or more) ranks";
  const TrainOptions o = tiny_options(GetParam(), comm->size(), testing::world_seed(*comm));
  TrainOptions half = o;
  half.accum = kMicrobatchesPerRank;
  DataParallel single;
  const TrainedRun full = train_run(o, single), partial = train_run(half, single);
  double worst = 0;
  for (size_t i = 1; i < full.losses.size(); ++i)
    worst = std::max(worst, std::abs(full.losses[i] - partial.losses[i]) / full.losses[i]);
  const Tolerance tol = tolerance_for(GetParam());
  const double rel = param_relative_l2(partial, full);
  if (comm->rank() == 0)
    std::printf("[ %s ] half the batch: losses off by %.3g relative, weights by %.3g\n",
                GetParam().c_str(), worst, rel);
  EXPECT_GT(worst, tol.loss) << "the loss tolerance would not see a lost rank";
  EXPECT_GT(rel, tol.weight) << "the weight tolerance would not see a lost rank";
}

TEST(DistDataParallelSkips, OneRanksNonFiniteAmaxSkipsTheStepOnEveryRank) {
  auto comm = dist::from_environment();
  if (comm->size() < 2) GTEST_SKIP() << "needs mpirun -np 2 (or more) ranks";
  TrainOptions o = tiny_options("fp8-delayed", comm->size(), testing::world_seed(*comm));
  o.steps = 3;
  // One rank alone gets a NaN input amax in its first microbatch of step 2: the MAX over the
  // ranks must keep it, whichever side of the comparison it lands on (each rank in turn), so
  // every rank sees a non-finite amax, skips the step and puts its FP8 state back.
  for (int bad = 0; bad < comm->size(); ++bad) {
    SCOPED_TRACE("NaN on rank " + std::to_string(bad));
    TrainOptions mine = o;
    if (comm->rank() == bad)
      mine.inject = "nan-amax@2:" + std::to_string(bad * kMicrobatchesPerRank);
    DataParallel dp(comm);
    auto [data, s] = start_run(o, dp);
    StepChecks checks(*s.model, s.params, mine);
    for (int64_t step = 1; step <= o.steps; ++step) {
      const StepResult r = train_step(s, *data, mine, checks, dp);
      EXPECT_EQ(r.verdict.skip, step == 2 ? SkipReason::nonfinite_amax : SkipReason::none)
          << "step " << step << " on rank " << comm->rank();
    }
    const auto tensors = checkpoint_tensors(s);
    EXPECT_TRUE(same_on_every_rank(*comm, hash_of(tensors, false)));
    EXPECT_TRUE(same_on_every_rank(*comm, hash_of(tensors, true))) << "FP8 state differs";
  }
}

INSTANTIATE_TEST_SUITE_P(Precisions, DataParallelTraining,
                         ::testing::Values("bf16", "fp8-delayed", "fp8-current", "fp8-block",
                                           "fp8-mxfp8"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n)
                             if (c == '-') c = '_';
                           return n;
                         });

}  // namespace
}  // namespace octet::train
