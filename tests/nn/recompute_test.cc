// Activation recompute (DESIGN.md rule 1): with recompute the gradients are bitwise those of a
// run without, for every recipe, and each pass updates the FP8 state exactly once.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <tuple>

#include "nn/nn_check.h"
#include "octet/nn/autocast.h"
#include "octet/nn/linear_stack.h"
#include "test_util.h"

namespace octet::nn {
namespace {

using fp8::Recipe;
using fp8::TensorRole;
using testing::bitwise_equal;
using testing::device_name;
using testing::fresh_seed;
using testing::state_tensors;

using RecomputeParam = std::tuple<Device, Recipe>;
class RecomputeTest : public ::testing::TestWithParam<RecomputeParam> {};

/// All bytes of one forward's Saved record.
std::vector<Tensor> saved_tensors(const Linear::Saved& s) {
  const fp8::QuantizedTensor& q = s.input_q;
  return {q.data, q.scale_inv, q.data_t, q.scale_inv_t};
}

TEST_P(RecomputeTest, LinearRecomputeRebuildsTheSameSavedBytesAndLeavesStateAlone) {
  const auto& [device, recipe] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Linear layer(64, 48, true, device, seed);
  AmaxRegistry registry;
  {  // A first forward calibrates delayed scales (a first pass scales from its own tensors), so
     // that the forward under test casts with scales its own update then moves.
    Linear::Saved first;
    Fp8Autocast scope(recipe, registry);
    layer.forward(testing::random_tensor({32, 64}, DType::f32, seed + 2).to(device), first);
  }
  Tensor x = testing::random_tensor({32, 64}, DType::f32, seed + 1, 3.0f).to(device);
  Linear::Saved original;
  Tensor y;
  {
    Fp8Autocast scope(recipe, registry);
    y = layer.forward(x, original);
  }
  // The finalize changed the delayed scales: recompute must still use the original ones.
  const FP8State& state = *layer.fp8_state();
  std::vector<Tensor> before;
  for (const Tensor& t : state_tensors(state)) before.push_back(t.clone());
  const int64_t casts = layer.weight_casts();

  Linear::Saved rebuilt = Linear::Saved::from_snapshot(original.snapshot);
  const Tensor y_again = layer.forward(x, rebuilt, ForwardMode::recompute);

  EXPECT_TRUE(bitwise_equal(y, y_again));
  const std::vector<Tensor> a = saved_tensors(original), b = saved_tensors(rebuilt);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i], b[i])) << "tensor " << i;
  EXPECT_EQ(rebuilt.snapshot.weight, original.snapshot.weight);
  EXPECT_EQ(layer.weight_casts(), casts);
  const std::vector<Tensor> after = state_tensors(state);
  for (size_t i = 0; i < after.size(); ++i)
    EXPECT_TRUE(bitwise_equal(before[i], after[i])) << "state tensor " << i;
  EXPECT_FALSE(state.pending(Pass::forward));
  EXPECT_EQ(state.forward_updates(), 2);
  EXPECT_EQ(registry.forward_update_count(), 2);
  if (recipe.kind == fp8::RecipeKind::delayed) {  // the test is only a claim if scales moved
    EXPECT_NE(testing::to_bytes(original.snapshot.input_scale),
              testing::to_bytes(state.scale(TensorRole::input)));
  }
}

// ----------------------------------------------------------------------------
// The acceptance test: a deep stack, many microbatches, several seeds.

constexpr int kLayers = 14;
constexpr int64_t kWidth = 64;
constexpr int64_t kTokens = 32;  ///< per microbatch
constexpr int kMicrobatches = 8;
constexpr int kSeeds = 3;

struct RunResult {
  std::vector<Tensor> dx;       ///< first layer's dx per microbatch (on the CPU)
  std::vector<Tensor> grads;    ///< every layer's grad_weight and grad_bias
  std::vector<Tensor> states;   ///< every layer's FP8 state at the end
  int64_t forward_updates = 0;  ///< registry counts
  int64_t backward_updates = 0;
  std::vector<int64_t> per_state;  ///< forward and backward updates of each state
};

