// Mixture-of-experts training through run_train on the CPU (CI): the loss of a small MoE model
// falls, two --deterministic runs write the same metrics, a resumed run is bitwise an
// uninterrupted one, metrics.jsonl carries each MoE layer's load, and a NaN reaching a router
// skips the step instead of corrupting the weights.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "octet/train/trainer.h"
#include "train/run_checks.h"
#include "train/scratch_dir.h"

namespace octet::train {
namespace {

namespace fs = std::filesystem;
using testing::step_lines;

/// micro_run's 1-layer FP8 model with 4 experts, top-2, every layer MoE.
TrainOptions moe_run(const fs::path& out, int64_t steps) {
  TrainOptions o = testing::micro_run(out, "cpu");
  o.experts = 4;
  o.topk = 2;
  o.steps = steps;
  return o;
}

/// The step lines without their wall-clock field (tokens_per_s), which no two runs share.
std::vector<std::string> step_lines_without_timing(const fs::path& metrics) {
  std::vector<std::string> out;
  for (nlohmann::json line : step_lines(metrics)) {
    line.erase("tokens_per_s");
    out.push_back(line.dump());
  }
  return out;
}

TEST(MoeTraining, LossFallsAndDeterministicRunsWriteTheSameMetrics) {
  const fs::path dir = testing::scratch_dir();
  std::vector<std::vector<std::string>> runs;
  for (const char* name : {"a", "b"}) {
    TrainOptions o = moe_run(dir / name, 16);
    o.lr = 1e-2;
    o.deterministic = true;
    run_train(o);
    runs.push_back(step_lines_without_timing(dir / name / "metrics.jsonl"));
  }
  ASSERT_EQ(runs[0].size(), 16u);
  EXPECT_EQ(runs[0], runs[1]) << "two --deterministic runs differ";

  const std::vector<nlohmann::json> lines = step_lines(dir / "a" / "metrics.jsonl");
  const double first = lines.front().at("loss"), last = lines.back().at("loss");
  EXPECT_LT(last, 0.8 * first) << "the loss falls";
  const nlohmann::json& moe = lines.back().at("moe").at("blocks.0.moe");
  int64_t routed = 0;
  for (int64_t n : moe.at("tokens")) routed += n;
  EXPECT_EQ(moe.at("tokens").size(), 4u);
  EXPECT_EQ(routed, 2 * 16 * 2) << "batch 2 x seq 16 tokens, top-2";
  EXPECT_LE(moe.at("min").get<int64_t>(), moe.at("max").get<int64_t>());
  EXPECT_GT(moe.at("aux_loss").get<double>(), 0.0);
}

TEST(MoeTraining, ResumeIsBitwise) {
  const fs::path dir = testing::scratch_dir();
  run_train(moe_run(dir / "straight", 4));
  TrainOptions first = moe_run(dir / "split", 2);
  run_train(first);
  TrainOptions second = moe_run(dir / "split", 4);
  second.resume = (dir / "split").string();
  run_train(second);
  testing::expect_same_tensors(dir / "straight" / "checkpoint-000004.safetensors",
                               dir / "split" / "checkpoint-000004.safetensors");
}

TEST(MoeTraining, NanIntoARouterSkipsTheStep) {
  const fs::path dir = testing::scratch_dir();
  TrainOptions o = moe_run(dir / "run", 4);
  o.layers = 2;
  o.moe_every = 2;             // block 1 is the MoE layer; block 0's output is its router input
  o.inject = "nan-activation@2/0";
  run_train(o);
  const std::vector<nlohmann::json> lines = step_lines(dir / "run" / "metrics.jsonl");
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_TRUE(lines[1].value("skipped", false)) << lines[1].dump();
  EXPECT_FALSE(lines[2].value("skipped", false)) << lines[2].dump();
  EXPECT_TRUE(std::isfinite(lines[3].at("loss").get<double>()));
  EXPECT_TRUE(lines[3].at("moe").contains("blocks.1.moe"));
}

}  // namespace
}  // namespace octet::train
