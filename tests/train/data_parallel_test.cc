// Data parallelism's single-process contract (octet_dist_tests runs the multi-rank one under
// mpirun): which rank computes which microbatch, the world of one, and the launch checks.
#include "octet/train/data_parallel.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "octet/dist/communicator.h"
#include "test_util.h"

namespace octet::train {
namespace {

/// A group member that only knows its rank and size: for the arithmetic that needs no messages.
class FakeRank final : public dist::Communicator {
 public:
  FakeRank(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string describe() const override { return "fake"; }
  void all_reduce(std::span<const Tensor>, dist::ReduceOp) override {}
  void reduce_scatter(std::span<const Tensor>) override {}
  void all_gather(std::span<const Tensor>) override {}
  void broadcast(std::span<const Tensor>, int) override {}
  void barrier() override {}

 private:
  int rank_, size_;
};

TEST(DataParallel, EveryMicrobatchBelongsToOneRankInContiguousBlocks) {
  for (int size : {1, 2, 3, 4}) {
    for (int64_t per_rank : {1, 2, 5}) {
      const int64_t accum = per_rank * size;
      std::vector<int> owner(static_cast<size_t>(accum), -1);
      for (int r = 0; r < size; ++r) {
        DataParallel dp(std::make_shared<FakeRank>(r, size));
        for (int64_t m = 0; m < accum; ++m) {
          if (!dp.owns(m, accum)) continue;
          EXPECT_EQ(owner[static_cast<size_t>(m)], -1) << "microbatch " << m << " owned twice";
          owner[static_cast<size_t>(m)] = r;
        }
      }
      // Rank r has [r * per_rank, (r + 1) * per_rank): one process's order, cut into N blocks.
      for (int64_t m = 0; m < accum; ++m)
        EXPECT_EQ(owner[static_cast<size_t>(m)], m / per_rank)
            << "size " << size << ", accum " << accum << ", microbatch " << m;
    }
  }
}

TEST(DataParallel, AWorldOfOneReducesNothing) {
  DataParallel one;
  EXPECT_FALSE(one.active());
  EXPECT_TRUE(one.is_root());
  EXPECT_EQ(one.amax_reducer(), nullptr);
  TrainOptions o;
  o.accum = 3;
  o.guard = true;
  EXPECT_NO_THROW(one.check_run(o)) << "one process takes any accum and the guard";
  Tensor g = Tensor::from_vector({1.5f, -2.0f}, {2});
  EXPECT_EQ(one.reduce_gradients(std::span(&g, 1), 7.25), 7.25);
  EXPECT_EQ(testing::to_floats(g), (std::vector<float>{1.5f, -2.0f}));
  StepVerdict v;
  v.skip = SkipReason::nonfinite_grad;
  one.agree(v);
  EXPECT_EQ(v.skip, SkipReason::nonfinite_grad);
}

TEST(DataParallel, TheGuardIsRefusedWithSeveralRanks) {
  DataParallel dp(std::make_shared<FakeRank>(0, 2));  // its collectives leave the values alone
  TrainOptions o;
  o.accum = 2;
  EXPECT_NO_THROW(dp.check_run(o));
  o.guard = true;
  EXPECT_NE(testing::error_of([&] { dp.check_run(o); }).find("--guard is not supported"),
            std::string::npos);
}

/// Sets an environment variable for a scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_.empty())
      unsetenv(name_);
    else
      setenv(name_, old_.c_str(), 1);
  }

 private:
  const char* name_;
  std::string old_;
};

TEST(DataParallel, TheLaunchersWorldSizeComesFromItsEnvironment) {
  if (dist::launcher_world_size() != 1) GTEST_SKIP() << "running under a launcher";
  {
    const ScopedEnv env("PMI_SIZE", "3");
    EXPECT_EQ(dist::launcher_world_size(), 3);
  }
  EXPECT_EQ(dist::launcher_world_size(), 1);
}

TEST(DataParallel, ABuildWithoutMpiRefusesAMultiProcessLaunch) {
  if (dist::built_with_mpi()) GTEST_SKIP() << "this build has MPI (the CI sanitizer build has not)";
  const ScopedEnv env("OMPI_COMM_WORLD_SIZE", "2");
  EXPECT_NE(testing::error_of([] { dist::from_environment(); }).find("built without MPI"),
            std::string::npos);
}

}  // namespace
}  // namespace octet::train
