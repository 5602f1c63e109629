// Gradient buckets (train/grad_buckets.h) on one process: the layout, the reducer's order and
// packing over a communicator that records what it is given, and the model's "these gradients
// are final" points (octet_dist_tests runs the buckets over real ranks).
#include "octet/train/grad_buckets.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "octet/fp8/format.h"
#include "test_util.h"

namespace octet::train {
namespace {

using testing::fresh_seed;
using testing::to_bytes;
using testing::to_floats;

TEST(GradBucketLayout, CoversEveryParameterOnceInReverseOrderWithinTheLimit) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::vector<int64_t> numels(1 + rng() % 60);
  // Mostly small parameters, some far larger than a bucket, an odd empty one.
  for (int64_t& n : numels) n = rng() % 8 == 0 ? 5000 + rng() % 20000 : rng() % 1500;
  for (const int64_t limit :
       {int64_t{1}, int64_t{4}, int64_t{3000}, int64_t{17000}, int64_t{1} << 40, int64_t{0}}) {
    SCOPED_TRACE("bucket bytes " + std::to_string(limit));
    const std::vector<GradBucket> buckets = grad_bucket_layout(numels, limit);
    ASSERT_FALSE(buckets.empty());
    EXPECT_EQ(buckets.front().end, numels.size()) << "the last parameter comes first";
    EXPECT_EQ(buckets.back().first, 0u) << "the first parameter comes last";
    for (size_t k = 0; k < buckets.size(); ++k) {
      const GradBucket& b = buckets[k];
      ASSERT_LT(b.first, b.end) << "bucket " << k << " is empty";
      if (k + 1 < buckets.size()) EXPECT_EQ(buckets[k + 1].end, b.first) << "a gap or overlap";
      int64_t elements = 0;
      for (size_t i = b.first; i < b.end; ++i) elements += numels[i];
      EXPECT_EQ(b.elements, elements) << "bucket " << k;
      if (limit == 0) continue;
      // Within the limit unless it is one oversized parameter; closed only when the next
      // parameter (the one below it) would not fit.
      if (b.end - b.first > 1) EXPECT_LE(4 * b.elements, limit) << "bucket " << k;
      if (k + 1 < buckets.size())
        EXPECT_GT(4 * (b.elements + numels[b.first - 1]), limit) << "bucket " << k;
    }
    if (limit == 0 || limit == 1) {
      EXPECT_EQ(buckets.size(), limit == 0 ? 1 : numels.size());
    }
  }
  EXPECT_TRUE(grad_bucket_layout({}, 100).empty());
}

TEST(GradBucketLayout, TheOptionIsMiBAndRefusesNegativeSizes) {
  EXPECT_EQ(grad_bucket_bytes(0), 0);
  EXPECT_EQ(grad_bucket_bytes(25), 25 * 1024 * 1024);
  EXPECT_EQ(grad_bucket_bytes(1e-12), 1) << "a tiny size is a bucket per parameter, not one";
  for (const double bad : {-1.0, -1e-9, std::numeric_limits<double>::quiet_NaN(),
                           std::numeric_limits<double>::infinity()}) {
    const std::string e = testing::error_of([&] { grad_bucket_bytes(bad); });
    EXPECT_NE(e.find("--grad-bucket-mb takes a bucket size in MiB, 0 or more"), std::string::npos)
        << e;
  }
}

/// A group that records each start_sum's buffer and, at wait_sums, "sums" what it was given as
/// two ranks holding the same values would: doubles it (exact in f32 and bf16).
class RecordingComm final : public dist::Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string describe() const override { return "recording"; }
  void all_reduce(std::span<const Tensor>, dist::ReduceOp) override { ADD_FAILURE(); }
  void reduce_scatter(std::span<const Tensor>) override { ADD_FAILURE(); }
  void all_gather(std::span<const Tensor>) override { ADD_FAILURE(); }
  void broadcast(std::span<const Tensor>, int) override { ADD_FAILURE(); }
  void barrier() override {}
  void start_sum(const Tensor& flat) override {
    started.push_back(flat);
    started_values.push_back(to_floats(flat));
  }
  void wait_sums() override {
    for (Tensor& t : started) {
      std::vector<float> v = to_floats(t);
      for (float& x : v) x *= 2;
      Tensor f32 = Tensor::from_vector(v, t.shape());
      if (t.dtype() == DType::f32)
        t.copy_from(f32);
      else
        for (int64_t i = 0; i < t.numel(); ++i)
          static_cast<uint16_t*>(t.raw_data())[i] = fp8::encode_bf16(v[static_cast<size_t>(i)]);
    }
    started.clear();
    ++waits;
  }

  std::vector<Tensor> started;
  std::vector<std::vector<float>> started_values;  ///< every buffer started, as it was then
  int waits = 0;
};

