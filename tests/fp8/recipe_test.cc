// Recipes (dtypes, modes, names, validation) and the per-tensor scaling ops on every backend:
// the CPU against hand-derived values and an independent reference, CUDA against the CPU bitwise.
#include "octet/fp8/recipe.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "octet/ops/scaling.h"
#include "test_util.h"

namespace octet {
namespace {

using fp8::AmaxAlgo;
using fp8::Fp8Format;
using fp8::Recipe;
using fp8::RecipeKind;
using fp8::ScalingMode;
using fp8::TensorRole;
using testing::error_of;
using ::testing::HasSubstr;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr TensorRole kRoles[] = {TensorRole::input, TensorRole::weight, TensorRole::grad_output};

// ---------------------------------------------------------------------------------------------
// Recipes

TEST(Recipe, DelayedDefaultsFollowTransformerEngine) {
  const Recipe r = Recipe::delayed();
  EXPECT_EQ(r.kind, RecipeKind::delayed);
  EXPECT_EQ(r.margin, 0);
  EXPECT_EQ(r.format, Fp8Format::hybrid);
  EXPECT_EQ(r.amax_history_len, 1024);
  EXPECT_EQ(r.amax_compute_algo, AmaxAlgo::max);
  EXPECT_NO_THROW(r.validate());
  const Recipe custom = Recipe::delayed(2, 16, AmaxAlgo::most_recent, Fp8Format::e4m3);
  EXPECT_EQ(custom.margin, 2);
  EXPECT_EQ(custom.amax_history_len, 16);
  EXPECT_EQ(custom.amax_compute_algo, AmaxAlgo::most_recent);
  EXPECT_EQ(custom.format, Fp8Format::e4m3);
  EXPECT_EQ(Recipe::current(true).power_of_2_scales, true);
  EXPECT_EQ(Recipe::current().power_of_2_scales, false);
}

struct RoleExpectation {
  Recipe recipe;
  DType dtype[3];  // input, weight, grad_output
  ScalingMode mode[3];
};

TEST(Recipe, DtypesAndModesPerRole) {
  constexpr auto e4 = DType::e4m3, e5 = DType::e5m2;
  constexpr auto pt = ScalingMode::per_tensor, b1 = ScalingMode::block_1x128,
                 b128 = ScalingMode::block_128x128, mx = ScalingMode::mxfp8_1x32;
  const RoleExpectation table[] = {
      {Recipe::delayed(), {e4, e4, e5}, {pt, pt, pt}},
      {Recipe::delayed(0, 1024, AmaxAlgo::max, Fp8Format::e4m3), {e4, e4, e4}, {pt, pt, pt}},
      {Recipe::current(), {e4, e4, e5}, {pt, pt, pt}},
      {Recipe::current(false, Fp8Format::e4m3), {e4, e4, e4}, {pt, pt, pt}},
      {Recipe::block(), {e4, e4, e4}, {b1, b128, b1}},
      {Recipe::mxfp8(), {e4, e4, e4}, {mx, mx, mx}},
  };
  for (const RoleExpectation& row : table) {
    for (int i = 0; i < 3; ++i) {
      SCOPED_TRACE(row.recipe.name() + " " + std::string(fp8::role_name(kRoles[i])));
      EXPECT_EQ(row.recipe.dtype_for(kRoles[i]), row.dtype[i]);
      EXPECT_EQ(row.recipe.mode_for(kRoles[i]), row.mode[i]);
    }
    EXPECT_NO_THROW(row.recipe.validate());
  }
}

TEST(Recipe, RoleNamesAndSlots) {
  EXPECT_EQ(fp8::role_name(TensorRole::input), "input");
  EXPECT_EQ(fp8::role_name(TensorRole::weight), "weight");
  EXPECT_EQ(fp8::role_name(TensorRole::grad_output), "grad_output");
  EXPECT_TRUE(fp8::is_forward_role(TensorRole::weight));
  EXPECT_FALSE(fp8::is_forward_role(TensorRole::grad_output));
  EXPECT_EQ(fp8::role_slot(TensorRole::weight), 1);
  EXPECT_EQ(fp8::role_slot(TensorRole::grad_output), 0);
}

TEST(Recipe, NamesRoundTrip) {
  const Recipe recipes[] = {Recipe::delayed(), Recipe::current(), Recipe::block(), Recipe::mxfp8()};
  const char* names[] = {"fp8-delayed", "fp8-current", "fp8-block", "fp8-mxfp8"};
  for (int i = 0; i < 4; ++i) {
    SCOPED_TRACE(names[i]);
    EXPECT_EQ(recipes[i].name(), names[i]);
    const Recipe back = fp8::recipe_from_name(names[i]);
    EXPECT_EQ(back.kind, recipes[i].kind);
    EXPECT_EQ(back.format, recipes[i].format);
    EXPECT_EQ(back.margin, recipes[i].margin);
    EXPECT_EQ(back.amax_history_len, recipes[i].amax_history_len);
    EXPECT_EQ(back.power_of_2_scales, recipes[i].power_of_2_scales);
  }
  EXPECT_THAT(error_of([] { fp8::recipe_from_name("fp8-tensorwise"); }),
              HasSubstr("unknown recipe 'fp8-tensorwise'; expected fp8-delayed, fp8-current, "
                        "fp8-block or fp8-mxfp8"));
}

TEST(Recipe, ValidateRejectsBadFields) {
  EXPECT_NO_THROW(Recipe::delayed(0, 1).validate());
  EXPECT_NO_THROW(Recipe::delayed(0, 1 << 16).validate());
  EXPECT_NO_THROW(Recipe::delayed(3).validate());
  EXPECT_THAT(error_of([] { Recipe::delayed(0, 0).validate(); }),
              HasSubstr("amax_history_len must be in [1, 65536], got 0"));
  EXPECT_THAT(error_of([] { Recipe::delayed(0, -5).validate(); }),
              HasSubstr("amax_history_len must be in [1, 65536], got -5"));
  EXPECT_THAT(error_of([] { Recipe::delayed(0, (1 << 16) + 1).validate(); }),
              HasSubstr("amax_history_len must be in [1, 65536], got 65537"));
  EXPECT_THAT(error_of([] { Recipe::delayed(-1).validate(); }),
              HasSubstr("margin must be >= 0 (scale is divided by 2^margin), got -1"));
  Recipe bad_format = Recipe::current();
  bad_format.format = static_cast<Fp8Format>(7);
  EXPECT_THAT(error_of([&] { bad_format.validate(); }), HasSubstr("unknown FP8 format code 7"));
  Recipe bad_kind = Recipe::delayed();
  bad_kind.kind = static_cast<RecipeKind>(9);
  EXPECT_THAT(error_of([&] { bad_kind.validate(); }), HasSubstr("unknown recipe kind code 9"));
  // Delayed-scaling fields are ignored (not validated) by the other kinds.
  Recipe block = Recipe::block();
  block.amax_history_len = 0;
  EXPECT_NO_THROW(block.validate());
}

// ---------------------------------------------------------------------------------------------
// Scaling ops: host-side model of a ScalingGroup and an independent reference of the update.

struct HostGroup {
  int64_t len = 0;
  int64_t n = 0;
  float fp8_max = fp8::kE4M3Max;
  std::vector<float> history;  // [len, n]
  std::vector<float> scale;    // [n]
  std::vector<float> scale_inv;

