// nn::MoE: a mixture-of-experts layer with explicit forward and backward. An FP32 router picks
// top-k experts per token, the routed rows are laid out expert by expert (ops::moe_plan), FC1 and
// FC2 run as nn::GroupedLinear (FP8 per expert under fp8_autocast), the activation is scaled by
// the router's probability, and the combine sums each token's k expert rows. An optional shared
// expert (a dense nn::MLP) adds to every token's output.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "octet/core/tensor.h"
#include "octet/nn/block_config.h"
#include "octet/nn/grouped_linear.h"
#include "octet/nn/linear.h"
#include "octet/nn/mlp.h"
#include "octet/ops/moe.h"

namespace octet::nn {

/// Router + experts of one layer on one device. Forward:
///   logits = x Wr^T (FP32: routers are not run in FP8), router_forward -> expert, prob;
///   moe_plan; dispatch; fc1; h = act(fc1) * prob (+ per-expert bias) (under delayed scaling,
///   once calibrated, written straight into FC2's per-expert FP8 inputs); fc2; combine;
///   y = combine + shared(x) + residual.
/// The group offsets of the plan are read back to the host once per forward (a host
/// synchronisation per layer): the per-expert GEMMs need their row ranges on the host.
///
/// Every reduction of the layer runs in one fixed order (docs/DETERMINISM.md): repeated runs are
/// bitwise equal. With recompute, forward keeps only the input and the Linear layers' snapshots;
/// backward rebuilds the record with ForwardMode::recompute (the router and plan are recomputed
/// from the same input, the experts quantize with the original scales and touch no FP8 state), so
/// the gradients are bitwise those of a run without recompute.
class MoE {
 public:
  struct Saved {
    Tensor input;           ///< x [tokens, dim]: kept by every record that backward can use
    bool complete = false;  ///< the full record; otherwise only the input and the snapshots
    Tensor logits;          ///< f32 [tokens, experts]
    ops::RouterOutputs router;
    ops::MoePlan plan;
    std::vector<int64_t> offsets;  ///< plan.offsets on the host
    GroupedLinear::Saved fc1;
    Tensor fc1_out;   ///< [capacity, fc1 columns]: the activation's input
    Tensor row_prob;  ///< f32 [capacity]: the gate value of each permuted row
    GroupedLinear::Saved fc2;
    MLP::Saved shared;  ///< the shared expert's record (with shared_expert only)

    /// A record holding only the Linear layers' snapshots (and the input when keep_input): pass
    /// it to forward(..., ForwardMode::recompute) to rebuild this record bit for bit.
    Saved for_recompute(bool keep_input) const;
  };

  /// Tokens per expert and the router's losses of one forward, read to the host.
  struct Load {
    std::vector<int64_t> tokens;  ///< routed (token, slot) pairs per expert
    float aux_loss = 0.0f;        ///< the load-balancing loss (0 when its coefficient is 0)
    float z_loss = 0.0f;          ///< the router z-loss (0 when its coefficient is 0)
  };

  /// config.moe must be enabled. The router weight [experts, dim] and the experts (fc1: dim ->
  /// ffn, or 2 ffn for SwiGLU/GeGLU; fc2: ffn -> dim, biases per config.bias) are drawn from
  /// `seed`; compute_dtype as for nn::Linear. recompute: see the class comment.
  MoE(const BlockConfig& config, const Device& device, uint64_t seed, DType compute_dtype,
      bool recompute = false);

  /// y [tokens, dim] (x's dtype) from x [tokens, dim] f32|bf16, plus `residual` (optional, like
  /// y). ForwardMode::recompute rebuilds the record from `saved` (for_recompute's); inference
  /// leaves `saved` empty.
  Tensor forward(const Tensor& x, Saved& saved, ForwardMode mode = ForwardMode::normal,
                 const Tensor& residual = Tensor());
  /// dx from dy; rebuilds the record first when it is not complete. Accumulates every parameter
  /// gradient: the router's through dprob and through the aux and z losses, whose gradients are
  /// scaled by aux_loss_scale (their weight in the caller's loss, e.g. 1 / microbatches).
  /// Releases the record.
  Tensor backward(const Tensor& dy, Saved& saved, float aux_loss_scale = 1.0f);

  /// The load and losses of the last training forward (ForwardMode::normal); nullopt before one.
  /// Reads them from the device (a host synchronisation).
  std::optional<Load> last_load() const;
  /// dL/dprob (f32 [tokens, topk]) of the last backward: the gradient the router receives from the
  /// experts (kept for tests and diagnostics; undefined before a backward).
  const Tensor& last_dprob() const { return last_dprob_; }

  /// Zeroes every gradient, now or at its next write (ZeroGrad).
  void zero_grad(ZeroGrad how = ZeroGrad::now);
  /// Zeroes the gradients still waiting for their write (Linear::settle_grad).
  void settle_grad();
  /// Linear::on_weights_updated for every Linear of the layer.
  void on_weights_updated(PreparedCast prepared = PreparedCast::dropped);

  const MoeConfig& config() const { return config_; }
  int64_t experts() const { return config_.experts; }
  /// FP32 router weight [experts, dim] and its gradient.
  const Tensor& router_weight() const { return router_weight_; }
  const Tensor& router_grad() const { return router_grad_; }
  /// FP32 per-expert activation bias [experts, ffn] and its gradient (activation_bias only).
  const Tensor& activation_bias() const { return activation_bias_; }
  const Tensor& activation_bias_grad() const { return activation_bias_grad_; }
  GroupedLinear& fc1() { return fc1_; }
  GroupedLinear& fc2() { return fc2_; }
  const GroupedLinear& fc1() const { return fc1_; }
  const GroupedLinear& fc2() const { return fc2_; }
  /// The shared expert, or nullptr.
  MLP* shared() { return shared_ ? &*shared_ : nullptr; }
  const MLP* shared() const { return shared_ ? &*shared_ : nullptr; }

 private:
  /// The router's settings; the aux and z coefficients multiplied by `loss_scale`.
  ops::RouterArgs router_args(float loss_scale = 1.0f) const;

  MoeConfig config_;
  int64_t dim_, ffn_;
  Device device_;
  bool recompute_;
  Tensor router_weight_, router_grad_;
  Tensor activation_bias_, activation_bias_grad_;
  GroupedLinear fc1_;
  GroupedLinear fc2_;
  std::optional<MLP> shared_;
  /// zero_grad(ZeroGrad::on_next_write) with no backward since: the router and bias gradients'
  /// next write overwrites them.
  bool grads_unwritten_ = false;
  /// The last training forward's router outputs (device tensors), for last_load().
  Tensor last_counts_, last_aux_loss_, last_z_loss_;
  Tensor last_dprob_;
};

}  // namespace octet::nn
