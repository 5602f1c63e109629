// Delayed scaling in nn::Linear, step by step, against an independent reference of Transformer
// Engine's DelayedScaling: its PyTorch update (amax = max over the history or its row 0, scale =
// (fp8_max / amax) / 2^margin kept when amax is 0 or not finite, then torch.roll(history, -1)
// and row 0 cleared), its timing (forward roles updated after each forward, grad_output after
// each backward, so step t casts with the scales of steps up to t - 1) and its casts (codes =
// fp8(x * scale)), with octet's one deliberate difference: a pass with no history yet (the first)
// casts with scales from its own tensors, fp8_max / amax as current scaling computes them, where
// TE casts with the initial 1 (FP8State::calibrated says why). The layer runs its unfused paths;
// tests/train/fusion_test.cc holds every fused path to them bitwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "octet/fp8/format.h"
#include "octet/nn/autocast.h"
#include "octet/nn/cast_stats.h"
#include "octet/nn/fusion.h"
#include "octet/nn/linear.h"
#include "test_util.h"

namespace octet::nn {
namespace {

using fp8::AmaxAlgo;
using fp8::Recipe;
using fp8::TensorRole;
using testing::fresh_seed;
using testing::to_floats;

/// Transformer Engine's delayed-scaling state of one pass, as its PyTorch code keeps it: a
/// [len, n] history whose row 0 receives the amaxes of the pass in flight.
struct TeDelayedScaling {
  int len, n;
  float fp8_max;
  int margin;
  AmaxAlgo algo;
  std::vector<float> history;  // [len, n]
  std::vector<float> scale;    // [n], 1 at the start
  bool updated = false;

  TeDelayedScaling(int len, int n, float fp8_max, int margin, AmaxAlgo algo)
      : len(len), n(n), fp8_max(fp8_max), margin(margin), algo(algo),
        history(static_cast<size_t>(len * n), 0.0f), scale(static_cast<size_t>(n), 1.0f) {}

  void record(int j, float amax) { history[j] = std::max(history[j], amax); }

  /// The scale a cast of role j uses, given the tensor's own amax: octet's first pass scales from
  /// the tensor itself (current scaling), every later one from the history.
  float cast_scale(int j, float tensor_amax) const {
    return updated ? scale[j] : fp8_max / tensor_amax;
  }