  float& h(int64_t row, int64_t col) { return history[row * n + col]; }
};

/// A random amax spanning many binades (so scales exercise exponent and mantissa bits).
float random_amax(std::mt19937_64& rng) {
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-30, 30);
  return std::ldexp(mantissa(rng), exponent(rng));
}

HostGroup random_group(int64_t len, int64_t n, float fp8_max, std::mt19937_64& rng) {
  HostGroup g;
  g.len = len;
  g.n = n;
  g.fp8_max = fp8_max;
  g.history.resize(len * n);
  for (float& v : g.history) v = random_amax(rng);
  for (int64_t j = 0; j < n; ++j) {
    g.scale.push_back(random_amax(rng));
    g.scale_inv.push_back(1.0f / g.scale.back());
  }
  return g;
}

/// docs/NUMERICS.md "Delayed scaling", written out independently of src/ops/cpu/scaling.cc.
HostGroup reference_update(HostGroup g, int margin, AmaxAlgo algo) {
  for (int64_t j = 0; j < g.n; ++j) {
    float amax = g.h(0, j);
    if (algo == AmaxAlgo::max) {
      bool any_nan = false;
      for (int64_t i = 0; i < g.len; ++i) {
        any_nan |= std::isnan(g.h(i, j));
        amax = std::max(amax, g.h(i, j));
      }
      if (any_nan) amax = kNaN;
    }
    if (std::isfinite(amax) && amax > 0) {
      float s = g.fp8_max / amax;
      s = s * std::exp2(static_cast<float>(-margin));
      g.scale[j] = std::isinf(s) ? FLT_MAX : s;
    }
    g.scale_inv[j] = 1.0f / g.scale[j];
  }
  for (int64_t i = g.len - 1; i >= 1; --i)
    for (int64_t j = 0; j < g.n; ++j) g.h(i, j) = g.h(i - 1, j);
  for (int64_t j = 0; j < g.n; ++j) g.h(0, j) = 0.0f;
  return g;
}

/// A ScalingGroup holding `g` on `device`.
ops::ScalingGroup to_device(const HostGroup& g, const Device& device) {
  ops::ScalingGroup out;
  out.amax_history = Tensor::from_vector(g.history, {g.len, g.n}).to(device);
  out.scale = Tensor::from_vector(g.scale, {g.n}).to(device);
  out.scale_inv = Tensor::from_vector(g.scale_inv, {g.n}).to(device);
  out.fp8_max = g.fp8_max;
  return out;
}

HostGroup to_host(const ops::ScalingGroup& g) {
  HostGroup h;
  h.len = g.amax_history.size(0);
  h.n = g.amax_history.size(1);
  h.fp8_max = g.fp8_max;
  h.history = testing::to_floats(g.amax_history);
  h.scale = testing::to_floats(g.scale);
  h.scale_inv = testing::to_floats(g.scale_inv);
  return h;
}

/// Runs update_delayed_scaling on `device` over copies of `groups` and returns the results.
std::vector<HostGroup> run_update(const std::vector<HostGroup>& groups, const Device& device,
                                  int margin, AmaxAlgo algo) {
  std::vector<ops::ScalingGroup> dev;
  for (const HostGroup& g : groups) dev.push_back(to_device(g, device));
  ops::update_delayed_scaling(dev.data(), static_cast<int>(dev.size()), margin, algo);
  std::vector<HostGroup> out;
  for (const auto& g : dev) out.push_back(to_host(g));
  return out;
}

/// Bitwise equality of two float vectors (NaN payloads and the sign of zero included).
::testing::AssertionResult same_bits(const std::vector<float>& expected,
                                     const std::vector<float>& actual) {
  if (expected.size() != actual.size())
    return ::testing::AssertionFailure()
           << "sizes differ: " << expected.size() << " vs " << actual.size();
  for (size_t i = 0; i < expected.size(); ++i)
    if (fp8::float_bits(expected[i]) != fp8::float_bits(actual[i]))
      return ::testing::AssertionFailure() << "element " << i << ": expected " << std::hexfloat
                                           << expected[i] << ", got " << actual[i];
  return ::testing::AssertionSuccess();
}

void expect_groups_equal(const std::vector<HostGroup>& expected,
                         const std::vector<HostGroup>& actual) {
  ASSERT_EQ(expected.size(), actual.size());
  for (size_t g = 0; g < expected.size(); ++g) {
    SCOPED_TRACE("group " + std::to_string(g));
    EXPECT_TRUE(same_bits(expected[g].history, actual[g].history)) << "amax_history";
    EXPECT_TRUE(same_bits(expected[g].scale, actual[g].scale)) << "scale";
    EXPECT_TRUE(same_bits(expected[g].scale_inv, actual[g].scale_inv)) << "scale_inv";
  }
}

class DelayedScaling : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override { OCTET_SKIP_IF_UNAVAILABLE(GetParam()); }

