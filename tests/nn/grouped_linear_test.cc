// nn::GroupedLinear: every expert's forward, backward and FP8 state are bitwise those of its own
// nn::Linear run alone, under BF16 and every FP8 recipe; delayed scaling records one amax per
// expert; activation recompute is bitwise no recompute; a fused FP8 input is bitwise the unfused
// one, its experts' casts carved from one allocation; and on a GPU, runs at the field shape of
// FIELD-NOTES section 3 repeat byte for byte.
#include "octet/nn/grouped_linear.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "nn/nn_check.h"
#include "octet/nn/autocast.h"
#include "octet/ops/grouped_gemm.h"
#include "octet/ops/quantize.h"
#include "test_util.h"

namespace octet::nn {
namespace {

using fp8::Recipe;
using fp8::TensorRole;
using testing::bitwise_equal;
using testing::fresh_seed;
using testing::state_tensors;

constexpr int64_t kIn = 64;
constexpr int64_t kOut = 48;
constexpr int64_t kRowUnit = 16;  // the FP8 GEMM alignment the dispatch pads each group to
/// Row units per expert: uneven, one expert empty.
const std::vector<int64_t> kUnits = {2, 0, 5, 1};

std::vector<int64_t> offsets_of(const std::vector<int64_t>& units, int64_t unit = kRowUnit) {
  std::vector<int64_t> offsets{0};
  for (int64_t u : units) offsets.push_back(offsets.back() + u * unit);
  return offsets;
}

/// BF16 (no autocast, bf16 compute) or an FP8 recipe.
using Precision = std::optional<Recipe>;
using Param = std::tuple<Device, Precision>;

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  const auto& [device, precision] = info.param;
  std::string name = precision ? precision->name() : std::string("bf16");
  std::replace_if(name.begin(), name.end(), [](char c) { return !std::isalnum(c); }, '_');
  return testing::device_name(device) + "_" + name;
}

std::vector<Param> all_params() {
  std::vector<Param> params;
  for (const Device& d : testing::all_backends())
    for (const Precision& p : {Precision{}, Precision{Recipe::delayed()},
                               Precision{Recipe::current()}, Precision{Recipe::block()},
                               Precision{Recipe::mxfp8()}})
      params.emplace_back(d, p);
  return params;
}

/// Runs `forward` under the precision's autocast (a forward pass is one scope).
template <typename Forward>
Tensor forward_under(const Precision& precision, AmaxRegistry& registry, Forward&& forward) {
  if (!precision) return forward();
  Fp8Autocast scope(*precision, registry);
  return forward();
}

/// The reference: the experts as separate Linears, each run on its rows.
struct Reference {
  std::vector<Linear> experts;
  AmaxRegistry registry;

