// `octet train`'s recipe knobs (--amax-history, --amax-algo, --margin, --fp8-format): applied to
// the FP8 states, stored in the checkpoint, checked on resume, refused where they mean nothing;
// and the FP8 statistics that metrics.jsonl reports per layer.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "octet/core/error.h"
#include "octet/train/safetensors.h"
#include "octet/train/trainer.h"
#include "test_util.h"
#include "train/run_checks.h"
#include "train/scratch_dir.h"

namespace octet::train {
namespace {

namespace fs = std::filesystem;

TrainOptions small_run(const fs::path& out) {
  TrainOptions o = testing::micro_run(out, "cpu");
  o.dim = 64;
  o.ffn = 128;
  o.steps = 2;
  o.warmup = 1;
  return o;
}

std::string error_of_run(const TrainOptions& o) {
  return testing::error_of([&] { run_train(o); });
}

TEST(RecipeOptions, KnobsReachTheStateTheCheckpointAndTheResumeCheck) {
  const fs::path out = testing::scratch_dir() / "run";
  TrainOptions o = small_run(out);
  o.amax_history = 16;
  o.amax_algo = "most_recent";
  o.margin = 1;
  o.fp8_format = "e4m3";
  run_train(o);
  const SafetensorsFile file = load_safetensors((out / "checkpoint.safetensors").string());
  EXPECT_EQ(file.metadata().at("recipe"), "e4m3, amax history 16 (most_recent), margin 1");
  EXPECT_EQ(file.shape("fp8.blocks.0.attn.qkv.fwd.amax_history"), (Shape{16, 2}));
  EXPECT_EQ(file.shape("fp8.blocks.0.mlp.fc2.bwd.amax_history"), (Shape{16, 1}));

  // The same recipe continues; another one is refused, naming the field.
  TrainOptions more = o;
  more.steps = 3;
  more.resume = (out / "checkpoint.safetensors").string();
  run_train(more);
  TrainOptions other = more;
  other.steps = 4;
  other.amax_history = 0;  // the default, 1024
  const std::string message = error_of_run(other);
  EXPECT_NE(message.find("recipe"), std::string::npos) << message;
  EXPECT_NE(message.find("amax history 16"), std::string::npos) << message;
}

TEST(RecipeOptions, KnobsThatMeanNothingForThePrecisionAreRefused) {
  const fs::path out = testing::scratch_dir() / "run";
  TrainOptions o = small_run(out);
  o.precision = "bf16";
  o.amax_history = 16;
  EXPECT_NE(error_of_run(o).find("use --precision fp8-delayed"), std::string::npos);
  o = small_run(out);
  o.precision = "fp8-current";
  o.margin = 2;
  EXPECT_NE(error_of_run(o).find("--margin"), std::string::npos);
  o = small_run(out);
  o.precision = "fp8-block";
  o.fp8_format = "hybrid";
  EXPECT_NE(error_of_run(o).find("--fp8-format applies to fp8-delayed and fp8-current"),
            std::string::npos);
  o = small_run(out);
  o.amax_algo = "mean";
  EXPECT_NE(error_of_run(o).find("unknown amax algorithm 'mean'"), std::string::npos);
  o = small_run(out);
  o.fp8_format = "e5m2";
  EXPECT_NE(error_of_run(o).find("unknown FP8 format 'e5m2'"), std::string::npos);
  o = small_run(out);
  o.amax_history = -3;
  EXPECT_NE(error_of_run(o).find("--amax-history must be a positive row count"),
            std::string::npos);
  o = small_run(out);
  o.unfuse = "norm-cast,nothing";
  EXPECT_NE(error_of_run(o).find("unknown fusion 'nothing'"), std::string::npos);
  EXPECT_FALSE(fs::exists(out / "checkpoint.safetensors")) << "a refused run writes nothing";
}

TEST(RecipeOptions, MetricsReportEveryCastOfEveryLayer) {
  const fs::path out = testing::scratch_dir() / "run";
  TrainOptions o = small_run(out);
  o.fp8_stats_every = 2;
  run_train(o);
  std::istringstream lines(testing::read_file(out / "metrics.jsonl"));
  int measured = 0;
  for (std::string line; std::getline(lines, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("fp8")) continue;
    ++measured;
    EXPECT_EQ(j["step"], 2);
    ASSERT_EQ(j["fp8"].size(), 4u) << j["fp8"].dump();
    for (const auto& [layer, stats] : j["fp8"].items()) {
      SCOPED_TRACE(layer);
      for (const char* role : {"input", "weight", "grad_output"}) {
        ASSERT_TRUE(stats.contains(role)) << stats.dump();
        for (const char* field : {"amax", "scale", "saturated", "underflow"})
          EXPECT_TRUE(stats[role].contains(field)) << role << " lacks " << field;
        EXPECT_GT(stats[role]["amax"].get<double>(), 0.0) << role;
        EXPECT_GT(stats[role]["scale"].get<double>(), 0.0) << role;
      }
    }
  }
  EXPECT_EQ(measured, 1);
}

}  // namespace
}  // namespace octet::train