  /// Runs the update on the backend and checks it against `expected`; on CUDA also against the
  /// CPU backend itself, bitwise.
  void check(const std::vector<HostGroup>& groups, const std::vector<HostGroup>& expected,
             int margin, AmaxAlgo algo) {
    const std::vector<HostGroup> actual = run_update(groups, GetParam(), margin, algo);
    expect_groups_equal(expected, actual);
    if (GetParam().is_cuda())
      expect_groups_equal(run_update(groups, Device::cpu(), margin, algo), actual);
  }

  /// The reference's answer for random groups.
  void check_against_reference(const std::vector<HostGroup>& groups, int margin, AmaxAlgo algo) {
    std::vector<HostGroup> expected;
    for (const HostGroup& g : groups) expected.push_back(reference_update(g, margin, algo));
    check(groups, expected, margin, algo);
  }
};

TEST_P(DelayedScaling, RandomHistoriesMatchReference) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (AmaxAlgo algo : {AmaxAlgo::max, AmaxAlgo::most_recent}) {
    for (int margin : {0, 1, 3}) {
      SCOPED_TRACE("margin " + std::to_string(margin) +
                   (algo == AmaxAlgo::max ? " max" : " most_recent"));
      check_against_reference({random_group(37, 3, fp8::kE4M3Max, rng)}, margin, algo);
    }
  }
}

