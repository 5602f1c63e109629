// Helpers of the tests that train: a micro model's options, the losses of a metrics file, the
// bitwise comparison of two checkpoints, and rewriting a checkpoint's metadata.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "octet/train/safetensors.h"
#include "octet/train/trainer.h"
#include "train/run_checks.h"
#include "train/scratch_dir.h"

namespace octet::testing {

/// A model small enough to train a few steps in well under a second per step on one CPU core:
/// run_checks.h's micro_run on the builtin corpus, with FP8 statistics every 2 steps.
inline train::TrainOptions micro_options(const std::filesystem::path& out,
                                         const std::string& precision) {
  train::TrainOptions o = micro_run(out, "cpu", precision);
  o.data = "builtin";
  o.fp8_stats_every = 2;
  return o;
}

/// The "loss" and "grad_norm" fields of every step line of a metrics file, as written (%.9g).
inline std::vector<std::string> loss_lines(const std::filesystem::path& metrics) {
  std::vector<std::string> out;
  std::istringstream in(read_file(metrics));
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (!j.contains("loss")) continue;
    out.push_back(std::to_string(j["step"].get<int64_t>()) + " " + j["loss"].dump() + " " +
                  j["grad_norm"].dump());
  }
  return out;
}

/// Whether two checkpoints hold the same tensor names and bytes (weights, moments, FP8 state).
inline ::testing::AssertionResult same_checkpoint_tensors(const std::filesystem::path& a,
                                                          const std::filesystem::path& b) {
  const train::SafetensorsFile fa = train::load_safetensors(a.string());
  const train::SafetensorsFile fb = train::load_safetensors(b.string());
  if (fa.names() != fb.names())
    return ::testing::AssertionFailure() << a << " and " << b << " hold different tensors";
  for (const std::string& name : fa.names()) {
    const Tensor ta = fa.get(name), tb = fb.get(name);
    if (ta.nbytes() != tb.nbytes() || std::memcmp(ta.raw_data(), tb.raw_data(), ta.nbytes()) != 0)
      return ::testing::AssertionFailure()
             << "tensor '" << name << "' differs between " << a << " and " << b;
  }
  return ::testing::AssertionSuccess();
}

/// Rewrites checkpoint `from` into `to` with metadata `key` set to `value` (checksums renewed).
inline void rewrite_metadata(const std::filesystem::path& from, const std::filesystem::path& to,
                             const std::string& key, const std::string& value) {
  const train::SafetensorsFile file = train::load_safetensors(from.string());
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const std::string& name : file.names()) tensors.emplace_back(name, file.get(name));
  std::map<std::string, std::string> metadata = file.metadata();
  metadata[key] = value;
  train::save_safetensors(to.string(), tensors, metadata);
}

}  // namespace octet::testing
