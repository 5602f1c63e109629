#include "octet/nn/fp8_state.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <stdexcept>

#include "octet/fp8/format.h"
#include "octet/nn/autocast.h"
#include "octet/nn/linear.h"
#include "test_util.h"

namespace octet::nn {
namespace {

using fp8::Recipe;
using fp8::TensorRole;
using ::testing::ElementsAre;
using testing::fresh_seed;
using ::testing::HasSubstr;
using testing::to_floats;

/// A history length small enough to read back whole.
constexpr int kHistoryLen = 4;

/// Writes `value` into the f32[1] view `slot` (any device).
void set_value(const Tensor& slot, float value) {
  Tensor(slot).copy_from(Tensor::from_vector({value}, {1}));
}
float value_of(const Tensor& t) { return to_floats(t).at(0); }

class FP8StateTest : public ::testing::TestWithParam<Device> {};

TEST_P(FP8StateTest, DelayedLayoutOnTheModuleDevice) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  FP8State state(Recipe::delayed(0, kHistoryLen), device);
  const ops::ScalingGroup& fwd = state.group(Pass::forward);
  const ops::ScalingGroup& bwd = state.group(Pass::backward);
  for (const Tensor* t : {&fwd.amax_history, &fwd.scale, &fwd.scale_inv, &bwd.amax_history,
                          &bwd.scale, &bwd.scale_inv, &state.last_amax(Pass::forward)}) {
    EXPECT_EQ(t->device(), device) << t->describe();
    EXPECT_EQ(t->dtype(), DType::f32);
  }
  EXPECT_EQ(fwd.amax_history.shape(), (Shape{kHistoryLen, 2}));
  EXPECT_EQ(bwd.amax_history.shape(), (Shape{kHistoryLen, 1}));
  EXPECT_THAT(to_floats(fwd.scale), ElementsAre(1.0f, 1.0f));
  EXPECT_THAT(to_floats(bwd.scale_inv), ElementsAre(1.0f));
  for (float v : to_floats(fwd.amax_history)) EXPECT_EQ(v, 0.0f);
  EXPECT_EQ(fwd.fp8_max, fp8::kE4M3Max);
  EXPECT_EQ(bwd.fp8_max, fp8::kE5M2Max);  // HYBRID: E5M2 gradients

  // The accessors are views into the groups: row 0 element `slot`, and scale element `slot`.
  set_value(state.amax_slot(TensorRole::weight), 3.0f);
  set_value(state.amax_slot(TensorRole::grad_output), 5.0f);
  set_value(state.scale(TensorRole::input), 7.0f);
  std::vector<float> history = to_floats(fwd.amax_history);
  EXPECT_EQ(history[0], 0.0f);
  EXPECT_EQ(history[1], 3.0f);
  EXPECT_EQ(to_floats(bwd.amax_history)[0], 5.0f);
  EXPECT_THAT(to_floats(fwd.scale), ElementsAre(7.0f, 1.0f));
}

TEST_P(FP8StateTest, NonDelayedRecipesKeepOneStatisticsRow) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  for (const Recipe& recipe : {Recipe::current(), Recipe::block(), Recipe::mxfp8()}) {
    SCOPED_TRACE(recipe.name());
    FP8State state(recipe, device);
    EXPECT_EQ(state.group(Pass::forward).amax_history.shape(), (Shape{1, 2}));
    EXPECT_EQ(state.group(Pass::backward).amax_history.shape(), (Shape{1, 1}));
    EXPECT_EQ(state.group(Pass::backward).fp8_max,
              fp8::fp8_max(recipe.dtype_for(TensorRole::grad_output)));
  }
}