TEST_P(DelayedScaling, HistoryLengthsOneAnd1024) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int64_t len : {1, 1024}) {
    for (AmaxAlgo algo : {AmaxAlgo::max, AmaxAlgo::most_recent}) {
      SCOPED_TRACE("history_len " + std::to_string(len));
      const std::vector<HostGroup> groups = {random_group(len, 2, fp8::kE5M2Max, rng)};
      check_against_reference(groups, 0, algo);
    }
  }
  // Length 1: the scale comes from row 0 and the roll only zeroes that row.
  HostGroup g;
  g.len = 1;
  g.n = 2;
  g.history = {3.5f, 7.0f};  // 448 / 3.5 = 128, 448 / 7 = 64
  g.scale = {1, 1};
  g.scale_inv = {1, 1};
  HostGroup expected = g;
  expected.history = {0, 0};
  expected.scale = {128, 64};
  expected.scale_inv = {1.0f / 128, 1.0f / 64};
  check({g}, {expected}, 0, AmaxAlgo::max);
}

TEST_P(DelayedScaling, MaxAndMostRecent) {
  HostGroup g;
  g.len = 3;
  g.n = 2;
  g.history = {1.75f,  14.0f,  // row 0: the pass just finished
               3.5f,   7.0f,   // row 1
               0.875f, 3.5f};  // row 2
  g.scale = {1, 1};
  g.scale_inv = {1, 1};
  HostGroup rolled = g;
  rolled.history = {0, 0, 1.75f, 14.0f, 3.5f, 7.0f};

  HostGroup by_max = rolled;
  by_max.scale = {128, 32};  // 448 / 3.5, 448 / 14
  by_max.scale_inv = {1.0f / 128, 1.0f / 32};
  check({g}, {by_max}, 0, AmaxAlgo::max);

  HostGroup by_recent = rolled;
  by_recent.scale = {256, 32};  // 448 / 1.75, 448 / 14
  by_recent.scale_inv = {1.0f / 256, 1.0f / 32};
  check({g}, {by_recent}, 0, AmaxAlgo::most_recent);
}

