// The collectives of the MPI communicator against a CPU reference: every rank can compute every
// rank's inputs (they come from the rank number), so each checks the reduced values itself.
#include "octet/dist/communicator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "octet/ops/quantize.h"
#include "octet/train/data_parallel.h"
#include "test_util.h"
#include "world_seed.h"

namespace octet::dist {
namespace {

std::shared_ptr<Communicator> world() { return from_environment(); }

/// Skips a test that needs several ranks when run alone.
#define REQUIRE_RANKS()                                                            \
  do {                                                                             \
    if (world()->size() < 2) GTEST_SKIP() << "needs mpirun -np 2 (or more) ranks"; \
  } while (false)

/// Rank r's input: `n` values from a generator seeded by (seed, r). Small integers when
/// `integers` (sums of them are exact in f32 in any order), else normal floats.
std::vector<float> input_of(int rank, int64_t n, uint64_t seed, bool integers) {
  std::mt19937_64 gen(seed * 1000003u + static_cast<uint64_t>(rank));
  std::vector<float> v(static_cast<size_t>(n));
  std::uniform_int_distribution<int> small(-100, 100);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (float& x : v) x = integers ? static_cast<float>(small(gen)) : normal(gen);
  return v;
}

/// Splits `flat` into tensors of `sizes` (awkward on purpose), in order.
std::vector<Tensor> split(const std::vector<float>& flat, const std::vector<int64_t>& sizes) {
  std::vector<Tensor> out;
  int64_t at = 0;
  for (int64_t n : sizes) {
    std::vector<float> part(flat.begin() + at, flat.begin() + at + n);
    out.push_back(Tensor::from_vector(part, {n}));
    at += n;
  }
  return out;
}

std::vector<float> joined(const std::vector<Tensor>& tensors) {
  std::vector<float> out;
  for (const Tensor& t : tensors) {
    const std::vector<float> v = testing::to_floats(t);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

/// True on every rank when `values` are bitwise rank 0's.
bool same_on_every_rank(Communicator& comm, const std::vector<float>& values) {
  Tensor root = Tensor::from_vector(values, {static_cast<int64_t>(values.size())});
  comm.broadcast(std::span(&root, 1), 0);
  Tensor differs = Tensor::from_vector(
      {std::memcmp(root.raw_data(), values.data(), values.size() * sizeof(float)) == 0 ? 0.f : 1.f},
      {1});
  comm.all_reduce(std::span(&differs, 1), ReduceOp::max);
  return testing::to_floats(differs)[0] == 0.0f;
}

TEST(DistCommunicator, FromEnvironmentMatchesTheLauncher) {
  const auto comm = world();
  EXPECT_EQ(comm->size(), launcher_world_size());
  EXPECT_GE(comm->rank(), 0);
  EXPECT_LT(comm->rank(), comm->size());
  EXPECT_EQ(from_environment().get() == comm.get(), comm->size() > 1) << "one MPI world";
}

TEST(DistCommunicator, SumOfSmallIntegersIsExactAcrossAwkwardlySplitTensors) {
  REQUIRE_RANKS();
  auto comm = world();
  // The ranks split the same flat buffer differently: the reduction is over the flat buffer in
  // the given order, not tensor by tensor.
  const std::vector<int64_t> sizes = comm->rank() % 2 == 0 ? std::vector<int64_t>{3, 1481, 1, 677}
                                                           : std::vector<int64_t>{677, 1, 1481, 3};
  const int64_t n = 3 + 1481 + 1 + 677;
  const uint64_t seed = testing::world_seed(*comm);
  std::vector<Tensor> tensors = split(input_of(comm->rank(), n, seed, true), sizes);
  comm->all_reduce(tensors, ReduceOp::sum);
  std::vector<float> reference(static_cast<size_t>(n), 0.0f);
  for (int r = 0; r < comm->size(); ++r) {
    const std::vector<float> in = input_of(r, n, seed, true);
    for (size_t i = 0; i < reference.size(); ++i) reference[i] += in[i];
  }
  EXPECT_EQ(joined(tensors), reference);
  EXPECT_TRUE(same_on_every_rank(*comm, joined(tensors)));
}

TEST(DistCommunicator, SumOfFloatsIsCloseAndBitwiseTheSameOnEveryRank) {
  REQUIRE_RANKS();
  auto comm = world();
  const int64_t n = 2333;
  const uint64_t seed = testing::world_seed(*comm);
  std::vector<Tensor> tensors = split(input_of(comm->rank(), n, seed, false), {n});
  comm->all_reduce(tensors, ReduceOp::sum);
  std::vector<double> reference(static_cast<size_t>(n), 0.0);
  for (int r = 0; r < comm->size(); ++r) {
    const std::vector<float> in = input_of(r, n, seed, false);
    for (size_t i = 0; i < reference.size(); ++i) reference[i] += in[i];
  }
  const std::vector<float> got = joined(tensors);
  // f32 sums of `size` terms in some order: within size ulps of the double sum's magnitude.
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], reference[i], comm->size() * 1.2e-7 * 3.0 * 8.0) << "element " << i;
  EXPECT_TRUE(same_on_every_rank(*comm, got)) << "a sum must not differ between replicas";
}

TEST(DistCommunicator, MaxIsExact) {
  REQUIRE_RANKS();
  auto comm = world();
  const int64_t n = 1001;
  const uint64_t seed = testing::world_seed(*comm);
  std::vector<Tensor> tensors = split(input_of(comm->rank(), n, seed, false), {1, 999, 1});
  comm->all_reduce(tensors, ReduceOp::max);
  std::vector<float> reference = input_of(0, n, seed, false);
  for (int r = 1; r < comm->size(); ++r) {
    const std::vector<float> in = input_of(r, n, seed, false);
    for (size_t i = 0; i < reference.size(); ++i) reference[i] = std::max(reference[i], in[i]);
  }
  EXPECT_EQ(joined(tensors), reference);
}

TEST(DistCommunicator, MaxKeepsANaNFromAnyRank) {
  REQUIRE_RANKS();
  auto comm = world();
  // Element r is NaN on rank r only, the last element +inf on the last rank only: a MAX written
  // as (a > b ? a : b) drops a NaN on one side of the comparison.
  const int n = comm->size();
  std::vector<float> mine(static_cast<size_t>(n) + 1, 1.0f + static_cast<float>(comm->rank()));
  mine[static_cast<size_t>(comm->rank())] = std::numeric_limits<float>::quiet_NaN();
  if (comm->rank() == n - 1) mine[static_cast<size_t>(n)] = std::numeric_limits<float>::infinity();
  Tensor t = Tensor::from_vector(mine, {n + 1});
  comm->all_reduce(std::span(&t, 1), ReduceOp::max);
  const std::vector<float> got = testing::to_floats(t);
  for (int i = 0; i < n; ++i)
    EXPECT_TRUE(std::isnan(got[static_cast<size_t>(i)])) << "element " << i;
  EXPECT_EQ(got[static_cast<size_t>(n)], std::numeric_limits<float>::infinity());
}

TEST(DistCommunicator, BroadcastCopiesTheRootsBytesOfAnyDtype) {
  REQUIRE_RANKS();
  auto comm = world();
  const int root = comm->size() - 1;
  const uint64_t seed = testing::world_seed(*comm);
  Tensor ints = Tensor::empty({5}, DType::i64);
  for (int i = 0; i < 5; ++i) ints.data<int64_t>()[i] = 1000 * comm->rank() + i;
  Tensor floats = Tensor::from_vector(input_of(comm->rank(), 7, seed, false), {7});
  std::vector<Tensor> both{ints, floats};
  comm->broadcast(both, root);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(ints.data<int64_t>()[i], 1000 * root + i);
  EXPECT_EQ(testing::to_floats(floats), input_of(root, 7, seed, false));
  comm->barrier();
}

TEST(DistCommunicator, RejectsWhatItCannotReduce) {
  REQUIRE_RANKS();
  auto comm = world();
  Tensor ints = Tensor::zeros({2}, DType::i64);
  EXPECT_NE(
      testing::error_of([&] { comm->all_reduce(std::span(&ints, 1), ReduceOp::sum); }).find("f32"),
      std::string::npos);
  Tensor f = Tensor::zeros({1}, DType::f32);
  EXPECT_NE(testing::error_of([&] {
              comm->broadcast(std::span(&f, 1), comm->size());
            }).find("not a rank"),
            std::string::npos);
}

TEST(DistCommunicator, SingleProcessLeavesTensorsAsTheyAre) {
  SingleProcess one;
  Tensor t = Tensor::from_vector({1.5f, -2.0f}, {2});
  one.all_reduce(std::span(&t, 1), ReduceOp::sum);
  one.broadcast(std::span(&t, 1), 0);
  EXPECT_EQ(testing::to_floats(t), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(make_amax_reducer(std::make_shared<SingleProcess>()), nullptr);
}

TEST(DistAmaxReducer, ReducesEveryRowByMaxInRegistrationOrder) {
  REQUIRE_RANKS();
  auto comm = world();
  const auto reducer = make_amax_reducer(comm);
  ASSERT_NE(reducer, nullptr);
  // Rows as the registry passes them: forward rows of 2, backward rows of 1, mixed.
  const std::vector<int64_t> lengths{2, 1, 2, 2, 1};
  std::vector<Tensor> rows;
  auto value = [](int rank, size_t row, int64_t i) {
    // Row `row`'s maximum sits on a different rank for each row and element.
    return static_cast<float>(1 + row * 10 + i) * ((rank + row + i) % 2 == 0 ? 2.0f : 1.0f);
  };
  for (size_t k = 0; k < lengths.size(); ++k) {
    std::vector<float> v;
    for (int64_t i = 0; i < lengths[k]; ++i) v.push_back(value(comm->rank(), k, i));
    rows.push_back(Tensor::from_vector(v, {lengths[k]}));
  }
  reducer->all_reduce_max(rows);
  for (size_t k = 0; k < lengths.size(); ++k) {
    const std::vector<float> got = testing::to_floats(rows[k]);
    for (int64_t i = 0; i < lengths[k]; ++i) {
      float expected = 0;
      for (int r = 0; r < comm->size(); ++r) expected = std::max(expected, value(r, k, i));
      EXPECT_EQ(got[static_cast<size_t>(i)], expected) << "row " << k << " element " << i;
    }
  }
}

TEST(DistCommunicator, ShardRangesSplitEvenlyAndCoverTheBufferOnce) {
  for (const auto& [total, size] : {std::pair<int64_t, int>{10, 3}, {2, 4}, {0, 2}, {2333, 1}}) {
    int64_t next = 0;
    for (int r = 0; r < size; ++r) {
      const ShardRange shard = shard_range(total, size, r);
      EXPECT_EQ(shard.begin, next) << total << " over " << size << ", rank " << r;
      EXPECT_LE(shard.size(), (total + size - 1) / size);
      next = shard.end;
    }
    EXPECT_EQ(next, total);
  }
}

TEST(DistCommunicator, ReduceScatterLeavesEachShardBitwiseAsAllReduceDoes) {
  REQUIRE_RANKS();
  auto comm = world();
  const std::vector<int64_t> sizes{7, 1481, 1, 33};  // shard edges fall inside tensors
  const int64_t n = 7 + 1481 + 1 + 33;
  const uint64_t seed = testing::world_seed(*comm);
  std::vector<Tensor> reduced = split(input_of(comm->rank(), n, seed, false), sizes);
  std::vector<Tensor> scattered = split(input_of(comm->rank(), n, seed, false), sizes);
  comm->all_reduce(reduced, ReduceOp::sum);
  comm->reduce_scatter(scattered);
  const ShardRange mine = shard_range(n, comm->size(), comm->rank());
  const std::vector<float> want = joined(reduced), got = joined(scattered);
  for (int64_t i = mine.begin; i < mine.end; ++i)
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(float)), 0) << "element " << i;
}

TEST(DistCommunicator, AllGatherGivesEveryRankEveryShard) {
  REQUIRE_RANKS();
  auto comm = world();
  const std::vector<int64_t> sizes{1481, 5, 677};
  const int64_t n = 1481 + 5 + 677;
  const uint64_t seed = testing::world_seed(*comm);
  // The whole buffer as every rank must end with it; before the gather each rank holds only its
  // shard, and its own (different) values elsewhere.
  const std::vector<float> whole = input_of(comm->size(), n, seed, false);
  std::vector<float> mine = input_of(comm->rank(), n, seed, false);
  const ShardRange shard = shard_range(n, comm->size(), comm->rank());
  std::copy(whole.begin() + shard.begin, whole.begin() + shard.end, mine.begin() + shard.begin);
  std::vector<Tensor> tensors = split(mine, sizes);
  comm->all_gather(tensors);
  EXPECT_EQ(joined(tensors), whole);
  // Any dtype: bytes move, nothing is converted.
  Tensor ints = Tensor::empty({5}, DType::i64);
  for (int i = 0; i < 5; ++i) ints.data<int64_t>()[i] = 1000 * comm->rank() + i;
  comm->all_gather(std::span(&ints, 1));
  for (int i = 0; i < 5; ++i) {
    int owner = 0;
    while (shard_range(5, comm->size(), owner).end <= i) ++owner;
    EXPECT_EQ(ints.data<int64_t>()[i], 1000 * owner + i) << "element " << i;
  }
}

TEST(DistCommunicator, Bf16SumIsWithinItsRoundingBoundAndTheSameOnEveryRank) {
  REQUIRE_RANKS();
  auto comm = world();
  const int64_t n = 2333;
  const uint64_t seed = testing::world_seed(*comm);
  const std::vector<float> in = input_of(comm->rank(), n, seed, false);
  Tensor t = Tensor::empty({n}, DType::bf16);
  ops::cast(Tensor::from_vector(in, {n}), t);
  comm->all_reduce(std::span(&t, 1), ReduceOp::sum);
  const std::vector<float> got = testing::to_floats(t);
  // Each of the N terms is rounded to bf16 (8 significant bits: unit roundoff 2^-8), then each
  // of the N - 1 partial sums: at most (2N - 1) roundings of at most 2^-8 of the sum of |terms|.
  const double unit = std::ldexp(1.0, -8);
  std::vector<std::vector<float>> inputs;
  for (int r = 0; r < comm->size(); ++r) inputs.push_back(input_of(r, n, seed, false));
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    double exact = 0, magnitude = 0;
    for (const std::vector<float>& terms : inputs) {
      exact += terms[i];
      magnitude += std::abs(terms[i]);
    }
    worst = std::max(worst, std::abs(got[i] - exact) / magnitude);
    ASSERT_LE(std::abs(got[i] - exact), (2 * comm->size() - 1) * unit * magnitude)
        << "element " << i;
  }
  if (comm->rank() == 0) std::printf("bf16 sum: worst error %.3g of the sum of |terms|\n", worst);
  EXPECT_TRUE(same_on_every_rank(*comm, got)) << "a sum must not differ between replicas";
}