TEST_P(FP8StateTest, DelayedFinalizeRollsOncePerPassAndOnlyPendingStates) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  AmaxRegistry registry;
  auto a = std::make_shared<FP8State>(Recipe::delayed(0, kHistoryLen), device);
  auto idle = std::make_shared<FP8State>(Recipe::delayed(0, kHistoryLen), device);
  registry.register_state(a);
  registry.register_state(idle);

  set_value(a->amax_slot(TensorRole::input), 2.0f);
  set_value(a->amax_slot(TensorRole::weight), 0.5f);
  a->mark_recorded(Pass::forward);
  registry.finalize_forward();

  EXPECT_EQ(registry.forward_update_count(), 1);
  EXPECT_EQ(registry.backward_update_count(), 0);
  EXPECT_EQ(registry.scaling_update_calls(), 1);
  EXPECT_EQ(a->forward_updates(), 1);
  EXPECT_EQ(a->backward_updates(), 0);
  EXPECT_FALSE(a->pending(Pass::forward));
  // scale = fp8_max / amax, history rolled (row 0 zero, row 1 the amaxes), statistics kept.
  EXPECT_THAT(to_floats(a->group(Pass::forward).scale),
              ElementsAre(fp8::kE4M3Max / 2.0f, fp8::kE4M3Max / 0.5f));
  std::vector<float> history = to_floats(a->group(Pass::forward).amax_history);
  EXPECT_THAT(std::vector<float>(history.begin(), history.begin() + 4), ElementsAre(0, 0, 2, 0.5));
  EXPECT_THAT(to_floats(a->last_amax(Pass::forward)), ElementsAre(2.0f, 0.5f));
  EXPECT_EQ(value_of(a->last_amax(TensorRole::weight)), 0.5f);
  // A state that took no part in the pass is left alone.
  EXPECT_EQ(idle->forward_updates(), 0);
  EXPECT_THAT(to_floats(idle->group(Pass::forward).scale), ElementsAre(1.0f, 1.0f));

  // The backward pass is finalized separately.
  set_value(a->amax_slot(TensorRole::grad_output), 4.0f);
  a->mark_recorded(Pass::backward);
  registry.finalize_backward();
  EXPECT_EQ(registry.backward_update_count(), 1);
  EXPECT_EQ(a->backward_updates(), 1);
  EXPECT_EQ(value_of(a->scale(TensorRole::grad_output)), fp8::kE5M2Max / 4.0f);
  EXPECT_EQ(a->forward_updates(), 1);

  // A finalize with nothing pending still counts as the pass's update, and changes nothing.
  registry.finalize_forward();
  EXPECT_EQ(registry.forward_update_count(), 2);
  EXPECT_EQ(registry.scaling_update_calls(), 2);  // 1 forward + 1 backward so far
  EXPECT_EQ(a->forward_updates(), 1);
}

TEST_P(FP8StateTest, ForwardScalesMoveToOneFreshAllocationAndHeldViewsKeepTheirValues) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  AmaxRegistry registry;
  std::vector<std::shared_ptr<FP8State>> states;
  std::vector<Tensor> held;  // what a forward's snapshot keeps: the input scale it used
  for (int k = 0; k < 3; ++k) {
    states.push_back(std::make_shared<FP8State>(Recipe::delayed(0, kHistoryLen), device));
    registry.register_state(states.back());
    set_value(states.back()->amax_slot(TensorRole::input), 2.0f * static_cast<float>(k + 1));
    set_value(states.back()->amax_slot(TensorRole::weight), 1.0f);
    states.back()->mark_recorded(Pass::forward);
    held.push_back(states.back()->scale(TensorRole::input));
  }
  registry.finalize_forward();
  for (size_t k = 0; k < states.size(); ++k) {
    SCOPED_TRACE(::testing::Message() << "state " << k);
    EXPECT_EQ(value_of(held[k]), 1.0f) << "a held view keeps the scale it was taken with";
    EXPECT_EQ(value_of(states[k]->scale(TensorRole::input)),
              fp8::kE4M3Max / (2.0f * static_cast<float>(k + 1)));
    EXPECT_NE(states[k]->group(Pass::forward).scale.storage(), held[k].storage());
    // One allocation for the pass's new scales, not one per state.
    EXPECT_EQ(states[k]->group(Pass::forward).scale.storage(),
              states[0]->group(Pass::forward).scale.storage());
  }
}