TEST_P(DelayedScaling, MarginDividesByPowerOfTwo) {
  HostGroup g;
  g.len = 2;
  g.n = 1;
  g.history = {3.5f, 0.0f};
  g.scale = {1};
  g.scale_inv = {1};
  for (int margin : {0, 1, 2, 10}) {
    SCOPED_TRACE("margin " + std::to_string(margin));
    HostGroup expected = g;
    expected.history = {0, 3.5f};
    expected.scale = {std::ldexp(128.0f, -margin)};
    expected.scale_inv = {std::ldexp(1.0f / 128, margin)};
    check({g}, {expected}, margin, AmaxAlgo::max);
  }
}

TEST_P(DelayedScaling, UnusableAmaxKeepsPreviousScale) {
  // Columns: all zero, an inf in the window, a NaN in the window, NaN in row 0 (most_recent).
  HostGroup g;
  g.len = 3;
  g.n = 4;
  g.history = {0, 2.0f, 5.0f, kNaN,  //
               0, kInf, kNaN, 1.0f,  //
               0, 1.0f, 6.0f, 1.0f};
  g.scale = {3.0f, 5.0f, 7.0f, 9.0f};
  g.scale_inv = {0.5f, 0.5f, 0.5f, 0.5f};  // stale on purpose: it is recomputed from the scale
  HostGroup by_max = g;
  by_max.history = {0, 0, 0, 0, 0, 2.0f, 5.0f, kNaN, 0, kInf, kNaN, 1.0f};
  by_max.scale_inv = {1.0f / 3, 1.0f / 5, 1.0f / 7, 1.0f / 9};
  check({g}, {by_max}, 0, AmaxAlgo::max);
  // most_recent reads row 0 only: the inf and NaN further down no longer matter.
  HostGroup by_recent = by_max;
  by_recent.scale = {3.0f, 448.0f / 2.0f, 448.0f / 5.0f, 9.0f};
  by_recent.scale_inv = {1.0f / 3, 1.0f / 224, 1.0f / (448.0f / 5.0f), 1.0f / 9};
  check({g}, {by_recent}, 0, AmaxAlgo::most_recent);
}

TEST_P(DelayedScaling, InfiniteScaleClampsToFltMax) {
  HostGroup g;
  g.len = 1;
  g.n = 2;
  g.history = {0x1p-149f, 0x1p-110f};  // 448 / 2^-149 overflows; 448 * 2^110 does not
  g.scale = {1, 1};
  g.scale_inv = {1, 1};
  HostGroup expected = g;
  expected.history = {0, 0};
  expected.scale = {FLT_MAX, 448.0f * 0x1p110f};
  expected.scale_inv = {1.0f / FLT_MAX, 1.0f / (448.0f * 0x1p110f)};
  check({g}, {expected}, 0, AmaxAlgo::max);
  // The clamp applies after the margin: inf * 2^-1 is still inf.
  check({g}, {[&] {
          HostGroup e = expected;
          e.scale[1] = 224.0f * 0x1p110f;
          e.scale_inv[1] = 1.0f / e.scale[1];
          return e;
        }()},
        1, AmaxAlgo::max);
}

TEST_P(DelayedScaling, RollsHistoryAndZeroesRowZero) {
  HostGroup g;
  g.len = 4;
  g.n = 3;
  for (int i = 0; i < 12; ++i) g.history.push_back(static_cast<float>(i + 1));
  g.scale = {1, 1, 1};
  g.scale_inv = {1, 1, 1};
  const std::vector<HostGroup> out = run_update({g}, GetParam(), 0, AmaxAlgo::max);
  EXPECT_TRUE(same_bits({0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, out[0].history));
  // The oldest row (10, 11, 12) was still part of the max before it dropped off.
  EXPECT_TRUE(same_bits({448.0f / 10, 448.0f / 11, 448.0f / 12}, out[0].scale));
}

TEST_P(DelayedScaling, SeveralGroupsInOneCall) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::vector<HostGroup> groups = {random_group(16, 2, fp8::kE4M3Max, rng),
                                   random_group(16, 1, fp8::kE5M2Max, rng),
                                   random_group(5, 7, fp8::kE4M3Max, rng)};
  groups[2].h(1, 3) = kNaN;  // one poisoned column among healthy ones
  groups[0].h(0, 1) = 0;
  check_against_reference(groups, 2, AmaxAlgo::max);
}

