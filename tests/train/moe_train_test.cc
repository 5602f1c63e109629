// Mixture-of-experts training through run_train on the CPU (CI): the loss of a small MoE model
// falls, two --deterministic runs write the same metrics, a resumed run is bitwise an
// uninterrupted one, metrics.jsonl carries each MoE layer's load, and a NaN reaching a router
// skips the step instead of corrupting the weights.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "octet/core/tensor.h"
#include "octet/train/checkpoint.h"
#include "octet/train/model.h"
#include "octet/train/safetensors.h"
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

/// --router sigmoid, --z-loss-coef and --shared-expert reach the model and its checkpoint: the
/// z-loss is reported, the aux loss (over sigmoid scores) differs from the softmax router's, the
/// shared expert's weights are trained and saved, and the checkpoint's config holds all three.
TEST(MoeTraining, RouterZLossAndSharedExpertOptions) {
  const fs::path dir = testing::scratch_dir();
  TrainOptions base = moe_run(dir / "base", 1);
  run_train(base);
  TrainOptions o = moe_run(dir / "flags", 1);
  o.router = "sigmoid";
  o.z_loss_coef = 0.01;
  o.shared_expert = true;
  run_train(o);
  const nlohmann::json a = step_lines(dir / "base" / "metrics.jsonl").back().at("moe").at(
                           "blocks.0.moe"),
                       b = step_lines(dir / "flags" / "metrics.jsonl").back().at("moe").at(
                           "blocks.0.moe");
  EXPECT_EQ(a.at("z_loss").get<double>(), 0.0);
  EXPECT_GT(b.at("z_loss").get<double>(), 0.0);
  EXPECT_NE(a.at("aux_loss").get<double>(), b.at("aux_loss").get<double>());
  const SafetensorsFile base_file =
      load_safetensors((dir / "base" / "checkpoint-000001.safetensors").string());
  const SafetensorsFile file =
      load_safetensors((dir / "flags" / "checkpoint-000001.safetensors").string());
  const ModelConfig held = checkpoint_config(file);
  EXPECT_EQ(held.router, "sigmoid");
  EXPECT_EQ(held.z_loss_coef, 0.01f);
  EXPECT_TRUE(held.shared_expert);
  EXPECT_FALSE(checkpoint_config(base_file).shared_expert);
  const auto has = [](const SafetensorsFile& f, const std::string& name) {
    const std::vector<std::string> names = f.names();
    return std::find(names.begin(), names.end(), name) != names.end();
  };
  EXPECT_TRUE(has(file, "param.blocks.0.moe.shared.fc1.weight"));
  EXPECT_FALSE(has(base_file, "param.blocks.0.moe.shared.fc1.weight"));
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

/// A 2-layer Llama-style model whose second block is an MoE layer (4 experts, top-2).
ModelConfig moe_model() {
  ModelConfig c = model_preset("moe-tiny");
  c.arch = Arch::llama;
  c.dim = c.ffn = 32;
  c.heads = 2;
  c.moe_every = 2;  // block 0 dense, block 1 MoE
  return c;
}

TEST(MoeModel, ParametersAndFp8ModulesCoverTheExperts) {
  GPT model(moe_model(), Precision::from_name("fp8-delayed"), Device::cpu(), 7, false);
  int64_t count = 0;
  std::vector<std::string> names;
  for (const Parameter& p : model.parameters()) {
    count += p.value.numel();
    names.push_back(p.name);
  }
  EXPECT_EQ(count, model.config().parameter_count());
  EXPECT_NE(std::find(names.begin(), names.end(), "blocks.1.moe.router.weight"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "blocks.0.mlp.fc1.weight"), names.end());
  EXPECT_EQ(std::find(names.begin(), names.end(), "blocks.1.mlp.fc1.weight"), names.end());
  std::vector<std::string> modules;
  for (const Fp8Module& m : model.fp8_modules()) modules.push_back(m.name);
  // Block 0: qkv, proj, fc1, fc2; block 1: qkv, proj, 4 fc1 and 4 fc2 experts.
  ASSERT_EQ(modules.size(), 4u + 2u + 8u);
  EXPECT_EQ(modules[6], "blocks.1.moe.fc1.experts.0");
  EXPECT_EQ(modules.back(), "blocks.1.moe.fc2.experts.3");
}

TEST(MoeModel, RecomputeIsBitwiseNoRecompute) {
  const Precision fp8 = Precision::from_name("fp8-delayed");
  GPT plain(moe_model(), fp8, Device::cpu(), 11, /*recompute=*/false);
  GPT recomputed(moe_model(), fp8, Device::cpu(), 11, /*recompute=*/true);
  const int64_t batch = 2, seq = 16;
  const Tensor ids_t = Tensor::empty({batch * seq}, DType::i32);
  const Tensor targets_t = Tensor::empty({batch * seq}, DType::i32);
  for (int64_t i = 0; i < batch * seq; ++i) {  // fixed tokens below the byte vocabulary
    ids_t.data<int32_t>()[i] = static_cast<int32_t>((i * 37 + 5) % 200);
    targets_t.data<int32_t>()[i] = static_cast<int32_t>((i * 53 + 11) % 200);
  }
  for (int step = 0; step < 2; ++step) {
    const float a = plain.train_microbatch(ids_t, targets_t, batch, seq, 0.5f);
    const float b = recomputed.train_microbatch(ids_t, targets_t, batch, seq, 0.5f);
    EXPECT_EQ(a, b) << "loss, step " << step;
  }
  const std::vector<Parameter> pa = plain.parameters(), pb = recomputed.parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_TRUE(testing::bitwise_equal(pa[i].grad, pb[i].grad)) << pa[i].name;
}

}  // namespace
}  // namespace octet::train