  void update() {
    for (int j = 0; j < n; ++j) {
      float amax = history[j];
      if (algo == AmaxAlgo::max)
        for (int i = 1; i < len; ++i) amax = std::max(amax, history[i * n + j]);
      const float sf = (fp8_max / amax) / std::ldexp(1.0f, margin);
      if (amax > 0.0f && std::isfinite(amax)) scale[j] = sf;
    }
    // torch.roll(history, -1, 0): row i takes row i + 1, the last row takes row 0; then row 0
    // is cleared for the next pass.
    std::vector<float> rolled(history.size());
    for (int i = 0; i < len; ++i)
      for (int j = 0; j < n; ++j) rolled[i * n + j] = history[((i + 1) % len) * n + j];
    std::fill(rolled.begin(), rolled.begin() + n, 0.0f);
    history = std::move(rolled);
    updated = true;
  }
};

float host_amax(const std::vector<float>& v) {
  float m = 0.0f;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

/// Counts the codes that differ from fp8(values * scale).
int64_t codes_off(const Tensor& codes, const std::vector<float>& values, float scale,
                  DType dtype) {
  const std::vector<uint8_t> got = testing::to_bytes(codes);
  int64_t off = 0;
  for (size_t i = 0; i < values.size(); ++i)
    off += got[i] != fp8::encode_fp8(values[i] * scale, dtype);
  return off;
}

struct ReferenceCase {
  std::string name;
  Recipe recipe;
};

class DelayedReferenceTest : public ::testing::TestWithParam<ReferenceCase> {};

TEST_P(DelayedReferenceTest, LinearCastsAndUpdatesAsTransformerEngineDoes) {
  const Recipe recipe = GetParam().recipe;
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  UnfusedScope unfused(all_fusions());
  constexpr int64_t kRows = 64, kIn = 32, kOut = 48;
  // Magnitudes per step, rising and falling, so that the history window and the algorithm
  // decide the scales (a window of 3 forgets the 40x step three steps later).
  const std::vector<float> x_scale = {1.0f, 40.0f, 0.5f, 2.0f, 0.25f, 3.0f, 0.1f, 8.0f};
  const std::vector<float> dy_scale = {1e-3f, 2e-2f, 5e-4f, 1e-1f, 1e-4f, 3e-3f, 2e-4f, 1e-2f};

  Linear layer(kIn, kOut, /*bias=*/true, Device::cpu(), seed);
  AmaxRegistry registry;
  const DType in_dtype = recipe.dtype_for(TensorRole::input);
  const DType grad_dtype = recipe.dtype_for(TensorRole::grad_output);
  TeDelayedScaling forward(recipe.amax_history_len, 2, fp8::fp8_max(in_dtype), recipe.margin,
                           recipe.amax_compute_algo);
  TeDelayedScaling backward(recipe.amax_history_len, 1, fp8::fp8_max(grad_dtype), recipe.margin,
                            recipe.amax_compute_algo);

  for (size_t t = 0; t < x_scale.size(); ++t) {
    SCOPED_TRACE("step " + std::to_string(t));
    const Tensor x = testing::random_tensor({kRows, kIn}, DType::f32, seed + 10 * t, x_scale[t]);
    const Tensor dy =
        testing::random_tensor({kRows, kOut}, DType::f32, seed + 10 * t + 1, dy_scale[t]);
    const std::vector<float> x_host = to_floats(x), dy_host = to_floats(dy);
    const std::vector<float> w_host = to_floats(layer.weight());

    Linear::Saved saved;
    {
      Fp8Autocast scope(recipe, registry);
      layer.forward(x, saved);
      // The casts of this step use the scales of the steps before it (the first: their own).
      EXPECT_EQ(codes_off(saved.input_q.data, x_host, forward.cast_scale(0, host_amax(x_host)),
                          in_dtype),
                0);
      EXPECT_EQ(codes_off(saved.snapshot.weight->q.data, w_host,
                          forward.cast_scale(1, host_amax(w_host)), in_dtype),
                0);
    }  // the scope's end is the forward update
    forward.record(0, host_amax(x_host));
    forward.record(1, host_amax(w_host));
    forward.update();
    const FP8State& state = *layer.fp8_state();
    EXPECT_EQ(to_floats(state.group(Pass::forward).scale), forward.scale);

    CastStats dy_cast;
    layer.measure_grad_output(&dy_cast);
    layer.backward(dy, saved);
    layer.measure_grad_output(nullptr);
    EXPECT_EQ(dy_cast.scale, backward.cast_scale(0, host_amax(dy_host)));
    registry.finalize_backward();
    backward.record(0, host_amax(dy_host));
    backward.update();
    EXPECT_EQ(to_floats(state.group(Pass::backward).scale), backward.scale);
    // The history holds the same window (octet shifts rows down, TE rolls them up: the same
    // values in another order).
    for (Pass pass : {Pass::forward, Pass::backward}) {
      std::vector<float> got = to_floats(state.group(pass).amax_history);
      std::vector<float> want = pass == Pass::forward ? forward.history : backward.history;
      std::sort(got.begin(), got.end());
      std::sort(want.begin(), want.end());
      EXPECT_EQ(got, want);
    }

    // The optimizer moves the weight (its amax too): the next forward casts it again.
    std::vector<float> w = w_host;
    const std::vector<float> step =
        to_floats(testing::random_tensor({kOut, kIn}, DType::f32, seed + 10 * t + 2, 0.05f));
    for (size_t i = 0; i < w.size(); ++i) w[i] += step[i] * static_cast<float>(t % 3);
    Tensor(layer.weight()).copy_from(Tensor::from_vector(w, {kOut, kIn}));
    layer.on_weights_updated();
  }
  EXPECT_EQ(layer.fp8_state()->forward_updates(), static_cast<int64_t>(x_scale.size()));
  EXPECT_EQ(layer.fp8_state()->backward_updates(), static_cast<int64_t>(x_scale.size()));
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, DelayedReferenceTest,
    ::testing::Values(ReferenceCase{"te_defaults", Recipe::delayed()},
                      ReferenceCase{"history3_margin1", Recipe::delayed(1, 3)},
                      ReferenceCase{"history4_most_recent_e4m3",
                                    Recipe::delayed(0, 4, AmaxAlgo::most_recent,
                                                    fp8::Fp8Format::e4m3)},
                      ReferenceCase{"history1", Recipe::delayed(0, 1)}),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace octet::nn