TEST_P(DelayedScaling, NextScaleLeavesTheOldScaleAndLastAmaxKeepsRowZero) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<HostGroup> groups = {random_group(16, 2, fp8::kE4M3Max, rng),
                                         random_group(3, 1, fp8::kE5M2Max, rng)};
  std::vector<ops::ScalingGroup> dev;
  for (const HostGroup& g : groups) {
    ops::ScalingGroup d = to_device(g, GetParam());
    const std::vector<float> poison(static_cast<size_t>(g.n), -1.0f);
    d.next_scale = Tensor::from_vector(poison, {g.n}).to(GetParam());
    d.last_amax = Tensor::from_vector(poison, {g.n}).to(GetParam());
    dev.push_back(d);
  }
  ops::update_delayed_scaling(dev.data(), static_cast<int>(dev.size()), 1, AmaxAlgo::max);
  for (size_t i = 0; i < groups.size(); ++i) {
    SCOPED_TRACE("group " + std::to_string(i));
    const HostGroup expected = reference_update(groups[i], 1, AmaxAlgo::max);
    HostGroup actual = to_host(dev[i]);
    EXPECT_TRUE(same_bits(groups[i].scale, actual.scale)) << "scale is only read";
    actual.scale = testing::to_floats(dev[i].next_scale);
    EXPECT_TRUE(same_bits(expected.scale, actual.scale)) << "next_scale";
    EXPECT_TRUE(same_bits(expected.scale_inv, actual.scale_inv)) << "scale_inv";
    EXPECT_TRUE(same_bits(expected.history, actual.history)) << "amax_history";
    const std::vector<float> row0(groups[i].history.begin(),
                                  groups[i].history.begin() + groups[i].n);
    EXPECT_TRUE(same_bits(row0, testing::to_floats(dev[i].last_amax))) << "last_amax";
  }
}

TEST_P(DelayedScaling, NoGroupsIsANoOp) {
  EXPECT_NO_THROW(ops::update_delayed_scaling(nullptr, 0, 0, AmaxAlgo::max));
}

INSTANTIATE_TEST_SUITE_P(Backends, DelayedScaling, ::testing::ValuesIn(testing::all_backends()),
                         [](const auto& info) { return info.param.is_cpu() ? "cpu" : "cuda0"; });

// ---------------------------------------------------------------------------------------------
// Current scaling

class CurrentScaling : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override { OCTET_SKIP_IF_UNAVAILABLE(GetParam()); }

  /// {scale, scale_inv} computed on `device` from `amax`.
  static std::vector<float> run(const Device& device, float amax, float fp8_max, bool power_of_2) {
    Tensor a = Tensor::from_vector({amax}, {1}).to(device);
    Tensor scale = Tensor::from_vector({-1.0f}, {1}).to(device);
    Tensor scale_inv = Tensor::from_vector({-1.0f}, {1}).to(device);
    ops::compute_current_scale(a, scale, scale_inv, fp8_max, power_of_2);
    return {testing::to_floats(scale)[0], testing::to_floats(scale_inv)[0]};
  }

  void check(float amax, float fp8_max, bool power_of_2, float expected_scale) {
    SCOPED_TRACE(::testing::Message() << "amax " << std::hexfloat << amax << " fp8_max " << fp8_max
                                      << " power_of_2 " << power_of_2);
    const std::vector<float> actual = run(GetParam(), amax, fp8_max, power_of_2);
    EXPECT_TRUE(same_bits({expected_scale, 1.0f / expected_scale}, actual));
    if (GetParam().is_cuda())
      EXPECT_TRUE(same_bits(run(Device::cpu(), amax, fp8_max, power_of_2), actual));
  }
};