TEST_P(FP8StateTest, NonDelayedFinalizeKeepsStatisticsAndZeroesTheSlot) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  for (const Recipe& recipe : {Recipe::current(), Recipe::block(), Recipe::mxfp8()}) {
    SCOPED_TRACE(recipe.name());
    AmaxRegistry registry;
    auto state = std::make_shared<FP8State>(recipe, device);
    registry.register_state(state);
    set_value(state->amax_slot(TensorRole::input), 6.0f);
    state->mark_recorded(Pass::forward);
    registry.finalize_forward();
    EXPECT_EQ(registry.forward_update_count(), 1);
    EXPECT_EQ(registry.scaling_update_calls(), 0);  // no scale to roll
    EXPECT_EQ(state->forward_updates(), 1);
    EXPECT_EQ(value_of(state->last_amax(TensorRole::input)), 6.0f);
    EXPECT_EQ(value_of(state->amax_slot(TensorRole::input)), 0.0f);
    EXPECT_THAT(to_floats(state->group(Pass::forward).scale), ElementsAre(1.0f, 1.0f));
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, FP8StateTest, ::testing::ValuesIn(testing::all_backends()),
                         [](const auto& info) {
                           return info.param.is_cpu() ? std::string("cpu")
                                                      : "cuda" + std::to_string(info.param.index);
                         });

TEST(AmaxRegistry, KeepsRegistrationOrderAndDropsDestroyedStates) {
  AmaxRegistry registry;
  auto a = std::make_shared<FP8State>(Recipe::current(), Device::cpu());
  auto b = std::make_shared<FP8State>(Recipe::current(), Device::cpu());
  auto c = std::make_shared<FP8State>(Recipe::current(), Device::cpu());
  registry.register_state(b);
  registry.register_state(a);
  registry.register_state(b);  // already there: keeps its place
  registry.register_state(c);
  std::vector<std::shared_ptr<FP8State>> order = registry.states();
  ASSERT_EQ(order.size(), 3u);
  EXPECT_EQ(order[0], b);
  EXPECT_EQ(order[1], a);
  EXPECT_EQ(order[2], c);

  registry.unregister_state(a.get());
  EXPECT_FALSE(registry.contains(a.get()));
  order.clear();
  const FP8State* dead = c.get();
  c.reset();  // the registry does not keep modules alive
  EXPECT_FALSE(registry.contains(dead));
  order = registry.states();
  ASSERT_EQ(order.size(), 1u);
  EXPECT_EQ(order[0], b);
}

TEST(AmaxRegistry, RejectsNullState) {
  AmaxRegistry registry;
  EXPECT_THAT([&] { registry.register_state(nullptr); },
              ::testing::ThrowsMessage<Error>(HasSubstr("null state")));
}

/// Records what it was given and doubles every amax (a stand-in for a MAX all-reduce).
class RecordingReducer : public AmaxReducer {
 public:
  void all_reduce_max(std::span<const Tensor> rows) override {
    for (const Tensor& row : rows) {
      seen.push_back(to_floats(row));
      std::vector<float> v = to_floats(row);
      for (float& x : v) x *= 2;
      Tensor(row).copy_from(Tensor::from_vector(v, row.shape()));
    }
  }
  std::vector<std::vector<float>> seen;
};