/// One optimizer step of kMicrobatches accumulated microbatches over a kLayers-deep stack whose
/// layer l lives on device_of(l).
RunResult run_stack(const Recipe& recipe, bool recompute, uint64_t seed,
                    const std::function<Device(int)>& device_of) {
  LinearStack stack(recompute);
  for (int l = 0; l < kLayers; ++l)
    stack.add(Linear(kWidth, kWidth, true, device_of(l), seed + 101 * (l + 1)));
  AmaxRegistry registry;
  RunResult result;
  for (int m = 0; m < kMicrobatches; ++m) {
    const uint64_t mb_seed = seed + 7919 * (m + 1);
    Tensor x = testing::random_tensor({kTokens, kWidth}, DType::f32, mb_seed).to(device_of(0));
    Tensor dy = testing::random_tensor({kTokens, kWidth}, DType::f32, mb_seed + 1)
                    .to(device_of(kLayers - 1));
    LinearStack::Saved saved;
    {
      Fp8Autocast scope(recipe, registry);
      stack.forward(x, saved);
    }
    if (recompute) {  // only the input and the snapshots survive the forward
      EXPECT_TRUE(saved.layers.empty());
      EXPECT_EQ(saved.snapshots.size(), static_cast<size_t>(kLayers));
    }
    result.dx.push_back(stack.backward(dy, saved).to(Device::cpu()));
    registry.finalize_backward();
  }
  for (int l = 0; l < kLayers; ++l) {
    const Linear& layer = stack.layer(l);
    result.grads.push_back(layer.grad_weight().to(Device::cpu()));
    result.grads.push_back(layer.grad_bias().to(Device::cpu()));
    for (const Tensor& t : state_tensors(*layer.fp8_state()))
      result.states.push_back(t.to(Device::cpu()));
    result.per_state.push_back(layer.fp8_state()->forward_updates());
    result.per_state.push_back(layer.fp8_state()->backward_updates());
  }
  result.forward_updates = registry.forward_update_count();
  result.backward_updates = registry.backward_update_count();
  return result;
}

void expect_bitwise_same(const RunResult& expected, const RunResult& actual) {
  ASSERT_EQ(expected.dx.size(), actual.dx.size());
  for (size_t m = 0; m < expected.dx.size(); ++m)
    EXPECT_TRUE(bitwise_equal(expected.dx[m], actual.dx[m])) << "dx of microbatch " << m;
  for (size_t i = 0; i < expected.grads.size(); ++i)
    EXPECT_TRUE(bitwise_equal(expected.grads[i], actual.grads[i]))
        << "layer " << i / 2 << (i % 2 ? " grad_bias" : " grad_weight");
  for (size_t i = 0; i < expected.states.size(); ++i)
    EXPECT_TRUE(bitwise_equal(expected.states[i], actual.states[i]))
        << "layer " << i / 8 << " FP8 state tensor " << i % 8;
}

void expect_one_update_per_pass(const RunResult& run) {
  EXPECT_EQ(run.forward_updates, kMicrobatches);
  EXPECT_EQ(run.backward_updates, kMicrobatches);
  for (size_t i = 0; i < run.per_state.size(); ++i)
    EXPECT_EQ(run.per_state[i], kMicrobatches)
        << "layer " << i / 2 << (i % 2 ? " backward" : " forward") << " updates";
}

TEST_P(RecomputeTest, DeepStackGradientsAreBitwiseEqualWithAndWithoutRecompute) {
  const auto& [device, recipe] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t base_seed = fresh_seed();
  for (int s = 0; s < kSeeds; ++s) {
    const uint64_t seed = base_seed + 1000003ull * s;
    SCOPED_TRACE("seed " + std::to_string(seed));
    auto on_device = [&](int) { return device; };
    const RunResult plain = run_stack(recipe, false, seed, on_device);
    const RunResult recomputed = run_stack(recipe, true, seed, on_device);
    expect_one_update_per_pass(plain);
    expect_one_update_per_pass(recomputed);
    expect_bitwise_same(plain, recomputed);
    // The gradients are real: finite and not all zero.
    bool nonzero = false;
    for (const Tensor& g : plain.grads) {
      for (float v : testing::to_floats(g)) {
        ASSERT_TRUE(std::isfinite(v));
        nonzero |= v != 0.0f;
      }
    }
    EXPECT_TRUE(nonzero);
    if (HasFailure()) return;  // one seed's report is enough
  }
}

std::string param_name(const ::testing::TestParamInfo<RecomputeParam>& info) {
  std::string name = device_name(std::get<0>(info.param)) + "_" + std::get<1>(info.param).name();
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

INSTANTIATE_TEST_SUITE_P(Recipes, RecomputeTest,
                         ::testing::Combine(::testing::ValuesIn(testing::all_backends()),
                                            ::testing::Values(Recipe::delayed(), Recipe::current(),
                                                              Recipe::block(), Recipe::mxfp8())),
                         param_name);

// ----------------------------------------------------------------------------
// DESIGN.md rule 2's acceptance test: a model split over two GPUs gives bitwise the results of
// the same model on one GPU.

TEST(RecomputeSplit, StackSplitOverTwoGpusMatchesOneGpuBitwise) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const Recipe& recipe : {Recipe::delayed(), Recipe::current()}) {
    SCOPED_TRACE(recipe.name());
    const RunResult single = run_stack(recipe, true, seed, [](int) { return Device::cuda(0); });
    const RunResult split =
        run_stack(recipe, true, seed, [](int l) { return Device::cuda(l % 2); });
    expect_one_update_per_pass(split);
    expect_bitwise_same(single, split);
  }
}

}  // namespace
}  // namespace octet::nn
