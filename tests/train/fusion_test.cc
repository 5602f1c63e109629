// The fused FP8 casts (nn::Fusion) against their unfused paths, end to end: `octet train` runs
// with every fusion on, then with each one off (and with all off), and the checkpoints must be
// equal byte for byte (weights, AdamW moments, every FP8 scale and amax history; see
// expect_same_checkpoint for the one amax recorded earlier by the optimizer) and the logged
// losses equal. The GPU case trains at GPT-2 124M's widths and token count, the shapes at which a
// fused kernel takes its large-shape paths.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "octet/core/device.h"
#include "octet/core/error.h"
#include "octet/nn/fusion.h"
#include "octet/fp8/recipe.h"
#include "octet/train/safetensors.h"
#include "octet/train/trainer.h"
#include "test_util.h"
#include "train/micro_run.h"
#include "train/run_checks.h"
#include "train/scratch_dir.h"

namespace octet::train {
namespace {

namespace fs = std::filesystem;
using nn::Fusion;

/// The newest checkpoint file a run left in `dir`.
fs::path newest_checkpoint(const fs::path& dir) {
  fs::path newest;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const fs::path p = entry.path();
    if (p.extension() == ".safetensors" && (newest.empty() || p.filename() > newest.filename()))
      newest = p;
  }
  return newest;
}

struct Run {
  fs::path checkpoint;
  std::vector<std::string> losses;
};

/// Compares two checkpoints tensor by tensor, byte for byte, and their metadata, with one
/// exception: the weight's slot of each forward amax history's row 0. The optimizer-written
/// cast records the next weight's amax there when it writes the cast; the unfused path records
/// the same amax at the next step's first forward. A checkpoint taken in between holds it or a
/// 0; a run resumed from either casts again and records the same value, so resuming is bitwise
/// the same (tests/train/trainer_test.cc checks resumes bitwise).
void expect_same_checkpoint(const fs::path& a_path, const fs::path& b_path) {
  const SafetensorsFile a = load_safetensors(a_path.string());
  const SafetensorsFile b = load_safetensors(b_path.string());
  // The metadata too, but for the checksums of the tensors compared with that exception.
  auto metadata = [](const SafetensorsFile& f) {
    std::map<std::string, std::string> m = f.metadata();
    std::erase_if(m, [](const auto& kv) { return kv.first.ends_with(".fwd.amax_history"); });
    return m;
  };
  EXPECT_EQ(metadata(a), metadata(b));
  ASSERT_EQ(a.names(), b.names());
  const int weight_slot = fp8::role_slot(fp8::TensorRole::weight);
  for (const std::string& name : a.names()) {
    std::vector<uint8_t> x = testing::to_bytes(a.get(name)), y = testing::to_bytes(b.get(name));
    if (name.ends_with(".fwd.amax_history")) {
      ASSERT_GE(x.size(), sizeof(float) * (weight_slot + 1));
      std::fill_n(x.begin() + sizeof(float) * weight_slot, sizeof(float), 0);
      std::fill_n(y.begin() + sizeof(float) * weight_slot, sizeof(float), 0);
    }
    EXPECT_TRUE(x == y) << name << " differs";
  }
}

Run train_with_fusions_off(TrainOptions o, const std::vector<Fusion>& off, const std::string& tag) {
  o.out = (testing::scratch_dir() / tag).string();
  {
    nn::UnfusedScope scope(off);
    run_train(o);
  }
  const fs::path checkpoint = newest_checkpoint(o.out);
  EXPECT_FALSE(checkpoint.empty()) << "no checkpoint in " << o.out;
  return {checkpoint, testing::loss_lines(fs::path(o.out) / "metrics.jsonl")};
}

/// Trains `o` with all fusions on, then with each off and with all off, and compares.
void expect_fusions_change_nothing(const TrainOptions& o) {
  const Run fused = train_with_fusions_off(o, {}, "fused");
  ASSERT_FALSE(fused.checkpoint.empty());
  ASSERT_EQ(fused.losses.size(), static_cast<size_t>(o.steps));
  std::vector<std::vector<Fusion>> cases;
  for (Fusion f : nn::all_fusions()) cases.push_back({f});
  cases.push_back(nn::all_fusions());
  for (const auto& off : cases) {
    std::string tag = "off";
    for (Fusion f : off) tag += "-" + std::string(nn::fusion_name(f));
    SCOPED_TRACE(tag);
    const Run unfused = train_with_fusions_off(o, off, tag);
    EXPECT_EQ(unfused.losses, fused.losses);
    expect_same_checkpoint(fused.checkpoint, unfused.checkpoint);
  }
}

/// run_checks.h's micro run, two layers wide enough for a 2-head attention, no statistics.
TrainOptions small_run(const std::string& device) {
  TrainOptions o = testing::micro_run(testing::scratch_dir() / "run", device);
  o.layers = 2;
  o.dim = 64;
  o.ffn = 256;
  o.batch = 4;
  o.seq = 32;
  o.steps = 4;
  o.log_every = 1000;
  return o;
}

TEST(FusionEquivalence, EachFusedCastTrainsBitwiseLikeItsUnfusedPathOnTheCpu) {
  // GPT-2 layout: biases, so the fused bias gradients run too.
  expect_fusions_change_nothing(small_run("cpu"));
}

TEST(FusionEquivalence, SwigluModelTrainsBitwiseLikeItsUnfusedPathOnTheCpu) {
  TrainOptions o = small_run("cpu");
  o.model = "llama-1b";
  o.layers = 1;
  o.ffn = 128;
  expect_fusions_change_nothing(o);
}

TEST(FusionEquivalence, FusedCastsAtGpt2SmallShapesOnTheGpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no GPU visible";
  // GPT-2 124M's width, MLP width and tokens per step (16 x 512), on two layers.
  TrainOptions o = small_run("cuda:0");
  o.model = "gpt2-124m";
  o.layers = 2;
  o.dim = 768;
  o.heads = 12;
  o.ffn = 3072;
  o.batch = 16;
  o.seq = 512;
  o.accum = 1;
  o.steps = 3;
  o.lr = 6e-4;
  expect_fusions_change_nothing(o);
}

TEST(FusionEquivalence, FP8StatisticsChangeNoResult) {
  // Statistics steps take the unfused gradient path of fc1 and write the norms' and the
  // activation's high-precision outputs; the training must not notice.
  TrainOptions o = small_run("cpu");
  o.out = (testing::scratch_dir() / "plain").string();
  run_train(o);
  TrainOptions measured = o;
  measured.fp8_stats_every = 1;
  measured.out = (testing::scratch_dir() / "measured").string();
  run_train(measured);
  EXPECT_EQ(testing::loss_lines(fs::path(measured.out) / "metrics.jsonl"),
            testing::loss_lines(fs::path(o.out) / "metrics.jsonl"));
  expect_same_checkpoint(newest_checkpoint(o.out), newest_checkpoint(measured.out));
}

TEST(FusionSwitches, ParseNamesAllAndNoneAndRefuseUnknownNames) {
  EXPECT_EQ(nn::parse_fusions("all").size(), static_cast<size_t>(nn::kFusionCount));
  EXPECT_TRUE(nn::parse_fusions("none").empty());
  const auto two = nn::parse_fusions("norm-cast,optimizer-cast");
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[0], Fusion::norm_cast);
  EXPECT_EQ(two[1], Fusion::optimizer_cast);
  for (Fusion f : nn::all_fusions())
    EXPECT_EQ(nn::parse_fusions(nn::fusion_name(f)), std::vector<Fusion>{f});
  try {
    nn::parse_fusions("norm-cast,attention");
    ADD_FAILURE() << "an unknown fusion was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown fusion 'attention'"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("optimizer-cast"), std::string::npos) << e.what();
  }
  {
    nn::UnfusedScope scope({Fusion::bias_grad});
    EXPECT_FALSE(nn::fusion_enabled(Fusion::bias_grad));
    EXPECT_TRUE(nn::fusion_enabled(Fusion::norm_cast));
    EXPECT_EQ(nn::disabled_fusions(), "bias-grad");
  }
  EXPECT_TRUE(nn::fusion_enabled(Fusion::bias_grad)) << "the scope restores the switches";
}

}  // namespace
}  // namespace octet::train
