// Non-finite steps: a NaN/Inf injected into an activation, a gradient or an FP8 amax makes the
// step skip, and nothing it computed stays: the weights, AdamW moments and FP8 scales, scale_invs
// and amax histories are byte for byte those of the step before; the run goes on (and resumes
// bitwise across the skip); --max-skips stops it with the last checkpoint intact. Each case runs
// on the CPU and on cuda:0 (skipped without a GPU).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "octet/core/error.h"
#include "octet/train/model.h"
#include "octet/train/step_checks.h"
#include "octet/train/trainer.h"
#include "train/run_checks.h"
#include "train/scratch_dir.h"

namespace octet::train {
namespace {

using octet::testing::checkpoint_step;
using octet::testing::expect_same_tensors;
using octet::testing::micro_run;
using octet::testing::read_file;
using octet::testing::scratch_dir;
using octet::testing::step_lines;
using ::testing::HasSubstr;

struct FaultCase {
  std::string kind;       ///< the --inject KIND
  std::string precision;  ///< the run's precision
  std::string reason;     ///< the skip_reason the metrics must name
};

void PrintTo(const FaultCase& c, std::ostream* os) { *os << c.kind << " on " << c.precision; }

std::string case_name(const std::string& device, const FaultCase& c) {
  std::string name = device + "_" + c.kind + "_" + c.precision;
  for (char& ch : name)
    if (ch == '-' || ch == ':') ch = '_';
  return name;
}

class NonFiniteStep : public ::testing::TestWithParam<std::tuple<std::string, FaultCase>> {};

TEST_P(NonFiniteStep, IsSkippedLeavesEveryStateByteIdenticalAndTheRunGoesOn) {
  const auto& [device, c] = GetParam();
  OCTET_SKIP_WITHOUT(device);
  const auto dir = scratch_dir();
  const auto ckpt = [&](const char* run) { return dir / run / "checkpoint.safetensors"; };
  const auto options = [&](const char* run, int64_t steps, const std::string& inject) {
    TrainOptions o = micro_run(dir / run, device, c.precision);
    o.steps = steps;
    o.inject = inject;
    return o;
  };
  // The fault hits step 4's second microbatch; step 4 must leave the state of step 3.
  const std::string fault = c.kind + "@4:1";
  run_train(options("clean", 3, ""));
  run_train(options("faulty", 4, fault));
  expect_same_tensors(ckpt("clean"), ckpt("faulty"));

  const auto lines = step_lines(dir / "faulty" / "metrics.jsonl");
  ASSERT_EQ(lines.size(), 4u);
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(lines[i].contains("skipped")) << lines[i];
  EXPECT_EQ(lines[3]["skipped"], true) << lines[3];
  EXPECT_EQ(lines[3]["skip_reason"], c.reason) << lines[3];
  EXPECT_EQ(lines[3]["skips_total"], 1) << lines[3];

  // The run goes on after the skip: every later step applies, with a finite loss.
  run_train(options("through", 6, fault));
  const auto through = step_lines(dir / "through" / "metrics.jsonl");
  ASSERT_EQ(through.size(), 6u);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(through[i]["step"], i + 1);
    if (i == 3) continue;
    EXPECT_FALSE(through[i].contains("skipped")) << through[i];
    EXPECT_TRUE(through[i]["loss"].is_number()) << through[i];
  }
  // Resuming the checkpoint written after the skipped step gives the uninterrupted run's bytes.
  TrainOptions resumed = options("faulty", 6, "");
  resumed.resume = ckpt("faulty").string();
  run_train(resumed);
  expect_same_tensors(ckpt("through"), ckpt("faulty"));
}

const FaultCase kFaultCases[] = {
    {"nan-activation", "fp8-delayed", "non-finite loss"},
    {"inf-activation", "fp8-delayed", "non-finite loss"},
    {"nan-grad", "fp8-delayed", "non-finite gradient"},
    {"inf-grad", "fp8-delayed", "non-finite gradient"},
    {"nan-amax", "fp8-delayed", "non-finite amax"},
    {"inf-amax", "fp8-delayed", "non-finite amax"},
    {"nan-amax", "fp8-current", "non-finite amax"},
    {"nan-grad", "bf16", "non-finite gradient"},
};

INSTANTIATE_TEST_SUITE_P(Faults, NonFiniteStep,
                         ::testing::Combine(::testing::ValuesIn(octet::testing::run_devices()),
                                            ::testing::ValuesIn(kFaultCases)),
                         [](const auto& info) {
                           return case_name(std::get<0>(info.param), std::get<1>(info.param));
                         });

class MaxSkips : public ::testing::TestWithParam<std::string> {};

TEST_P(MaxSkips, StopsTheRunWithTheLastCheckpointIntact) {
  const std::string device = GetParam();
  OCTET_SKIP_WITHOUT(device);
  const auto dir = scratch_dir();
  TrainOptions clean = micro_run(dir / "clean", device);
  clean.steps = 4;
  run_train(clean);

  // Every step from 5 on has a NaN gradient; checkpoints every 2 steps.
  TrainOptions o = micro_run(dir / "run", device);
  o.steps = 12;
  o.save_every = 2;
  o.max_skips = 3;
  o.inject = "nan-grad@5-";
  try {
    run_train(o);
    FAIL() << "expected the run to stop";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("training stopped at step 7: 3 steps in a row were "
                                       "skipped (--max-skips 3)"));
    EXPECT_THAT(e.message(), HasSubstr("still those of step 4"));
    EXPECT_THAT(e.message(), HasSubstr("(step 4) is intact"));
  }
  const auto ckpt = dir / "run" / "checkpoint.safetensors";
  EXPECT_EQ(checkpoint_step(ckpt), 4);  // step 6 was skipped: no checkpoint over step 4's
  expect_same_tensors(dir / "clean" / "checkpoint.safetensors", ckpt);
  const auto lines = step_lines(dir / "run" / "metrics.jsonl");
  ASSERT_EQ(lines.size(), 7u);
  EXPECT_EQ(lines[6]["skips_total"], 3);