TEST(AmaxRegistry, ReducerSeesPendingRowsInRegistrationOrderBeforeTheUpdate) {
  auto reducer = std::make_shared<RecordingReducer>();
  AmaxRegistry registry(reducer);
  auto first = std::make_shared<FP8State>(Recipe::delayed(0, kHistoryLen), Device::cpu());
  auto second = std::make_shared<FP8State>(Recipe::delayed(0, kHistoryLen), Device::cpu());
  registry.register_state(first);
  registry.register_state(second);
  set_value(second->amax_slot(TensorRole::input), 1.0f);
  set_value(first->amax_slot(TensorRole::input), 7.0f);
  second->mark_recorded(Pass::forward);
  first->mark_recorded(Pass::forward);
  registry.finalize_forward();
  ASSERT_EQ(reducer->seen.size(), 3u) << "each state's row 0, then the pending flags";
  EXPECT_THAT(reducer->seen[0], ElementsAre(7.0f, 0.0f));
  EXPECT_THAT(reducer->seen[1], ElementsAre(1.0f, 0.0f));
  EXPECT_THAT(reducer->seen[2], ElementsAre(1.0f, 1.0f));
  EXPECT_EQ(value_of(first->scale(TensorRole::input)), fp8::kE4M3Max / 14.0f);
  EXPECT_EQ(value_of(second->scale(TensorRole::input)), fp8::kE4M3Max / 2.0f);
}

/// The MAX with one other rank, whose rows (each state's row 0, then the pending flags) are
/// `other`.
class TwoRankReducer : public AmaxReducer {
 public:
  explicit TwoRankReducer(std::vector<std::vector<float>> other) : other_(std::move(other)) {}
  void all_reduce_max(std::span<const Tensor> rows) override {
    ASSERT_EQ(rows.size(), other_.size());
    for (size_t k = 0; k < rows.size(); ++k) {
      std::vector<float> v = to_floats(rows[k]);
      for (size_t i = 0; i < v.size(); ++i) v[i] = std::max(v[i], other_[k][i]);
      Tensor(rows[k]).copy_from(Tensor::from_vector(v, rows[k].shape()));
    }
  }

 private:
  std::vector<std::vector<float>> other_;
};

// An MoE expert that got rows on another rank only: this rank recorded nothing for it, but the
// group finalizes it everywhere from the other rank's amax, so the ranks' states stay equal.
TEST(AmaxRegistry, AStatePendingOnAnotherRankOnlyIsFinalizedFromItsRows) {
  auto reducer = std::make_shared<TwoRankReducer>(
      std::vector<std::vector<float>>{{3.0f, 0.5f}, {0.0f, 0.0f}, {1.0f, 0.0f}});
  AmaxRegistry registry(reducer);
  auto ran_elsewhere = std::make_shared<FP8State>(Recipe::delayed(0, kHistoryLen), Device::cpu());
  auto ran_nowhere = std::make_shared<FP8State>(Recipe::delayed(0, kHistoryLen), Device::cpu());
  registry.register_state(ran_elsewhere);
  registry.register_state(ran_nowhere);
  registry.finalize_forward();  // nothing pending here
  EXPECT_EQ(ran_elsewhere->forward_updates(), 1);
  EXPECT_EQ(value_of(ran_elsewhere->scale(TensorRole::input)), fp8::kE4M3Max / 3.0f);
  EXPECT_EQ(value_of(ran_elsewhere->scale(TensorRole::weight)), fp8::kE4M3Max / 0.5f);
  EXPECT_EQ(ran_nowhere->forward_updates(), 0) << "pending on no rank: left alone";
  EXPECT_EQ(value_of(ran_nowhere->scale(TensorRole::input)), 1.0f);
}

TEST(AmaxRegistry, GroupsStatesByDeviceOneUpdatePerDevice) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  AmaxRegistry registry;
  std::vector<std::shared_ptr<FP8State>> states;
  for (const Device& d : {Device::cpu(), Device::cuda(0), Device::cpu(), Device::cuda(0)}) {
    states.push_back(std::make_shared<FP8State>(Recipe::delayed(0, kHistoryLen), d));
    registry.register_state(states.back());
    set_value(states.back()->amax_slot(TensorRole::input), 1.0f + states.size());
    states.back()->mark_recorded(Pass::forward);
  }
  registry.finalize_forward();
  EXPECT_EQ(registry.scaling_update_calls(), 2);
  for (size_t i = 0; i < states.size(); ++i) {
    EXPECT_EQ(states[i]->forward_updates(), 1);
    EXPECT_EQ(value_of(states[i]->scale(TensorRole::input)), fp8::kE4M3Max / (2.0f + i));
  }
}

