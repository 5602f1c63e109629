// nn::GroupedLinear: the experts of a mixture-of-experts layer, y_g = x_g W_g^T + b_g for every
// expert g over its rows of one expert-contiguous input, with the experts' GEMMs batched through
// ops::grouped_gemm.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "octet/core/tensor.h"
#include "octet/nn/linear.h"
#include "octet/ops/quantize.h"

namespace octet::nn {

/// E experts, each an nn::Linear [out, in] with its own FP32 master, gradients, optional bias and
/// FP8 state (under delayed scaling each expert records one amax per tensor role into its own
/// history, registered with the autocast's registry like any Linear). Every expert casts and
/// quantizes exactly as a Linear does (Linear's code, not a copy), so expert g's results are
/// bitwise those of the Linear alone; what is gathered is the launches: the GEMMs run as one
/// grouped GEMM, and the FP8 casts that Linear lets a producer write (its input's and grad_output's
/// under calibrated delayed scaling) run as one grouped quantize (ops::quantize_groups) instead of
/// a launch per expert. Activation recompute is Linear's: the recomputed records are bitwise the
/// original ones.
class GroupedLinear {
 public:
  /// Group offsets: E + 1 host-side entries, expert g owns rows [offsets[g], offsets[g+1]) of the
  /// input and output (row counts multiples of 16 under FP8: the dispatch pads them).
  struct Saved {
    std::vector<int64_t> offsets;
    std::vector<Linear::Saved> experts;  ///< empty records for experts without rows
    DType input_dtype = DType::f32;

    /// A record holding only the experts' snapshots and the offsets: pass it to
    /// forward(..., ForwardMode::recompute).
    Saved snapshot_only() const;
    /// Frees every expert's forward-only copies (Linear::Saved::release_forward_only).
    void release_forward_only();
  };

  /// Expert g is Linear(in, out, bias, device, seed_of_expert(seed, g), compute_dtype).
  GroupedLinear(int64_t experts, int64_t in_features, int64_t out_features, bool bias,
                const Device& device, uint64_t seed, DType compute_dtype = DType::f32);
  /// The seed expert g is drawn from.
  static uint64_t seed_of_expert(uint64_t seed, int64_t expert);

  /// y [rows, out] (x's dtype) from x [rows, in] (f32 or bf16), rows >= offsets.back(): each
  /// expert's rows through its Linear; rows past offsets.back() are padding (the tail of an MoE
  /// plan's capacity) and give zero rows of y (FP8 under fp8_autocast per the active recipe, else the
  /// compute dtype). Experts without rows are skipped: they record no amax and write no gradient.
  /// x may be undefined when every expert with rows took a fused input (fused_input); y then has
  /// `fused_rows` rows (0: offsets.back()).
  Tensor forward(const Tensor& x, std::span<const int64_t> offsets, Saved& saved,
                 ForwardMode mode = ForwardMode::normal, int64_t fused_rows = 0);
  /// The fused FP8 input (Linear::fused_input) of every expert: one FusedQuantize per expert,
  /// an empty one (out == nullptr) for experts without rows. nullopt, with `saved` untouched, unless
  /// every expert with rows can take one (delayed scaling, calibrated states). The producer writes
  /// expert g's rows into element g; the targets point into `saved`.
  std::optional<std::vector<ops::FusedQuantize>> fused_input(std::span<const int64_t> offsets,
                                                             DType dtype, Saved& saved,
                                                             ForwardMode mode = ForwardMode::normal);
  /// dx [rows, in] from dy [rows, out] (rows >= offsets.back(); dx's padding tail is zero);
  /// accumulates every expert's grad_weight and grad_bias
  /// (each bias gradient a fixed-order column sum of its own rows, no atomics).
  Tensor backward(const Tensor& dy, const Saved& saved);

  /// Linear::zero_grad / settle_grad / on_weights_updated for every expert.
  void zero_grad(ZeroGrad how = ZeroGrad::now);
  void settle_grad();
  void on_weights_updated(PreparedCast prepared = PreparedCast::dropped);

  int64_t experts() const { return static_cast<int64_t>(experts_.size()); }
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  const Device& device() const { return device_; }
  Linear& expert(int64_t g) { return experts_.at(static_cast<size_t>(g)); }
  const Linear& expert(int64_t g) const { return experts_.at(static_cast<size_t>(g)); }

 private:
  void check_offsets(std::span<const int64_t> offsets) const;

  int64_t in_ = 0, out_ = 0;
  Device device_;
  std::vector<Linear> experts_;
};

}  // namespace octet::nn