TEST_P(CurrentScaling, HandDerivedValues) {
  check(3.5f, fp8::kE4M3Max, false, 128.0f);
  check(3.0f, fp8::kE4M3Max, false, 448.0f / 3.0f);
  check(3.0f, fp8::kE4M3Max, true, 128.0f);  // 149.33 rounds down to 128
  check(1.0f, fp8::kE5M2Max, true, 32768.0f);
  check(0.0f, fp8::kE4M3Max, false, 1.0f);
  check(0.0f, fp8::kE4M3Max, true, 1.0f);
  check(kInf, fp8::kE4M3Max, false, 1.0f);
  check(kNaN, fp8::kE5M2Max, true, 1.0f);
  check(0x1p-149f, fp8::kE4M3Max, false, FLT_MAX);  // overflow clamps
  check(0x1p-149f, fp8::kE4M3Max, true, 0x1p127f);  // FLT_MAX rounded down
}

TEST_P(CurrentScaling, RandomAmaxesMatchReference) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 64; ++i) {
    const float amax = random_amax(rng);
    const float fp8_max = i % 2 ? fp8::kE4M3Max : fp8::kE5M2Max;
    const float exact = fp8_max / amax;
    check(amax, fp8_max, false, exact);
    check(amax, fp8_max, true, std::ldexp(1.0f, std::ilogb(exact)));
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, CurrentScaling, ::testing::ValuesIn(testing::all_backends()),
                         [](const auto& info) { return info.param.is_cpu() ? "cpu" : "cuda0"; });

// ---------------------------------------------------------------------------------------------
// Bad input

ops::ScalingGroup cpu_group(int64_t len, int64_t n) {
  ops::ScalingGroup g;
  g.amax_history = Tensor::zeros({len, n}, DType::f32);
  g.scale = Tensor::zeros({n}, DType::f32);
  g.scale_inv = Tensor::zeros({n}, DType::f32);
  g.fp8_max = fp8::kE4M3Max;
  return g;
}

TEST(ScalingBadInput, DelayedScalingArguments) {
  ops::ScalingGroup ok = cpu_group(4, 2);
  EXPECT_THAT(error_of([&] { ops::update_delayed_scaling(&ok, 1, -1, AmaxAlgo::max); }),
              HasSubstr("update_delayed_scaling: margin must be in [0, 149], got -1"));
  EXPECT_THAT(error_of([&] { ops::update_delayed_scaling(&ok, 1, 150, AmaxAlgo::max); }),
              HasSubstr("margin must be in [0, 149], got 150"));
  EXPECT_THAT(error_of([&] { ops::update_delayed_scaling(&ok, -1, 0, AmaxAlgo::max); }),
              HasSubstr("count must be >= 0, got -1"));
  EXPECT_THAT(error_of([&] { ops::update_delayed_scaling(nullptr, 2, 0, AmaxAlgo::max); }),
              HasSubstr("groups is null but count is 2"));
  EXPECT_THAT(error_of([&] { ops::update_delayed_scaling(&ok, 1, 0, static_cast<AmaxAlgo>(5)); }),
              HasSubstr("unknown amax algorithm code 5"));
}

