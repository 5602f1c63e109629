// ZeRO-1 (train/zero.h) against data parallelism without it: the same ranks, the same steps, the
// AdamW moments and the masters sharded. The gradients are all-reduced whole either way and AdamW
// is elementwise, so losses, weights, moments and FP8 states must be equal bit for bit, not
// within a tolerance.
#include "octet/train/zero.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "dp_run.h"
#include "world_seed.h"

namespace octet::train {
namespace {

class ZeroTraining : public ::testing::TestWithParam<std::string> {};

void expect_same_stats(const nn::CastStats& got, const nn::CastStats& want, const std::string& m) {
  EXPECT_TRUE(got.measured) << m;
  EXPECT_EQ(got.measured, want.measured) << m;
  EXPECT_EQ(std::memcmp(&got.amax, &want.amax, sizeof(float)), 0) << m;
  EXPECT_EQ(std::memcmp(&got.scale, &want.scale, sizeof(float)), 0) << m;
  EXPECT_EQ(got.saturated_fraction, want.saturated_fraction) << m;
  EXPECT_EQ(got.underflow_fraction, want.underflow_fraction) << m;
}

TEST_P(ZeroTraining, EqualsDataParallelWithoutZeroBitwise) {
  auto comm = dist::from_environment();
  if (comm->size() < 2) GTEST_SKIP() << "needs mpirun -np 2 (or more) ranks";
  // "<precision>+moe": every layer an MoE layer of 4 experts, top 2 (experts may get no rows).
  // "<precision>+skip": a NaN gradient skips step 3, when the masters are already apart: the
  // ranks without a master keep the cast they hold, the owner recasts the same bytes.
  const std::string param = GetParam();
  TrainOptions o =
      tiny_options(param.substr(0, param.find('+')), comm->size(), testing::world_seed(*comm));
  if (param.ends_with("+moe")) {
    o.experts = 4;
    o.topk = 2;
  }
  if (param.ends_with("+skip")) o.inject = "nan-grad@3/0";
  DataParallel dp(comm);
  const TrainedRun plain = train_run(o, dp);
  o.zero = 1;
  const TrainedRun sharded = train_run(o, dp);

  EXPECT_EQ(plain.skipped, o.inject.empty() ? 0 : 1);
  EXPECT_EQ(sharded.skipped, plain.skipped);
  ASSERT_EQ(sharded.losses.size(), plain.losses.size());
  for (size_t i = 0; i < plain.losses.size(); ++i)
    EXPECT_EQ(std::memcmp(&sharded.losses[i], &plain.losses[i], sizeof(double)), 0)
        << "step " << i + 1 << ": " << sharded.losses[i] << " vs " << plain.losses[i];
  // Every tensor a checkpoint holds: parameters and moments (gathered from their owners) and the
  // FP8 state, amax histories included: the owner writes a weight's next cast and records its
  // amax with the update, as the optimizer does without ZeRO, and sends both.
  ASSERT_EQ(sharded.tensors.size(), plain.tensors.size());
  for (size_t i = 0; i < plain.tensors.size(); ++i) {
    const auto& [name, want] = plain.tensors[i];
    ASSERT_EQ(sharded.tensors[i].first, name);
    EXPECT_EQ(testing::to_bytes(sharded.tensors[i].second), testing::to_bytes(want)) << name;
  }
  EXPECT_TRUE(same_on_every_rank(*comm, hash_of(sharded.tensors, false)))
      << "weights or moments differ between ranks";
  EXPECT_TRUE(same_on_every_rank(*comm, hash_of(sharded.tensors, true)))
      << "FP8 states differ between ranks";
  // Each weight's cast statistics, measured on the rank that keeps its master, reach every rank.
  ASSERT_EQ(sharded.fp8_stats.size(), plain.fp8_stats.size());
  for (size_t m = 0; m < plain.fp8_stats.size(); ++m)
    expect_same_stats(sharded.fp8_stats[m].weight, plain.fp8_stats[m].weight,
                      plain.fp8_stats[m].name);
}

std::string param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = info.param;
  for (char& c : n)
    if (c == '-' || c == '+') c = '_';
  return n;
}

INSTANTIATE_TEST_SUITE_P(Precisions, ZeroTraining,
                         ::testing::Values("bf16", "fp8-delayed", "fp8-current", "bf16+moe",
                                           "fp8-delayed+moe", "bf16+skip", "fp8-delayed+skip"),
                         param_name);

// An MoE expert that got rows on some ranks only: with 16 experts, top 1 and 16 tokens a rank,
// some expert of the first step is empty on exactly one rank (the test checks it: all experts
// agreeing has odds of about 1e-9). The FP8 amax reduction must still reduce the same rows on
// every rank (data parallelism without ZeRO ended in MPI_ERR_TRUNCATE here before the ranks
// agreed on the states to finalize), and ZeRO-1, whose ranks then prepare different casts, must
// send the same tensors from every rank and stay bitwise the run without it.
TEST(DistZero, ExpertsThatOnlySomeRanksRanStayBitwiseTheRunWithoutZero) {
  auto comm = dist::from_environment();
  if (comm->size() < 2) GTEST_SKIP() << "needs mpirun -np 2 (or more) ranks";
  TrainOptions o = tiny_options("fp8-delayed", comm->size(), testing::world_seed(*comm));
  o.experts = 16;
  o.topk = 1;
  o.batch = 1;
  o.accum = comm->size();  // one microbatch of 16 tokens a rank
  DataParallel dp(comm);
  {
    auto [data, s] = start_run(o, dp);
    StepChecks checks(*s.model, s.params, o);
    train_step(s, *data, o, checks, dp);
    std::vector<float> ran;  // per (layer, expert): 1 where this rank routed rows to it
    for (const MoeLayerStats& layer : s.model->moe_layer_stats())
      for (const int64_t tokens : layer.load.tokens) ran.push_back(tokens > 0 ? 1.0f : 0.0f);
    Tensor ranks_that_ran = Tensor::from_vector(ran, {static_cast<int64_t>(ran.size())});
    comm->all_reduce(std::span(&ranks_that_ran, 1), dist::ReduceOp::sum);
    const std::vector<float> count = testing::to_floats(ranks_that_ran);
    EXPECT_TRUE(std::any_of(count.begin(), count.end(), [&](float c) {
      return c > 0 && c < comm->size();
    })) << "no expert ran on some ranks only: the case under test did not arise";
  }
  const TrainedRun plain = train_run(o, dp);
  o.zero = 1;
  const TrainedRun sharded = train_run(o, dp);
  ASSERT_EQ(sharded.tensors.size(), plain.tensors.size());
  for (size_t i = 0; i < plain.tensors.size(); ++i)
    EXPECT_EQ(testing::to_bytes(sharded.tensors[i].second),
              testing::to_bytes(plain.tensors[i].second))
        << plain.tensors[i].first;
  EXPECT_TRUE(same_on_every_rank(*comm, hash_of(sharded.tensors, false)));
}

struct ZeroState {
  TrainOptions options;
  std::unique_ptr<TokenSource> data;
  TrainState state;
};

/// The tiny model's train state for `precision` with ZeRO-1 over `comm`.
ZeroState zero_state(const std::shared_ptr<dist::Communicator>& comm, const std::string& precision,
                     DataParallel& dp) {
  ZeroState z;
  z.options = tiny_options(precision, comm->size(), testing::world_seed(*comm));
  z.options.zero = 1;
  RunStart start = start_run(z.options, dp);
  z.data = std::move(start.data);
  z.state = std::move(start.state);
  return z;
}

TEST(DistZero, EachRankHoldsTheMomentsOfItsWholeTensorsAndAnEqualShareOfTheCost) {
  auto comm = dist::from_environment();
  DataParallel dp(comm);
  for (const std::string precision : {"bf16", "fp8-current"}) {
    SCOPED_TRACE(precision);
    ZeroState z = zero_state(comm, precision, dp);
    TrainState& s = z.state;
    const std::vector<ParamLayer> layers = s.model->param_layers();
    // bf16: the step writes the Linear weights' casts, so their masters will be apart (zero.h).
    const bool apart = precision == "bf16";
    int64_t parameters = 0, total_cost = 0, largest_cost = 0;
    for (size_t i = 0; i < s.params.size(); ++i) {
      EXPECT_EQ(s.adam_m[i].nbytes() + s.adam_v[i].nbytes(), 2 * s.params[i].value.nbytes());
      const int64_t n = s.params[i].value.numel();
      const int64_t cost = ZeroOptimizer::owner_cost(n, apart && layers[i].weight);
      EXPECT_EQ(cost, (apart && layers[i].weight ? 12 : 8) * n) << s.params[i].name;
      parameters += n;
      total_cost += cost;
      largest_cost = std::max(largest_cost, cost);
    }
    ZeroOptimizer zero(comm, s, z.options.weight_decay);
    int64_t owned = 0, cost = 0;
    for (size_t i = 0; i < s.params.size(); ++i) {
      const bool mine = zero.owner(i) == comm->rank();
      EXPECT_EQ(s.adam_m[i].defined(), mine) << s.params[i].name;
      EXPECT_EQ(s.adam_v[i].defined(), mine) << s.params[i].name;
      if (!mine) continue;
      owned += s.params[i].value.numel();
      cost += ZeroOptimizer::owner_cost(s.params[i].value.numel(), apart && layers[i].weight);
    }
    EXPECT_EQ(zero.moment_bytes(), 8 * owned);
    // Whole tensors, cut where the equal parts' boundaries fall through the middles of their
    // costs: each rank's cost is its part's give or take half a tensor's at either end.
    EXPECT_LE(std::abs(cost - dist::shard_range(total_cost, comm->size(), comm->rank()).size()),
              largest_cost);
    Tensor total = Tensor::from_vector({static_cast<float>(owned)}, {1});
    comm->all_reduce(std::span(&total, 1), dist::ReduceOp::sum);  // exact: an integer < 2^24
    EXPECT_EQ(static_cast<int64_t>(testing::to_floats(total)[0]), parameters)
        << "every tensor has exactly one owner";
    if (comm->rank() == 0)
      std::printf("%s, ZeRO-1 over %d rank(s): AdamW moments %lld of %lld bytes on rank 0\n",
                  precision.c_str(), comm->size(), (long long)zero.moment_bytes(),
                  (long long)(8 * parameters));
    // A checkpoint asks for whole moments: refused until they are gathered.
    if (comm->size() > 1)
      EXPECT_NE(testing::error_of([&] { checkpoint_tensors(s); }).find("gather them first"),
                std::string::npos);
    zero.gather(s);
    size_t whole_tensors = 0;  // params and moments (an FP8 run's checkpoint has its states too)
    for (const auto& [name, t] : checkpoint_tensors(s))
      whole_tensors += is_fp8_state(name) ? 0 : 1;
    EXPECT_EQ(whole_tensors, 3 * s.params.size());
  }
}

class ZeroMasters : public ::testing::TestWithParam<std::string> {};

// After a step has written the weights' casts, a Linear weight's FP32 master lives on its owner
// only (bf16, fp8-delayed); under fp8-current, whose casts need the master at each forward, every
// rank keeps every master. The next steps still train, from the casts the owners send.
TEST_P(ZeroMasters, AWeightsMasterStaysWithItsOwnerWhereTheStepWritesItsCasts) {
  auto comm = dist::from_environment();
  if (comm->size() < 2) GTEST_SKIP() << "needs mpirun -np 2 (or more) ranks";
  DataParallel dp(comm);
  ZeroState z = zero_state(comm, GetParam(), dp);
  TrainState& s = z.state;
  s.zero = std::make_shared<ZeroOptimizer>(comm, s, z.options.weight_decay);
  const std::vector<ParamLayer> layers = s.model->param_layers();
  int64_t whole = 0;
  for (const Parameter& p : s.params) whole += static_cast<int64_t>(p.value.nbytes());
  EXPECT_EQ(master_bytes(s), whole) << "before the first step every rank has every master";

  StepChecks checks(*s.model, s.params, z.options);
  const bool apart = GetParam() != "fp8-current";
  int64_t kept = 0, weights = 0;
  for (int64_t step = 1; step <= 3; ++step) {
    const StepResult r = train_step(s, *z.data, z.options, checks, dp);
    ASSERT_FALSE(r.verdict.skipped()) << "step " << step;
    ASSERT_TRUE(std::isfinite(r.loss)) << "step " << step;
    kept = weights = 0;
    for (size_t i = 0; i < s.params.size(); ++i) {
      const bool gone = apart && layers[i].weight && s.zero->owner(i) != comm->rank();
      EXPECT_EQ(s.params[i].value.defined(), !gone) << s.params[i].name << ", step " << step;
      if (layers[i].weight)
        EXPECT_EQ(layers[i].layer->weight().defined(), !gone) << s.params[i].name;
      if (layers[i].weight) weights += static_cast<int64_t>(s.params[i].grad.nbytes());
      if (!gone) kept += static_cast<int64_t>(s.params[i].grad.nbytes());
    }
    EXPECT_EQ(master_bytes(s), kept);
  }
  if (apart) EXPECT_LT(kept, whole) << "no master was freed";
  if (comm->rank() == 0)
    std::printf("%s: FP32 masters on rank 0: %lld of %lld bytes (Linear weights: %lld)\n",
                GetParam().c_str(), (long long)kept, (long long)whole, (long long)weights);
  // A checkpoint gathers the masters back, then they are freed again.
  s.zero->gather(s);
  EXPECT_EQ(master_bytes(s), whole);
  EXPECT_NO_THROW(checkpoint_tensors(s));
  s.zero->release(s);
  EXPECT_EQ(master_bytes(s), kept);
}

INSTANTIATE_TEST_SUITE_P(Precisions, ZeroMasters,
                         ::testing::Values("bf16", "fp8-delayed", "fp8-current"), param_name);

}  // namespace
}  // namespace octet::train