TEST(DistDataParallel, OptionsFingerprintSeesEveryField) {
  train::TrainOptions a, b;
  EXPECT_EQ(train::options_fingerprint(a), train::options_fingerprint(b));
  b.grad_bucket_mb = 24;  // the last field
  EXPECT_NE(train::options_fingerprint(a), train::options_fingerprint(b));
  b = a;
  b.device = "cuda";  // the first
  EXPECT_NE(train::options_fingerprint(a), train::options_fingerprint(b));
  b = a;
  b.lr = 3e-3 + 1e-12;  // doubles in full
  a.lr = 3e-3;
  EXPECT_NE(train::options_fingerprint(a), train::options_fingerprint(b));
}

TEST(DistDataParallel, MismatchedOptionsAndAnIndivisibleAccumFailOnEveryRank) {
  REQUIRE_RANKS();
  auto comm = world();
  train::DataParallel dp(comm);
  train::TrainOptions o;
  o.accum = comm->size();
  EXPECT_NO_THROW(dp.check_run(o));
  train::TrainOptions mine = o;
  if (comm->rank() == comm->size() - 1) mine.seed += 1;  // one rank differs
  try {
    dp.check_run(mine);
    ADD_FAILURE() << "mismatched options passed on rank " << comm->rank();
  } catch (const CollectiveError& e) {
    // Every rank names the one that differs, also the ranks whose own options match rank 0's.
    EXPECT_NE(e.message().find("not given the same options (rank " +
                               std::to_string(comm->size() - 1) + "'s differ from rank 0's)"),
              std::string::npos)
        << e.message();
  }
  o.accum = comm->size() + 1;
  try {
    dp.check_run(o);
    ADD_FAILURE() << "--accum " << o.accum << " passed on rank " << comm->rank();
  } catch (const CollectiveError& e) {
    EXPECT_NE(e.message().find("multiple of the world size"), std::string::npos) << e.message();
  }
}

}  // namespace
}  // namespace octet::dist
