// Helpers shared by the nn tests: every FP8 recipe and readable Recipe parameters, the tensors of
// an FP8 state, and the inputs of the field-shape repeatability runs.
#pragma once

#include <cstdint>
#include <ostream>
#include <utility>
#include <vector>

#include "octet/fp8/recipe.h"
#include "octet/nn/fp8_state.h"
#include "test_util.h"

namespace octet::fp8 {
/// Readable test parameters (the struct's padding bytes would print as noise).
inline void PrintTo(const Recipe& recipe, std::ostream* out) { *out << recipe.name(); }
}  // namespace octet::fp8

namespace octet::testing {

/// The four FP8 recipes, for suites that run under each.
inline std::vector<fp8::Recipe> all_recipes() {
  return {fp8::Recipe::delayed(), fp8::Recipe::current(), fp8::Recipe::block(),
          fp8::Recipe::mxfp8()};
}

/// Every tensor of an FP8 state, for bitwise comparison of two runs.
inline std::vector<Tensor> state_tensors(const nn::FP8State& state) {
  std::vector<Tensor> out;
  for (nn::Pass pass : {nn::Pass::forward, nn::Pass::backward}) {
    const ops::ScalingGroup& g = state.group(pass);
    out.insert(out.end(), {g.amax_history, g.scale, g.scale_inv, state.last_amax(pass)});
  }
  return out;
}

/// (x, dy) of two training steps, bf16 [rows, cols] on cuda:0, from `seed` (x of step s from
/// seed + s, dy from seed + 5 + s): drawn once and shared by every run of a repeatability test.
inline std::vector<std::pair<Tensor, Tensor>> two_step_inputs(int64_t rows, int64_t cols,
                                                              uint64_t seed) {
  std::vector<std::pair<Tensor, Tensor>> steps;
  const Device gpu = Device::cuda(0);
  for (int step = 0; step < 2; ++step)
    steps.emplace_back(random_tensor({rows, cols}, DType::bf16, seed + step).to(gpu),
                       random_tensor({rows, cols}, DType::bf16, seed + 5 + step).to(gpu));
  return steps;
}

}  // namespace octet::testing
