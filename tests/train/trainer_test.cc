// The training loop end to end on a micro model: bitwise resume, metrics, checkpoints, and the
// bad-input contract of `octet train` (a clear octet::Error; an existing checkpoint untouched).
#include "octet/train/trainer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "octet/core/error.h"
#include "octet/train/commands.h"
#include "octet/train/safetensors.h"
#include "train/micro_run.h"
#include "train/scratch_dir.h"

namespace octet::train {
namespace {

using octet::testing::loss_lines;
using octet::testing::micro_options;
using octet::testing::read_file;
using octet::testing::scratch_dir;
using ::testing::HasSubstr;

class TrainerResume : public ::testing::TestWithParam<std::string> {};

TEST_P(TrainerResume, ResumedRunEqualsUninterruptedRunBitwise) {
  const auto dir = scratch_dir();
  TrainOptions whole = micro_options(dir / "whole", GetParam());
  run_train(whole);

  TrainOptions first = micro_options(dir / "split", GetParam());
  first.steps = 3;
  run_train(first);
  TrainOptions second = micro_options(dir / "split", GetParam());
  second.resume = (dir / "split" / "checkpoint.safetensors").string();
  run_train(second);

  const auto expected = loss_lines(dir / "whole" / "metrics.jsonl");
  ASSERT_EQ(expected.size(), 6u);
  EXPECT_EQ(loss_lines(dir / "split" / "metrics.jsonl"), expected);
  // The final weights, moments and FP8 states are the same bytes too.
  EXPECT_TRUE(octet::testing::same_checkpoint_tensors(dir / "whole" / "checkpoint.safetensors",
                                                      dir / "split" / "checkpoint.safetensors"));
}

INSTANTIATE_TEST_SUITE_P(Precisions, TrainerResume,
                         ::testing::Values("fp8-delayed", "fp8-block", "bf16"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name)
                             if (c == '-') c = '_';
                           return name;
                         });

TEST(Trainer, LossFallsAndMetricsHaveTheContractFields) {
  const auto dir = scratch_dir();
  TrainOptions o = micro_options(dir, "fp8-delayed");
  o.steps = 30;
  o.fp8_stats_every = 10;
  run_train(o);
  std::istringstream in(read_file(dir / "metrics.jsonl"));
  std::vector<double> losses;
  bool saw_fp8_stats = false;
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (!j.contains("loss")) continue;
    for (const char* key : {"step", "loss", "grad_norm", "lr", "tokens_per_s"})
      EXPECT_TRUE(j.contains(key)) << key << " missing in " << line;
    losses.push_back(j["loss"].get<double>());
    if (j.contains("fp8")) {
      saw_fp8_stats = true;
      for (const auto& [module, stats] : j["fp8"].items())
        for (const char* role : {"input", "weight", "grad_output"})
          for (const char* key : {"amax", "scale", "saturated", "underflow"})
            EXPECT_TRUE(stats.contains(role) && stats[role].contains(key))
                << module << " lacks " << role << "." << key;
    }
  }
  ASSERT_EQ(losses.size(), 30u);
  EXPECT_TRUE(saw_fp8_stats);
  EXPECT_LT(losses.back(), 0.8 * losses.front());
}

// ----------------------------------------------------------------------------
// Bad input

void expect_train_error(const TrainOptions& o, const std::string& fragment) {
  try {
    run_train(o);
    FAIL() << "expected an octet::Error containing '" << fragment << "'";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr(fragment));
  }
}

TEST(Trainer, ALongerSeqThanThePresetsGrowsThePositionTable) {
  const auto dir = scratch_dir();
  TrainOptions o = micro_options(dir, "bf16");
  o.seq = 256;  // the tiny preset's table has 128 rows
  o.steps = 2;
  o.accum = 1;
  run_train(o);
  const auto file = train::load_safetensors((dir / "checkpoint-000002.safetensors").string());
  EXPECT_EQ(file.shape("param.wpe"), (Shape{256, o.dim}));
  // The run's model is that of its checkpoint: resuming at another length is refused.
  o.seq = 512;
  o.steps = 3;
  o.resume = dir.string();
  expect_train_error(o, "\"max_seq\":256");
}

// `--device a,b` splits the blocks over two devices. On the CPU, or twice on one GPU, the stages
// still hand activations and gradients over as copies; the run equals the one-device run bitwise
// and a checkpoint of either resumes on the other.
class TrainerSplit : public ::testing::TestWithParam<std::string> {};

