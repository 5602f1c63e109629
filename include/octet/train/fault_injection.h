// Testing aid: faults injected into a training step on purpose (`octet train --inject SPEC`,
// TrainOptions::inject), so the tests can prove that a non-finite or corrupted step is caught
// and leaves no trace. Not for production runs.
//
// SPEC is a comma-separated list of KIND@STEPS[:MICROBATCH][/LAYER]:
//   KIND        nan-activation, inf-activation  element 0 of block LAYER's output (the residual
//                                               stream the next block reads), in the forward
//               nan-grad, inf-grad              element 0 of the first gradient of block LAYER,
//                                               after the microbatch's backward
//               nan-amax, inf-amax              the input amax of block LAYER's first FP8 module
//                                               (attn.qkv), in history row 0 before the forward
//                                               (its cast raises the amax, and NaN/Inf win)
//               spike-grad                      every gradient of block LAYER times 1e4, after
//                                               the microbatch's backward
//               exit, hang                      the process that runs MICROBATCH (under mpirun:
//                                               the rank that owns it) ends at once with status
//                                               kInjectedExitStatus, or stops responding, before
//                                               its forward: a rank dying mid-run
//   STEPS       N, N-M (inclusive) or N- (N and every later step); 1-based
//   MICROBATCH  0-based, default 0;  LAYER  0-based block index, default 0
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "octet/core/tensor.h"

namespace octet::train {

class GPT;
struct Parameter;

/// The factor of spike-grad: orders of magnitude past any normal step-to-step change, as the
/// corrupt gradients the guard exists for were ("orders of magnitude outside the normal range").
inline constexpr float kSpikeFactor = 1e4f;

/// The exit status of a process ended by an injected `exit` fault.
inline constexpr int kInjectedExitStatus = 3;

/// One parsed fault.
struct Fault {
  enum class Kind : uint8_t { activation, gradient, amax, spike, exit, hang };
  Kind kind = Kind::gradient;
  float value = 0;  ///< NaN or +inf (activation, gradient, amax); kSpikeFactor (spike)
  int64_t first_step = 0, last_step = 0;  ///< last_step -1: no end
  int64_t microbatch = 0;
  int64_t layer = 0;

  bool active(int64_t step, int64_t micro) const {
    return step >= first_step && (last_step < 0 || step <= last_step) && micro == microbatch;
  }
};

/// Parses SPEC (grammar above); "" gives no faults. Throws octet::Error naming the bad part.
std::vector<Fault> parse_faults(const std::string& spec);

/// Applies the faults of a run at the points of a step where they belong.
class FaultInjector {
 public:
  /// Checks that every fault's layer exists (and that amax faults have FP8 state to hit).
  FaultInjector(std::vector<Fault> faults, GPT& model);
  bool empty() const { return faults_.empty(); }
  /// Before microbatch `micro` of `step`: amax faults now, activation faults armed for its
  /// forward (and disarmed otherwise).
  void before_microbatch(int64_t step, int64_t micro);
  /// After its backward: gradient and spike faults on `params`' gradients.
  void after_microbatch(int64_t step, int64_t micro, const std::vector<Parameter>& params);

 private:
  std::vector<Fault> faults_;
  GPT& model_;
};

/// Writes `value` into element 0 of `t` (f32 or bf16, any device; through the host).
void set_first_element(const Tensor& t, float value);

}  // namespace octet::train