TEST(ScalingBadInput, DelayedScalingShapesAndDtypes) {
  ops::ScalingGroup groups[2] = {cpu_group(4, 2), cpu_group(4, 3)};
  auto run = [&] { ops::update_delayed_scaling(groups, 2, 0, AmaxAlgo::max); };
  EXPECT_NO_THROW(run());

  groups[1].scale = Tensor::zeros({4}, DType::f32);
  EXPECT_THAT(error_of(run), HasSubstr("group 1 scale must be f32[3], got f32[4] on cpu"));
  groups[1] = cpu_group(4, 3);

  groups[0].scale_inv = Tensor::zeros({2}, DType::bf16);
  EXPECT_THAT(error_of(run), HasSubstr("group 0 scale_inv must be f32[2], got bf16[2] on cpu"));
  groups[0] = cpu_group(4, 2);

  groups[0].amax_history = Tensor::zeros({8}, DType::f32);
  EXPECT_THAT(error_of(run),
              HasSubstr("group 0 amax_history must be f32[history_len >= 1, n >= 1], got "
                        "f32[8] on cpu"));
  groups[0].amax_history = Tensor::zeros({4, 2}, DType::i32);
  EXPECT_THAT(error_of(run), HasSubstr("got i32[4, 2] on cpu"));
  groups[0].amax_history = Tensor::zeros({0, 2}, DType::f32);
  EXPECT_THAT(error_of(run), HasSubstr("got f32[0, 2] on cpu"));
  groups[0].amax_history = Tensor();
  EXPECT_THAT(error_of(run), HasSubstr("group 0 amax_history is an undefined tensor"));
  groups[0] = cpu_group(4, 2);

  groups[1].scale = Tensor();
  EXPECT_THAT(error_of(run), HasSubstr("group 1 scale is an undefined tensor"));
  groups[1] = cpu_group(4, 3);

  groups[1].fp8_max = 0;
  EXPECT_THAT(error_of(run), HasSubstr("fp8_max must be finite and positive"));
  groups[1].fp8_max = kInf;
  EXPECT_THAT(error_of(run), HasSubstr("fp8_max must be finite and positive"));
}

TEST(ScalingBadInput, CurrentScaleArguments) {
  Tensor one = Tensor::zeros({1}, DType::f32);
  Tensor s = Tensor::zeros({1}, DType::f32), si = Tensor::zeros({1}, DType::f32);
  EXPECT_NO_THROW(ops::compute_current_scale(one, s, si, fp8::kE4M3Max, false));
  EXPECT_THAT(error_of([&] {
                ops::compute_current_scale(Tensor::zeros({2}, DType::f32), s, si, 448, false);
              }),
              HasSubstr("compute_current_scale: amax must be f32[1], got f32[2] on cpu"));
  EXPECT_THAT(error_of([&] {
                ops::compute_current_scale(one, Tensor::zeros({1}, DType::i32), si, 448, false);
              }),
              HasSubstr("scale must be f32[1], got i32[1] on cpu"));
  EXPECT_THAT(error_of([&] { ops::compute_current_scale(one, s, Tensor(), 448, false); }),
              HasSubstr("scale_inv is an undefined tensor"));
  EXPECT_THAT(error_of([&] { ops::compute_current_scale(one, s, si, kNaN, false); }),
              HasSubstr("fp8_max must be finite and positive"));
}

TEST(ScalingBadInput, MixedDevices) {
  const Device gpu = Device::cuda(0);
  OCTET_SKIP_IF_UNAVAILABLE(gpu);
  ops::ScalingGroup groups[2] = {cpu_group(4, 2), cpu_group(4, 2)};
  groups[1].scale_inv = groups[1].scale_inv.to(gpu);
  EXPECT_THAT(error_of([&] { ops::update_delayed_scaling(groups, 2, 0, AmaxAlgo::max); }),
              HasSubstr("all tensors must be on one device, got group 0 amax_history f32[4, 2] "
                        "on cpu and group 1 scale_inv f32[2] on cuda:0"));
  Tensor on_cpu = Tensor::zeros({1}, DType::f32);
  Tensor on_gpu = on_cpu.to(gpu);
  EXPECT_THAT(error_of([&] { ops::compute_current_scale(on_gpu, on_cpu, on_cpu, 448, false); }),
              HasSubstr("all tensors must be on one device, got amax f32[1] on cuda:0 and scale "
                        "f32[1] on cpu"));
}

}  // namespace
}  // namespace octet
