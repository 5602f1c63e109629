// The gradient-anomaly guard: its band on synthetic norms (quiet noise and drift never flag; a
// 1e4x spike flags its layer and microbatch; a lasting change of level stops flagging within a
// few steps), and in training runs (an injected spike is flagged, and skipped with --guard-skip
// leaving every state as before; a normal run of the tiny model is never flagged; on a GPU, the
// 14-layer x 64-microbatch soak of every recipe, with and without recompute, is never flagged).
// The tiny model's 300 normal steps with the guard on are tests/train/soak_test.cc's.
#include "octet/train/guard.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "octet/core/device.h"
#include "octet/train/trainer.h"
#include "train/run_checks.h"
#include "train/scratch_dir.h"

namespace octet::train {
namespace {

using octet::testing::expect_same_tensors;
using octet::testing::micro_run;
using octet::testing::scratch_dir;
using octet::testing::step_lines;

constexpr int64_t kGroups = 4, kMicro = 3;
constexpr double kNoise = 0.3;

/// Synthetic squared norms of one step: group g's level falls slowly (as gradient norms do while
/// the loss falls), carries log-normal noise of `noise` per step, and grows with the microbatches
/// accumulated (sqrt(m + 1)) with a little noise of its own.
std::vector<float> synthetic_step(int64_t step, double noise, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> norm_sq(kGroups * kMicro);
  for (int64_t g = 0; g < kGroups; ++g) {
    const double level = -1.0 - 0.5 * static_cast<double>(g) - 0.002 * static_cast<double>(step) +
                         noise * normal(rng);
    for (int64_t m = 0; m < kMicro; ++m) {
      const double log_norm =
          level + 0.5 * std::log(static_cast<double>(m + 1)) + 0.2 * noise * normal(rng);
      norm_sq[m * kGroups + g] = static_cast<float>(std::exp(2.0 * log_norm));
    }
  }
  return norm_sq;
}

GradientGuard make_guard() {
  return GradientGuard({"wte", "blocks.0", "blocks.1", "final_norm"}, kMicro);
}

TEST(GradientGuard, QuietNoiseAndDriftNeverFlagAndASpikeFlagsItsLayerAndMicrobatch) {
  const uint64_t seed = octet::testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  GradientGuard guard = make_guard();
  constexpr int64_t kSpikeStep = 400;
  // Log noise of 0.3 per step: what the tiny model's per-layer norms show at batch 4 x 32.
  for (int64_t step = 1; step <= 600; ++step) {
    std::vector<float> norm_sq = synthetic_step(step, kNoise, rng);
    if (step == kSpikeStep) {
      // blocks.0's gradient times 1e4 from microbatch 1 on: squared norms times 1e8.
      for (int64_t m = 1; m < kMicro; ++m) norm_sq[m * kGroups + 1] *= 1e8f;
    }
    const std::vector<GuardFlag> flags = guard.observe(step, norm_sq);
    if (step != kSpikeStep) {
      EXPECT_TRUE(flags.empty()) << "step " << step << ": " << flags[0].layer << " z "
                                 << flags[0].z;
      continue;
    }
    ASSERT_EQ(flags.size(), 1u);
    EXPECT_GE(guard.max_z(), flags[0].z);
    EXPECT_EQ(flags[0].step, kSpikeStep);
    EXPECT_EQ(flags[0].layer, "blocks.0");
    EXPECT_EQ(flags[0].microbatch, 1);
    EXPECT_GT(flags[0].z, 20.0);  // log(1e4) = 9.2 against a band std of about 0.3
    EXPECT_GT(flags[0].norm, 1e3 * flags[0].band_norm);
  }
}

TEST(GradientGuard, ALastingChangeOfLevelStopsFlaggingWithinAFewSteps) {
  const uint64_t seed = octet::testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  GradientGuard guard = make_guard();
  for (int64_t step = 1; step <= 100; ++step)
    ASSERT_TRUE(guard.observe(step, synthetic_step(step, kNoise, rng)).empty());
  // Every norm 100x larger from step 101 on: flagged at first, then learned (winsorized updates).
  int64_t last_flagged = 0;
  for (int64_t step = 101; step <= 200; ++step) {
    std::vector<float> norm_sq = synthetic_step(step, kNoise, rng);
    for (float& v : norm_sq) v *= 1e4f;
    if (!guard.observe(step, norm_sq).empty()) last_flagged = step;
  }
  EXPECT_GE(last_flagged, 101);
  EXPECT_LE(last_flagged, 101 + 5);
}

TEST(GradientGuard, WarmupNonFiniteAndZeroNormsNeverFlag) {
  GradientGuard guard({"blocks.0"}, 1, GuardConfig{.warmup = 5});
  // Wild values while warming up (the band is the plain mean and variance of these).
  for (int64_t step = 1; step <= 5; ++step)
    EXPECT_TRUE(guard.observe(step, std::vector<float>{std::pow(10.0f, 2.0f * step)}).empty());
  for (float v : {0.0f, NAN, INFINITY})
    EXPECT_TRUE(guard.observe(6, std::vector<float>{v}).empty()) << v;
  EXPECT_THROW(guard.observe(7, std::vector<float>{1.0f, 2.0f}), Error);
  EXPECT_THROW(GradientGuard({"x"}, 1, GuardConfig{.z = 0}), Error);
}

TEST(GradientGuard, LayerGroups) {
  EXPECT_EQ(layer_group("wte"), "wte");
  EXPECT_EQ(layer_group("blocks.13.attn.qkv.weight"), "blocks.13");
  EXPECT_EQ(layer_group("blocks.2.norm1.gamma"), "blocks.2");
  EXPECT_EQ(layer_group("final_norm.beta"), "final_norm");
  EXPECT_EQ(layer_group("lm_head"), "lm_head");
}

// ----------------------------------------------------------------------------
// In training runs

class GuardRun : public ::testing::TestWithParam<std::string> {};

/// The tiny model (2 layers, dim 128) with the guard on for 50 steps, the band built over the
/// first 20. At batch 4 x 32 its band's std (in log units) is about 0.8 at step 20, while the
/// loss falls fast, and 0.55 by step 50 (0.25 by step 100); the 1-layer micro model of micro_run,
/// at 32 tokens a microbatch, is too noisy to show a margin.
TrainOptions guarded_run(const std::filesystem::path& out, const std::string& device) {
  TrainOptions o = micro_run(out, device);
  o.layers = 0;
  o.dim = 0;
  o.heads = 0;
  o.ffn = 0;
  o.batch = 4;
  o.seq = 32;
  o.steps = 50;
  o.guard = true;
  return o;
}

TEST_P(GuardRun, AnInjectedSpikeIsFlaggedAndSkippedWhenAsked) {
  const std::string device = GetParam();
  OCTET_SKIP_WITHOUT(device);
  const auto dir = scratch_dir();
  // blocks.1's gradient times 1e4 after step 50's second microbatch.
  const std::string spike = "spike-grad@50:1/1";
  TrainOptions flagged = guarded_run(dir / "flag", device);
  flagged.inject = spike;
  run_train(flagged);
  const auto lines = step_lines(dir / "flag" / "metrics.jsonl");
  ASSERT_EQ(lines.size(), 50u);
  for (const auto& line : lines) {
    EXPECT_FALSE(line.contains("skipped")) << line;
    if (line["step"] != 50) {
      EXPECT_FALSE(line.contains("guard")) << line;
      continue;
    }
    ASSERT_TRUE(line.contains("guard")) << line;
    ASSERT_EQ(line["guard"].size(), 1u) << line;
    EXPECT_EQ(line["guard"][0]["layer"], "blocks.1");
    EXPECT_EQ(line["guard"][0]["microbatch"], 1);
    // log(1e4) = 9.2 against a band std of about 0.55: z about 16, twice the threshold.
    EXPECT_GT(line["guard"][0]["z"].get<double>(), 1.5 * GuardConfig{}.z);
  }

  // --guard-skip: the flagged step is skipped and leaves the state of step 49.
  TrainOptions clean = guarded_run(dir / "clean", device);
  clean.steps = 49;
  run_train(clean);
  TrainOptions skipped = guarded_run(dir / "skip", device);
  skipped.guard_skip = true;
  skipped.inject = spike;
  run_train(skipped);
  const auto skip_lines = step_lines(dir / "skip" / "metrics.jsonl");
  ASSERT_EQ(skip_lines.size(), 50u);
  EXPECT_EQ(skip_lines[49]["skip_reason"], "gradient guard");
  EXPECT_EQ(skip_lines[49]["guard"][0]["layer"], "blocks.1");
  expect_same_tensors(dir / "clean" / "checkpoint.safetensors",
                      dir / "skip" / "checkpoint.safetensors");
}

INSTANTIATE_TEST_SUITE_P(Devices, GuardRun, ::testing::ValuesIn(octet::testing::run_devices()),
                         [](const auto& info) { return info.param == "cpu" ? "cpu" : "cuda0"; });

/// Runs `o` and expects no step flagged or skipped, and a finite loss throughout; prints the
/// largest guard z of the run (how close it came to a flag).
void expect_never_flagged(const TrainOptions& o) {
  run_train(o);
  const auto lines = step_lines(std::filesystem::path(o.out) / "metrics.jsonl");
  ASSERT_EQ(static_cast<int64_t>(lines.size()), o.steps);
  double max_z = 0;
  for (const auto& line : lines) {
    EXPECT_FALSE(line.contains("guard")) << line;
    EXPECT_FALSE(line.contains("skipped")) << line;
    EXPECT_TRUE(line["loss"].is_number()) << line;
    ASSERT_TRUE(line.contains("guard_z")) << line;
    max_z = std::max(max_z, line["guard_z"].get<double>());
  }
  std::printf("%s %s: largest guard z %.2f (flags above %.1f)\n", o.precision.c_str(),
              o.recompute ? "with recompute" : "", max_z, o.guard_z);
}

// The field-notes soak: 14 layers, 64 microbatches per step, with and without recompute, never
// flagged. GPU only (hours on the CPU). The suite runs the field notes' own case (delayed scaling
// with recompute) on every GPU check, 25 steps of 64 microbatches; OCTET_GPU_SOAK=1 adds every
// other recipe, with and without recompute (docs/RELIABILITY.md, "Soak").
class GuardGpuSoak : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

TEST_P(GuardGpuSoak, FourteenLayersBy64MicrobatchesIsNeverFlagged) {
  OCTET_SKIP_WITHOUT("cuda:0");
  const auto& [precision, recompute] = GetParam();
  if (!(precision == "fp8-delayed" && recompute) && std::getenv("OCTET_GPU_SOAK") == nullptr)
    GTEST_SKIP() << "set OCTET_GPU_SOAK=1 for every recipe";
  const uint64_t seed = octet::testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  TrainOptions o;
  o.device = "cuda:0";
  o.precision = precision;
  o.model = "gpt2-124m";
  o.layers = 14;
  o.dim = 384;  // multiples of 128 for the block recipes
  o.heads = 6;
  o.ffn = 1536;
  o.steps = GuardConfig{}.warmup + 5;
  o.batch = 2;
  o.seq = 128;
  o.accum = 64;
  o.recompute = recompute;
  o.seed = seed;
  o.out = scratch_dir().string();
  o.eval_batches = 1;
  o.fp8_stats_every = 0;
  o.guard = true;
  expect_never_flagged(o);
}

INSTANTIATE_TEST_SUITE_P(Recipes, GuardGpuSoak,
                         ::testing::Combine(::testing::Values("fp8-delayed", "fp8-current",
                                                              "fp8-block", "fp8-mxfp8", "bf16"),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           std::string name = std::get<0>(info.param) +
                                              (std::get<1>(info.param) ? "_recompute" : "");
                           for (char& c : name)
                             if (c == '-') c = '_';
                           return name;
                         });

}  // namespace
}  // namespace octet::train