  // Training goes on from that checkpoint once the fault is gone.
  TrainOptions resume = micro_run(dir / "run", device);
  resume.resume = ckpt.string();
  resume.steps = 6;
  run_train(resume);
  EXPECT_EQ(checkpoint_step(ckpt), 6);

  // --max-skips 0 never stops: the run ends with its steps skipped and counted.
  TrainOptions endless = micro_run(dir / "endless", device);
  endless.max_skips = 0;
  endless.inject = "nan-grad@2-";
  run_train(endless);
  const auto endless_lines = step_lines(dir / "endless" / "metrics.jsonl");
  ASSERT_EQ(endless_lines.size(), 6u);
  EXPECT_EQ(endless_lines[5]["skips_total"], 5);
}

INSTANTIATE_TEST_SUITE_P(Devices, MaxSkips, ::testing::ValuesIn(octet::testing::run_devices()),
                         [](const auto& info) { return info.param == "cpu" ? "cpu" : "cuda0"; });

TEST(SkipCount, ContinuesAcrossAResume) {
  const auto dir = scratch_dir();
  TrainOptions o = micro_run(dir, "cpu");
  o.steps = 3;
  o.inject = "nan-grad@2";
  run_train(o);
  o.steps = 5;
  o.inject = "nan-grad@5";
  o.resume = (dir / "checkpoint.safetensors").string();
  run_train(o);
  const auto lines = step_lines(dir / "metrics.jsonl");
  ASSERT_EQ(lines.size(), 5u);
  EXPECT_EQ(lines[1]["skips_total"], 1);
  EXPECT_FALSE(lines[2].contains("skipped"));
  EXPECT_EQ(lines[4]["skips_total"], 2);
}

TEST(MaxSkipsCli, NonZeroExitOneErrorLineAndALogLinePerSkip) {
  const auto dir = scratch_dir();
  const std::string command = "cd '" + dir.string() +
                              "' && '" OCTET_CLI_PATH
                              "' train --device cpu --layers 1 --dim 32 --heads 2 --ffn 64 "
                              "--batch 2 --seq 16 --steps 8 --inject inf-grad@3- --max-skips 2 "
                              "2>stderr.txt";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) out.append(buffer, n);
  const int status = pclose(pipe);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 1) << out;
  EXPECT_THAT(out, HasSubstr("step 3 skipped: non-finite gradient"));
  EXPECT_THAT(out, HasSubstr("step 4 skipped: non-finite gradient"));
  const std::string err = read_file(dir / "stderr.txt");
  const size_t error_line = err.find("octet: error: training stopped at step 4");
  EXPECT_NE(error_line, std::string::npos) << err;
  EXPECT_THAT(err.substr(error_line), HasSubstr("no checkpoint was written yet"));
}

