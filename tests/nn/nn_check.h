// Helpers shared by the nn tests: readable Recipe parameters and the tensors of an FP8 state.
#pragma once

#include <ostream>
#include <vector>

#include "octet/fp8/recipe.h"
#include "octet/nn/fp8_state.h"

namespace octet::fp8 {
/// Readable test parameters (the struct's padding bytes would print as noise).
inline void PrintTo(const Recipe& recipe, std::ostream* out) { *out << recipe.name(); }
}  // namespace octet::fp8

namespace octet::testing {

/// Every tensor of an FP8 state, for bitwise comparison of two runs.
inline std::vector<Tensor> state_tensors(const nn::FP8State& state) {
  std::vector<Tensor> out;
  for (nn::Pass pass : {nn::Pass::forward, nn::Pass::backward}) {
    const ops::ScalingGroup& g = state.group(pass);
    out.insert(out.end(), {g.amax_history, g.scale, g.scale_inv, state.last_amax(pass)});
  }
  return out;
}

}  // namespace octet::testing