TEST_P(TrainerSplit, SplitRunEqualsTheOneDeviceRunAndResumesEitherWay) {
  const std::vector<Device> stages = Device::parse_list(GetParam());
  for (const Device& d : stages) OCTET_SKIP_IF_UNAVAILABLE(d);
  const auto dir = scratch_dir();
  const auto options = [&](const std::string& name, const std::string& device) {
    TrainOptions o = micro_options(dir / name, "fp8-delayed");
    o.device = device;
    o.layers = 2;  // a block on each stage
    return o;
  };
  run_train(options("one", stages.front().str()));
  run_train(options("split", GetParam()));
  TrainOptions first = options("split-then-one", GetParam());
  first.steps = 3;
  run_train(first);
  TrainOptions second = options("split-then-one", stages.front().str());
  second.resume = (dir / "split-then-one" / "checkpoint.safetensors").string();
  run_train(second);

  const auto expected = loss_lines(dir / "one" / "metrics.jsonl");
  ASSERT_EQ(expected.size(), 6u);
  for (const char* run : {"split", "split-then-one"}) {
    SCOPED_TRACE(run);
    EXPECT_EQ(loss_lines(dir / run / "metrics.jsonl"), expected);
    EXPECT_TRUE(octet::testing::same_checkpoint_tensors(dir / "one" / "checkpoint.safetensors",
                                                        dir / run / "checkpoint.safetensors"));
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, TrainerSplit,
                         ::testing::Values("cpu,cpu", "cuda:0,0", "cuda:0,1"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name)
                             if (c == ':' || c == ',') c = '_';
                           return name;
                         });

TEST(TrainerBadInput, ImpossibleSplits) {
  const auto dir = scratch_dir();
  TrainOptions o = micro_options(dir, "fp8-delayed");
  o.device = "cpu,cpu";  // micro_options has one layer
  expect_train_error(o, "a split over 2 devices (cpu,cpu) needs at least as many layers, got 1");
  o = micro_options(dir, "fp8-delayed");
  o.device = "cpu,cuda:0";
  expect_train_error(o, "mixes the CPU and GPUs");
  o.device = "cuda:0,99";  // the first device that is not there is named
  expect_train_error(
      o, cuda_device_count() > 0 ? "device cuda:99 requested" : "device cuda:0 requested");
  EXPECT_FALSE(std::filesystem::exists(dir / "checkpoint.safetensors"));
}

TEST(TrainerBadInput, ImpossibleSizes) {
  const auto dir = scratch_dir();
  TrainOptions o = micro_options(dir, "fp8-delayed");
  o.heads = 3;
  expect_train_error(o, "heads (3) must divide dim (32)");
  o = micro_options(dir, "fp8-delayed");
  o.batch = 1;
  o.seq = 8;
  expect_train_error(o, "multiple of 16");
  o = micro_options(dir, "fp8-delayed");
  o.precision = "fp7";
  expect_train_error(o, "fp7");
}

TEST(TrainerBadInput, MissingAndEmptyData) {
  const auto dir = scratch_dir();
  TrainOptions o = micro_options(dir, "bf16");
  o.data = "text:" + (dir / "missing.txt").string();
  expect_train_error(o, "missing.txt");
  std::ofstream(dir / "empty.txt").close();
  o.data = "text:" + (dir / "empty.txt").string();
  expect_train_error(o, "empty");
  std::ofstream bad(dir / "bad.bin", std::ios::binary);
  std::vector<int32_t> header(256, 0);
  header[0] = 12345;
  bad.write(reinterpret_cast<const char*>(header.data()), 1024);
  bad.close();
  o.data = "bin:" + (dir / "bad.bin").string();
  expect_train_error(o, "magic");
}

TEST(TrainerBadInput, CorruptCheckpointLeavesItIntactAndIncompatibleConfigIsRefused) {
  const auto dir = scratch_dir();
  TrainOptions o = micro_options(dir / "run", "bf16");
  o.steps = 2;
  run_train(o);
  const auto ckpt = dir / "run" / "checkpoint.safetensors";
  const std::string good = read_file(ckpt);

  // Truncated copy: refused with a clear error.
  const auto truncated = dir / "truncated.safetensors";
  std::ofstream(truncated, std::ios::binary) << good.substr(0, good.size() / 2);
  TrainOptions resume = micro_options(dir / "run", "bf16");
  resume.resume = truncated.string();
  expect_train_error(resume, "truncated");

  // Incompatible config: refused, naming the field; the checkpoint is untouched.
  resume.resume = ckpt.string();
  resume.dim = 48;
  resume.heads = 2;
  expect_train_error(resume, "incompatible");
  EXPECT_EQ(read_file(ckpt), good);

  // Another precision is another run.
  resume = micro_options(dir / "run", "fp8-delayed");
  resume.resume = ckpt.string();
  expect_train_error(resume, "precision");
  EXPECT_EQ(read_file(ckpt), good);
}

TEST(TrainerInspect, PrintsConfigAndFp8State) {
  const auto dir = scratch_dir();
  TrainOptions o = micro_options(dir, "fp8-delayed");
  o.steps = 2;
  run_train(o);
  ::testing::internal::CaptureStdout();
  run_inspect((dir / "checkpoint.safetensors").string());
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_THAT(out, HasSubstr("fp8-delayed"));
  EXPECT_THAT(out, HasSubstr("blocks.0.attn.qkv"));
}

}  // namespace
}  // namespace octet::train