  Reference(int64_t n, const Device& device, uint64_t seed, DType compute) {
    for (int64_t g = 0; g < n; ++g)
      experts.emplace_back(kIn, kOut, true, device, GroupedLinear::seed_of_expert(seed, g),
                           compute);
  }
  /// One training step; returns y and dx as [rows, *].
  std::pair<Tensor, Tensor> step(const Precision& p, const Tensor& x, const Tensor& dy,
                                 const std::vector<int64_t>& offsets) {
    Tensor y = Tensor::empty({x.rows(), kOut}, x.dtype(), x.device());
    Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
    std::vector<Linear::Saved> saved(experts.size());
    forward_under(p, registry, [&] {
      for (size_t g = 0; g < experts.size(); ++g) {
        if (offsets[g + 1] == offsets[g]) continue;
        y.slice(offsets[g], offsets[g + 1])
            .copy_from(experts[g].forward(x.slice(offsets[g], offsets[g + 1]), saved[g]));
      }
      return Tensor();
    });
    for (size_t g = 0; g < experts.size(); ++g) {
      if (offsets[g + 1] == offsets[g]) continue;
      dx.slice(offsets[g], offsets[g + 1])
          .copy_from(experts[g].backward(dy.slice(offsets[g], offsets[g + 1]), saved[g]));
    }
    if (p) registry.finalize_backward();
    return {y, dx};
  }
};

/// One training step of the grouped layer (with or without recompute); returns y and dx.
std::pair<Tensor, Tensor> grouped_step(GroupedLinear& layer, AmaxRegistry& registry,
                                       const Precision& p, const Tensor& x, const Tensor& dy,
                                       const std::vector<int64_t>& offsets, bool recompute) {
  GroupedLinear::Saved saved;
  Tensor y = forward_under(p, registry, [&] { return layer.forward(x, offsets, saved); });
  if (!recompute) {
    Tensor dx = layer.backward(dy, saved);
    if (p) registry.finalize_backward();
    return {y, dx};
  }
  GroupedLinear::Saved rebuilt = saved.snapshot_only();
  saved = GroupedLinear::Saved{};  // nothing of the original record survives but the snapshot
  const Tensor y_again = layer.forward(x, offsets, rebuilt, ForwardMode::recompute);
  EXPECT_TRUE(bitwise_equal(y, y_again)) << "recomputed forward";
  Tensor dx = layer.backward(dy, rebuilt);
  if (p) registry.finalize_backward();
  return {y, dx};
}

/// Every byte a step leaves behind in an expert: gradients and FP8 state.
std::vector<Tensor> expert_bytes(const Linear& e) {
  std::vector<Tensor> out{e.grad_weight(), e.grad_bias()};
  if (e.fp8_state()) {
    for (const Tensor& t : state_tensors(*e.fp8_state())) out.push_back(t);
  }
  return out;
}

void expect_experts_equal(const std::vector<Linear>& expected, const GroupedLinear& got) {
  for (size_t g = 0; g < expected.size(); ++g) {
    const std::vector<Tensor> a = expert_bytes(expected[g]);
    const std::vector<Tensor> b = expert_bytes(got.expert(static_cast<int64_t>(g)));
    ASSERT_EQ(a.size(), b.size()) << "expert " << g << " FP8 state presence";
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(bitwise_equal(a[i], b[i])) << "expert " << g << " tensor " << i;
  }
}

class GroupedLinearTest : public ::testing::TestWithParam<Param> {};

TEST_P(GroupedLinearTest, EachExpertIsBitwiseItsOwnLinear) {
  const auto& [device, precision] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  const std::vector<int64_t> offsets = offsets_of(kUnits);
  const int64_t experts = static_cast<int64_t>(kUnits.size());
  const DType compute = precision ? DType::f32 : DType::bf16;
  GroupedLinear layer(experts, kIn, kOut, true, device, seed, compute);
  AmaxRegistry registry;
  Reference ref(experts, device, seed, compute);
  // Two steps: delayed scaling's first calibrates, its second casts with the updated scales.
  for (int step = 0; step < 2; ++step) {
    const Tensor x = testing::random_tensor({offsets.back(), kIn}, DType::bf16, seed + 10 * step,
                                            2.0f).to(device);
    const Tensor dy = testing::random_tensor({offsets.back(), kOut}, DType::bf16,
                                             seed + 10 * step + 1).to(device);
    const auto [y, dx] = grouped_step(layer, registry, precision, x, dy, offsets, false);
    const auto [y_ref, dx_ref] = ref.step(precision, x, dy, offsets);
    EXPECT_TRUE(bitwise_equal(y_ref, y)) << "y, step " << step;
    EXPECT_TRUE(bitwise_equal(dx_ref, dx)) << "dx, step " << step;
  }
  expect_experts_equal(ref.experts, layer);
  EXPECT_EQ(layer.expert(1).fp8_state(), nullptr) << "the empty expert ran nothing";
}

TEST_P(GroupedLinearTest, RecomputeIsBitwiseNoRecompute) {
  const auto& [device, precision] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  const std::vector<int64_t> offsets = offsets_of(kUnits);
  const int64_t experts = static_cast<int64_t>(kUnits.size());
  const DType compute = precision ? DType::f32 : DType::bf16;
  GroupedLinear plain(experts, kIn, kOut, true, device, seed, compute);
  GroupedLinear recomputed(experts, kIn, kOut, true, device, seed, compute);
  AmaxRegistry plain_registry, recompute_registry;
  for (int step = 0; step < 3; ++step) {
    const Tensor x = testing::random_tensor({offsets.back(), kIn}, DType::bf16, seed + 10 * step,
                                            3.0f).to(device);
    const Tensor dy = testing::random_tensor({offsets.back(), kOut}, DType::bf16,
                                             seed + 10 * step + 1).to(device);
    const auto [y0, dx0] = grouped_step(plain, plain_registry, precision, x, dy, offsets, false);
    const auto [y1, dx1] =
        grouped_step(recomputed, recompute_registry, precision, x, dy, offsets, true);
    EXPECT_TRUE(bitwise_equal(dx0, dx1)) << "dx, step " << step;
  }
  std::vector<Linear> plain_experts;
  for (int64_t g = 0; g < experts; ++g) {
    const std::vector<Tensor> a = expert_bytes(plain.expert(g));
    const std::vector<Tensor> b = expert_bytes(recomputed.expert(g));
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(bitwise_equal(a[i], b[i])) << "expert " << g << " tensor " << i;
    if (precision && plain.expert(g).fp8_state()) {  // recompute updated nothing
      EXPECT_EQ(plain.expert(g).fp8_state()->forward_updates(),
                recomputed.expert(g).fp8_state()->forward_updates());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, GroupedLinearTest, ::testing::ValuesIn(all_params()),
                         param_name);

class GroupedLinearDevice : public ::testing::TestWithParam<Device> {};

TEST_P(GroupedLinearDevice, DelayedScalingRecordsOneAmaxPerExpert) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  const std::vector<int64_t> offsets = offsets_of(kUnits);
  GroupedLinear layer(static_cast<int64_t>(kUnits.size()), kIn, kOut, false, device, seed);
  AmaxRegistry registry;
  // Expert g's rows scaled by g + 1, so every expert sees another amax.
  std::vector<float> values =
      testing::to_floats(testing::random_tensor({offsets.back(), kIn}, DType::f32, seed));
  std::vector<float> expected(kUnits.size(), 0.0f);
  for (size_t g = 0; g < kUnits.size(); ++g) {
    for (int64_t i = offsets[g] * kIn; i < offsets[g + 1] * kIn; ++i) {
      values[static_cast<size_t>(i)] *= static_cast<float>(g + 1);
      expected[g] = std::max(expected[g], std::fabs(values[static_cast<size_t>(i)]));
    }
  }
  const Tensor x = Tensor::from_vector(values, {offsets.back(), kIn}).to(device);
  GroupedLinear::Saved saved;
  {
    Fp8Autocast scope(Recipe::delayed(), registry);
    layer.forward(x, offsets, saved);
  }
  for (size_t g = 0; g < kUnits.size(); ++g) {
    const auto& state = layer.expert(static_cast<int64_t>(g)).fp8_state();
    if (offsets[g + 1] == offsets[g]) {
      EXPECT_EQ(state, nullptr) << "expert " << g << " had no rows";
      continue;
    }
    ASSERT_NE(state, nullptr);
    EXPECT_EQ(state->forward_updates(), 1) << "expert " << g;
    EXPECT_EQ(testing::to_floats(state->last_amax(TensorRole::input))[0], expected[g])
        << "expert " << g << "'s input amax is the amax of its own rows";
  }
}

TEST_P(GroupedLinearDevice, FusedInputIsBitwiseTheUnfusedInput) {
  const Device device = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  const std::vector<int64_t> offsets = offsets_of(kUnits);
  const int64_t experts = static_cast<int64_t>(kUnits.size());
  const Precision delayed = Recipe::delayed();
  GroupedLinear unfused(experts, kIn, kOut, true, device, seed);
  GroupedLinear fused(experts, kIn, kOut, true, device, seed);
  AmaxRegistry unfused_registry, fused_registry;
  for (int step = 0; step < 2; ++step) {
    const Tensor x = testing::random_tensor({offsets.back(), kIn}, DType::bf16, seed + step)
                         .to(device);
    const Tensor dy = testing::random_tensor({offsets.back(), kOut}, DType::bf16, seed + 7 + step)
                          .to(device);
    const auto [y0, dx0] = grouped_step(unfused, unfused_registry, delayed, x, dy, offsets, false);
    GroupedLinear::Saved saved;
    Tensor y1;
    {
      Fp8Autocast scope(*delayed, fused_registry);
      auto targets = fused.fused_input(offsets, DType::bf16, saved);
      EXPECT_EQ(targets.has_value(), step > 0) << "only calibrated states take a fused input";
      if (targets) {
        for (size_t g = 0; g < targets->size(); ++g) {
          if ((*targets)[g].out == nullptr) continue;
          ops::quantize(x.slice(offsets[g], offsets[g + 1]), *(*targets)[g].out,
                        (*targets)[g].args);  // the producer's write
        }
      }
      y1 = fused.forward(targets ? Tensor() : x, offsets, saved);
    }
    if (step > 0) {  // the fused casts are carved from one allocation per kind of buffer
      const fp8::QuantizedTensor& first = saved.experts.front().input_q;
      for (size_t g = 1; g < kUnits.size(); ++g) {
        if (kUnits[g] == 0) continue;
        EXPECT_EQ(saved.experts[g].input_q.data.storage(), first.data.storage()) << "expert " << g;
        EXPECT_EQ(saved.experts[g].input_q.data_t.storage(), first.data_t.storage())
            << "expert " << g;
      }
    }
    const Tensor dx1 = fused.backward(dy, saved);
    fused_registry.finalize_backward();
    EXPECT_TRUE(bitwise_equal(y0, y1)) << "step " << step;
    EXPECT_TRUE(bitwise_equal(dx0, dx1)) << "step " << step;
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, GroupedLinearDevice,
                         ::testing::ValuesIn(testing::all_backends()),
                         [](const auto& info) { return testing::device_name(info.param); });

// ----------------------------------------------------------------------------
// Repeatability at the field shape (FIELD-NOTES section 3: 16 experts x 1024 tokens x 2048)

constexpr int64_t kFieldExperts = 16;
constexpr int64_t kFieldTokensPerExpert = 1024;
constexpr int64_t kFieldHidden = 2048;
/// Runs compared at the field shape (each builds fresh experts, most of a run's time; float
/// atomics at this shape differ on almost every run); OCTET_TEST_REPEATS asks for more.
constexpr int kFieldRuns = 3;

/// Bytes of dx, every dW and db and every FP8 state after two steps from fixed inputs.
std::vector<std::vector<uint8_t>> field_run(const Precision& p, uint64_t seed,
                                            const std::vector<int64_t>& offsets,
                                            const std::vector<std::pair<Tensor, Tensor>>& steps) {
  GroupedLinear layer(kFieldExperts, kFieldHidden, kFieldHidden, true, Device::cuda(0), seed,
                      p ? DType::f32 : DType::bf16);
  AmaxRegistry registry;
  std::vector<std::vector<uint8_t>> bytes;
  for (const auto& [x, dy] : steps) {
    const auto [y, dx] = grouped_step(layer, registry, p, x, dy, offsets, false);
    const std::vector<float> dx_values = testing::to_floats(dx);
    EXPECT_TRUE(std::all_of(dx_values.begin(), dx_values.end(),
                            [](float v) { return std::isfinite(v); }))
        << "dx is finite";
    bytes.push_back(testing::to_bytes(dx));
  }
  for (int64_t g = 0; g < kFieldExperts; ++g)
    for (const Tensor& t : expert_bytes(layer.expert(g))) bytes.push_back(testing::to_bytes(t));
  return bytes;
}

class GroupedLinearRepeatability : public ::testing::TestWithParam<Precision> {};

TEST_P(GroupedLinearRepeatability, FieldShapeRepeatsByteForByte) {
  OCTET_SKIP_IF_UNAVAILABLE(Device::cuda(0));
  if (testing::small_tests_only()) GTEST_SKIP() << "OCTET_TEST_SMALL: the field shape is large";
  const uint64_t seed = fresh_seed();
  std::printf("grouped GEMM path: %s\n", ops::grouped_gemm_path(Device::cuda(0)).c_str());
  const std::vector<int64_t> offsets =
      offsets_of(std::vector<int64_t>(kFieldExperts, 1), kFieldTokensPerExpert);
  const auto steps = testing::two_step_inputs(offsets.back(), kFieldHidden, seed);
  const auto first = field_run(GetParam(), seed, offsets, steps);
  const int runs = testing::repeats(kFieldRuns);
  int differing = 0;
  for (int r = 1; r < runs; ++r) {
    if (field_run(GetParam(), seed, offsets, steps) != first) ++differing;
  }
  EXPECT_EQ(differing, 0) << differing << " of " << runs - 1
                          << " repeats differ from the first in dx, a dW/db or an FP8 state";
}

INSTANTIATE_TEST_SUITE_P(Gpu, GroupedLinearRepeatability,
                         ::testing::Values(Precision{Recipe::delayed()}, Precision{}),
                         [](const auto& info) { return info.param ? "fp8_delayed" : "bf16"; });

}  // namespace
}  // namespace octet::nn
