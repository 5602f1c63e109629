// The fused FP8 casts, and backward's recast of the FP8 Linear inputs, each switchable at run
// time. Every one computes bitwise what its switched-off path computes
// (tests/train/fusion_test.cc trains with each one off and compares the checkpoints byte for
// byte); the switches exist to bisect a numerical difference to one of them, from a test, the
// API, `octet train --unfuse LIST` or the environment (OCTET_UNFUSE).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace octet::nn {

enum class Fusion : uint8_t {
  /// Delayed scaling: a norm writes the next Linear's FP8 input, both copies (qkv, fc1).
  norm_cast,
  /// Delayed scaling: the MLP activation writes fc2's FP8 input, both copies.
  activation_cast,
  /// Delayed scaling: the activation's backward writes fc1's FP8 grad_output and its bias
  /// gradient.
  activation_grad_cast,
  /// Every FP8 recipe: a Linear's bias gradient is summed by its grad_output's cast kernel.
  bias_grad,
  /// Delayed scaling: AdamW writes the next step's FP8 weights (both copies) with its update.
  optimizer_cast,
  /// Delayed scaling: an MoE layer's scaled activation writes FC2's FP8 input (both copies), each
  /// expert's rows with that expert's scale.
  moe_activation_cast,
  /// Every FP8 recipe: a block's training forward keeps no FP8 input of its Linear layers, and
  /// backward casts each again from the tensor it was made of, kept for another backward (the
  /// norms' inputs, the attention's output, the activation's input). Off, the forward keeps
  /// them: fewer cast passes, more memory.
  input_recast,
};
inline constexpr int kFusionCount = 7;

/// "norm-cast", "activation-cast", "activation-grad-cast", "bias-grad", "optimizer-cast",
/// "moe-activation-cast", "input-recast".
std::string_view fusion_name(Fusion fusion);
/// Every fusion, in declaration order.
std::vector<Fusion> all_fusions();
/// "all", "none", or a comma-separated list of fusion names; throws octet::Error naming the
/// valid names on anything else.
std::vector<Fusion> parse_fusions(std::string_view list);

/// Whether `fusion` is on. All are on unless switched off by set_fusion_enabled() or, before the
/// first call to either, by the environment variable OCTET_UNFUSE (a parse_fusions() list).
bool fusion_enabled(Fusion fusion);
void set_fusion_enabled(Fusion fusion, bool on);
/// The fusions that are off, comma-separated ("none" when all are on): for run headers.
std::string disabled_fusions();

/// RAII for tests: switches `off` off for the scope, then restores every switch.
class UnfusedScope {
 public:
  explicit UnfusedScope(const std::vector<Fusion>& off);
  ~UnfusedScope();
  UnfusedScope(const UnfusedScope&) = delete;
  UnfusedScope& operator=(const UnfusedScope&) = delete;

 private:
  bool saved_[kFusionCount];
};

}  // namespace octet::nn