TEST(GradBucketReducer, StartsEachBucketWhenReadyPacksInOrderAndWritesTheSumsBack) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const std::vector<Shape> shapes = {{7, 3}, {5}, {64}, {2, 2, 2}, {33}, {1}};
  for (const DType wire : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(wire));
    std::vector<Tensor> grads;
    for (size_t i = 0; i < shapes.size(); ++i)
      grads.push_back(testing::random_tensor(shapes[i], DType::f32, seed + i));
    std::vector<std::vector<float>> before;
    for (const Tensor& g : grads) before.push_back(to_floats(g));
    auto comm = std::make_shared<RecordingComm>();
    // 40 f32 values a bucket: {33, 1}, {8}, {64} (oversized, alone), {21, 5}.
    GradBucketReducer reducer(comm, grads, 40 * 4, wire);
    const std::vector<GradBucket>& buckets = reducer.buckets();
    ASSERT_EQ(buckets.size(), 4u);
    EXPECT_EQ(buckets[0].first, 4u);
    reducer.gradients_ready(5);  // bucket 0 holds parameter 4 too: not yet
    EXPECT_EQ(comm->started.size(), 0u);
    reducer.gradients_ready(2);  // buckets 0 to 2; bucket 3 starts at parameter 0
    EXPECT_EQ(comm->started.size(), 3u);
    reducer.finish();  // the rest, then the wait
    ASSERT_EQ(comm->started_values.size(), buckets.size());
    EXPECT_EQ(comm->waits, 1);
    for (size_t k = 0; k < buckets.size(); ++k) {
      // The bucket's buffer: its parameters in parameters() order, rounded to the wire dtype.
      std::vector<float> want;
      for (size_t i = buckets[k].first; i < buckets[k].end; ++i)
        for (float v : before[i])
          want.push_back(wire == DType::f32 ? v : fp8::decode_bf16(fp8::encode_bf16(v)));
      EXPECT_EQ(comm->started_values[k], want) << "bucket " << k;
    }
    for (size_t i = 0; i < grads.size(); ++i) {
      std::vector<float> want = before[i];
      for (float& v : want)
        v = 2 * (wire == DType::f32 ? v : fp8::decode_bf16(fp8::encode_bf16(v)));
      EXPECT_EQ(to_floats(grads[i]), want) << "parameter " << i;
    }
    reducer.finish();  // a new step starts from the first bucket again
    EXPECT_EQ(comm->started_values.size(), 2 * buckets.size());
  }
}

/// Records, at each call, the gradients the model calls final, to compare with the step's end.
class SnapshotHook final : public GradientReadyHook {
 public:
  explicit SnapshotHook(std::vector<Parameter> params) : params_(std::move(params)) {}
  void gradients_ready(size_t first) override {
    firsts.push_back(first);
    for (size_t i = first; i < params_.size(); ++i)
      snapshots.push_back({i, to_bytes(params_[i].grad)});
  }
  std::vector<size_t> firsts;
  std::vector<std::pair<size_t, std::vector<uint8_t>>> snapshots;

 private:
  std::vector<Parameter> params_;
};

struct HookCase {
  std::string name;
  Arch arch;
  int64_t experts;
  bool recompute;
};

class GradientReadyHookPoints : public ::testing::TestWithParam<HookCase> {};

TEST_P(GradientReadyHookPoints, EveryGradientIsFinalWhenTheModelSaysSo) {
  const HookCase& c = GetParam();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  ModelConfig config;
  config.preset = "micro";
  config.arch = c.arch;
  config.layers = 3;
  config.dim = 32;
  config.heads = 2;
  config.ffn = 64;
  config.vocab = 32;
  config.max_seq = 16;
  config.experts = c.experts;
  config.topk = c.experts > 0 ? 1 : config.topk;  // top-1 over 8 experts: some get no token
  GPT model(config, Precision::from_name("bf16"), Device::cpu(), seed, c.recompute);
  SnapshotHook hook(model.parameters());
  const size_t n = model.parameters().size();
  constexpr int64_t kMicrobatches = 2, kBatch = 2, kSeq = 8;
  std::mt19937_64 rng(seed);
  // Two steps: the second's gradients are zeroed on their next write (as train_step does), so
  // one the backward never writes still holds the first step's value until it is settled.
  for (int step = 0; step < 2; ++step) {
    model.zero_grad(nn::ZeroGrad::on_next_write);
    for (int64_t micro = 0; micro < kMicrobatches; ++micro) {
      Tensor ids = Tensor::empty({kBatch * kSeq}, DType::i32), targets = ids.clone();
      for (int64_t i = 0; i < ids.numel(); ++i) {
        ids.data<int32_t>()[i] = static_cast<int32_t>(rng() % config.vocab);
        targets.data<int32_t>()[i] = static_cast<int32_t>(rng() % config.vocab);
      }
      const bool last = step == 1 && micro == kMicrobatches - 1;
      model.set_gradient_ready_hook(last ? &hook : nullptr);
      model.train_microbatch(ids, targets, kBatch, kSeq, 0.5f);
    }
    model.set_gradient_ready_hook(nullptr);
    if (step == 0) model.settle_grads();
  }
  model.settle_grads();
  // Called per part, from the last parameter down to 0, only in the last microbatch.
  ASSERT_FALSE(hook.firsts.empty());
  EXPECT_EQ(hook.firsts.back(), 0u);
  for (size_t k = 1; k < hook.firsts.size(); ++k) EXPECT_LT(hook.firsts[k], hook.firsts[k - 1]);
  // Every part: the final norm, each block, the embeddings, and an untied head of its own.
  EXPECT_EQ(hook.firsts.size(), 1 + 3 + 1 + (c.arch == Arch::llama ? 1 : 0));
  if (c.arch == Arch::llama) EXPECT_EQ(hook.firsts.front(), n - 1) << "lm_head first";
  // Nothing any later code wrote changes a gradient the model had called final.
  const std::vector<Parameter> params = model.parameters();
  for (const auto& [i, bytes] : hook.snapshots)
    EXPECT_EQ(bytes, to_bytes(params[i].grad)) << params[i].name << " changed after its point";
}

INSTANTIATE_TEST_SUITE_P(Models, GradientReadyHookPoints,
                         ::testing::Values(HookCase{"gpt2_tied", Arch::gpt2, 0, false},
                                           HookCase{"llama_head", Arch::llama, 0, false},
                                           HookCase{"gpt2_recompute", Arch::gpt2, 0, true},
                                           HookCase{"moe_idle_experts", Arch::gpt2, 8, false}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace octet::train
