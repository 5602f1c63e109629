// Helpers of the tests that train whole runs and look at what they leave behind (the non-finite
// step, gradient guard and soak tests): small run options, metrics lines, checkpoint bytes.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "octet/core/device.h"
#include "octet/train/trainer.h"
#include "test_util.h"

namespace octet::testing {

/// A text corpus of 6000 words from a fixed generator in `out`'s parent folder (written once),
/// as a --data spec: byte-level, and no builtin arithmetic evaluation at the end of a run.
std::string corpus_beside(const std::filesystem::path& out);

/// A 1-layer FP8 model on `device` (batch 2 x seq 16, 2 microbatches per step) on
/// corpus_beside(out), that trains a step in well under a second on one CPU core.
train::TrainOptions micro_run(const std::filesystem::path& out, const std::string& device,
                              const std::string& precision = "fp8-delayed");

/// Every line of a metrics file that has a "loss" (one per step), parsed.
std::vector<nlohmann::json> step_lines(const std::filesystem::path& metrics);

/// The last JSON line of an `octet bench train` run's output, parsed ({} when there is none).
nlohmann::json bench_train_line(const std::string& output);

/// Asserts that two checkpoints hold the same tensor names with the same bytes (weights, AdamW
/// moments, FP8 scales, scale_invs and amax histories).
void expect_same_tensors(const std::filesystem::path& expected,
                         const std::filesystem::path& actual);

/// The checkpoint's "step" metadata.
int64_t checkpoint_step(const std::filesystem::path& checkpoint);

/// "cpu" and "cuda:0" (the latter skips itself without a GPU), for INSTANTIATE_TEST_SUITE_P.
std::vector<std::string> run_devices();
/// GTEST_SKIP()s the calling test when `device` names a GPU that is not there.
#define OCTET_SKIP_WITHOUT(device_name) \
  OCTET_SKIP_IF_UNAVAILABLE(::octet::Device::parse(device_name))

}  // namespace octet::testing