// ----------------------------------------------------------------------------
// fp8_autocast

TEST(Fp8Autocast, SetsTheThreadContextNestsAndFinalizesOnExit) {
  EXPECT_EQ(active_fp8(), nullptr);
  AmaxRegistry outer_registry, inner_registry;
  {
    Fp8Autocast outer(Recipe::delayed(), outer_registry);
    ASSERT_NE(active_fp8(), nullptr);
    EXPECT_EQ(active_fp8()->registry, &outer_registry);
    EXPECT_EQ(active_fp8()->recipe.kind, fp8::RecipeKind::delayed);
    {
      Fp8Autocast inner(Recipe::mxfp8(), inner_registry);
      EXPECT_EQ(active_fp8()->registry, &inner_registry);
      EXPECT_EQ(active_fp8()->recipe.kind, fp8::RecipeKind::mxfp8);
    }
    EXPECT_EQ(inner_registry.forward_update_count(), 1);
    EXPECT_EQ(outer_registry.forward_update_count(), 0);
    EXPECT_EQ(active_fp8()->registry, &outer_registry);
  }
  EXPECT_EQ(active_fp8(), nullptr);
  EXPECT_EQ(outer_registry.forward_update_count(), 1);
  EXPECT_EQ(outer_registry.backward_update_count(), 0);
}

TEST(Fp8Autocast, DoesNotFinalizeWhenLeftByAnException) {
  AmaxRegistry registry;
  try {
    Fp8Autocast scope(Recipe::current(), registry);
    throw std::runtime_error("forward failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(registry.forward_update_count(), 0);
  EXPECT_EQ(active_fp8(), nullptr);
}

TEST(Fp8Autocast, RejectsAnInvalidRecipe) {
  AmaxRegistry registry;
  Recipe bad = Recipe::delayed();
  bad.amax_history_len = 0;
  EXPECT_THROW(Fp8Autocast(bad, registry), Error);
  EXPECT_EQ(active_fp8(), nullptr);
}

TEST(Fp8Autocast, ModulesRegisterTheirStateOnTheirDevice) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  AmaxRegistry registry;
  Linear first(32, 16, true, Device::cpu(), seed);
  Linear second(16, 16, false, Device::cpu(), seed + 1);
  Tensor x = testing::random_tensor({16, 32}, DType::f32, seed + 2);
  EXPECT_EQ(first.fp8_state(), nullptr);
  Linear::Saved s1, s2;
  {
    Fp8Autocast scope(Recipe::delayed(0, kHistoryLen), registry);
    second.forward(first.forward(x, s1), s2);
    ASSERT_NE(first.fp8_state(), nullptr);
    EXPECT_TRUE(first.fp8_state()->pending(Pass::forward));
  }
  std::vector<std::shared_ptr<FP8State>> order = registry.states();
  ASSERT_EQ(order.size(), 2u);
  EXPECT_EQ(order[0], first.fp8_state());
  EXPECT_EQ(order[1], second.fp8_state());
  EXPECT_EQ(first.fp8_state()->device(), Device::cpu());
  EXPECT_EQ(first.fp8_state()->forward_updates(), 1);
  EXPECT_EQ(registry.forward_update_count(), 1);
  // The cast recorded the real amax of the input before the finalize took it.
  float amax = 0;
  for (float v : to_floats(x)) amax = std::max(amax, std::fabs(v));
  EXPECT_EQ(value_of(first.fp8_state()->last_amax(TensorRole::input)), amax);
  EXPECT_EQ(value_of(first.fp8_state()->scale(TensorRole::input)), fp8::kE4M3Max / amax);
  // Outside the scope modules compute in high precision and touch no FP8 state.
  second.forward(first.forward(x, s1), s2);
  EXPECT_FALSE(s1.snapshot.fp8);
  EXPECT_FALSE(first.fp8_state()->pending(Pass::forward));
}

}  // namespace
}  // namespace octet::nn