// ----------------------------------------------------------------------------
// Fp8Snapshot on its own: after a whole microbatch moved every FP8 state (amax histories rolled,
// forward scales moved to fresh storage, scale_invs rewritten), restore() puts back every byte.

Tensor random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  Tensor t = Tensor::empty({n}, DType::i32);
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < n; ++i) t.data<int32_t>()[i] = static_cast<int32_t>(rng() % vocab);
  return t;
}

/// A two-layer FP8-delayed model on the parameter's device, from the test's seed, and one random
/// microbatch of training.
class Fp8SnapshotTest : public ::testing::TestWithParam<std::string> {
 protected:
  static ModelConfig config() {
    ModelConfig c = model_preset("tiny");
    c.layers = 2;
    c.dim = 32;
    c.heads = 2;
    c.ffn = 64;
    return c;
  }
  void SetUp() override {
    OCTET_SKIP_IF_UNAVAILABLE(device_);
    model_.emplace(config(), Precision::from_name("fp8-delayed"), device_, seed_, false);
  }
  void microbatch(uint64_t s) {
    constexpr int64_t kBatch = 2, kSeq = 16;
    const int64_t vocab = config().vocab;
    model_->train_microbatch(random_ids(kBatch * kSeq, vocab, s),
                             random_ids(kBatch * kSeq, vocab, s + 1), kBatch, kSeq, 1.0f);
  }
  const Device device_ = Device::parse(GetParam());
  const uint64_t seed_ = octet::testing::fresh_seed();
  std::optional<GPT> model_;
};

TEST_P(Fp8SnapshotTest, RestoresEveryByteOfEveryState) {
  microbatch(seed_);  // nonzero amaxes and scales to start from
  const auto states = model_->registry().states();
  ASSERT_EQ(states.size(), 2u * 4u);
  const auto bytes = [&] {
    std::vector<std::vector<uint8_t>> all;
    for (const auto& s : states)
      for (const Tensor& t : fp8_state_tensors(*s)) all.push_back(octet::testing::to_bytes(t));
    return all;
  };
  const auto before = bytes();
  Fp8Snapshot snapshot;
  snapshot.capture(states);
  microbatch(seed_ + 2);
  const auto moved = bytes();
  ASSERT_EQ(moved.size(), before.size());
  int changed = 0;
  for (size_t i = 0; i < before.size(); ++i) changed += moved[i] != before[i];
  EXPECT_GT(changed, static_cast<int>(states.size()));  // the precondition: the states moved
  snapshot.restore();
  const auto after = bytes();
  for (size_t i = 0; i < before.size(); ++i) EXPECT_EQ(after[i], before[i]) << "tensor " << i;
}

TEST_P(Fp8SnapshotTest, RestoringAFirstStepLeavesTheStatesToCalibrateAgain) {
  // A skipped first step must leave the states as new: their next pass scales from its own
  // tensors again (FP8State::calibrated), not from the initial scale 1 the bytes went back to.
  const auto states = model_->registry().states();
  ASSERT_EQ(states.size(), 2u * 4u);
  const auto count_calibrated = [&] {
    int n = 0;
    for (const auto& s : states)
      n += s->calibrated(nn::Pass::forward) + s->calibrated(nn::Pass::backward);
    return n;
  };
  EXPECT_EQ(count_calibrated(), 0);
  Fp8Snapshot snapshot;
  snapshot.capture(states);
  microbatch(seed_);
  EXPECT_EQ(count_calibrated(), 2 * static_cast<int>(states.size()));
  snapshot.restore();
  EXPECT_EQ(count_calibrated(), 0);
}

INSTANTIATE_TEST_SUITE_P(Devices, Fp8SnapshotTest,
                         ::testing::ValuesIn(octet::testing::run_devices()),
                         [](const auto& info) { return info.param == "cpu" ? "cpu" : "cuda0"; });

}  // namespace
}  // namespace octet::train
