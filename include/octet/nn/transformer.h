// Transformer modules with explicit forward and backward: Norm (LayerNorm or RMSNorm), causal
// self-attention, MLP, and the pre-norm TransformerBlock with activation recompute.
//
// Activations flow in one dtype (f32 or bf16, the input's); parameters and gradients are FP32.
// The four Linear layers of a block run FP8 GEMMs under an active Fp8Autocast. Every module lives
// on one device.
#pragma once

#include <array>
#include <cstdint>
#include <optional>

#include "octet/core/tensor.h"
#include "octet/nn/block_config.h"
#include "octet/nn/linear.h"
#include "octet/nn/mlp.h"
#include "octet/nn/moe.h"
#include "octet/ops/attention.h"

namespace octet::nn {

/// LayerNorm or RMSNorm over the last dimension, FP32 gamma (ones) and beta (zeros, LayerNorm).
class Norm {
 public:
  /// What backward needs: the input (shared, not copied) and the row statistics.
  struct Saved {
    Tensor input;  ///< [rows, dim]
    Tensor mean;   ///< f32 [rows], LayerNorm only
    Tensor rstd;   ///< f32 [rows]
  };

  Norm(NormKind kind, int64_t dim, float eps, const Device& device);

  /// y (x's dtype and shape) = norm(x) for x [..., dim] f32|bf16; also writes y's FP8 copies when
  /// `fused` is given (Linear::fused_input of the Linear that consumes y). output = false (with
  /// `fused` only): y itself is not produced, and an undefined tensor is returned.
  Tensor forward(const Tensor& x, Saved& saved, const ops::FusedQuantize* fused = nullptr,
                 bool output = true) const;
  /// dx from dy (x's shape and dtype); accumulates grad_gamma (and grad_beta). With `residual`
  /// (like dy): returns dx + residual, in the same pass (the residual stream's other gradient).
  Tensor backward(const Tensor& dy, const Saved& saved, const Tensor& residual = Tensor());
  /// Zeroes grad_gamma and grad_beta, now or at the next backward's write (ZeroGrad).
  void zero_grad(ZeroGrad how = ZeroGrad::now);
  /// Zeroes gradients still waiting for their write (as Linear::settle_grad).
  void settle_grad();

  NormKind kind() const { return kind_; }
  int64_t dim() const { return dim_; }
  float eps() const { return eps_; }
  const Tensor& gamma() const { return gamma_; }
  /// Undefined for RMSNorm.
  const Tensor& beta() const { return beta_; }
  const Tensor& grad_gamma() const { return grad_gamma_; }
  const Tensor& grad_beta() const { return grad_beta_; }

 private:
  NormKind kind_;
  int64_t dim_;
  float eps_;
  Device device_;
  Tensor gamma_, beta_, grad_gamma_, grad_beta_;
  bool grads_unwritten_ = false;  ///< zero_grad(ZeroGrad::on_next_write) with no backward since
};

/// A norm and the Linear it feeds, as Transformer Engine's LayerNormLinear: y = linear(norm(x))
/// for x [..., dim], y [..., out]. Where the Linear can take its FP8 input from the producer (per-
/// tensor delayed scaling, Fusion::norm_cast), the norm writes it in its own pass and the
/// high-precision norm output is not made; otherwise the Linear casts that output. Fills both
/// records; a recompute (ForwardMode::recompute, linear_saved from the original's snapshot) gives
/// bitwise the original's.
Tensor norm_linear_forward(const Norm& norm, Linear& linear, const Tensor& x,
                           Norm::Saved& norm_saved, Linear::Saved& linear_saved,
                           ForwardMode mode = ForwardMode::normal);
/// dx [..., dim] (x's dtype) from dy [..., out]; accumulates the Linear's and the norm's gradients.
Tensor norm_linear_backward(Norm& norm, Linear& linear, const Tensor& dy,
                            const Norm::Saved& norm_saved, const Linear::Saved& linear_saved);

/// A norm and the MLP it feeds, as Transformer Engine's LayerNormMLP: y = fc2(act(fc1(norm(x))))
/// for x [..., dim], y [..., fc2.out_features()]. The norm writes fc1's FP8 input where it can (as
/// in norm_linear_forward) and the activation fc2's (as in MLP::forward). Recompute as
/// norm_linear_forward, with both Linears' records made from the original's snapshots.
Tensor norm_mlp_forward(const Norm& norm, ops::Activation activation, Linear& fc1, Linear& fc2,
                        const Tensor& x, Norm::Saved& norm_saved, MLP::Saved& mlp_saved,
                        ForwardMode mode = ForwardMode::normal);
/// dx [..., dim] (x's dtype) from dy; accumulates the three modules' gradients. Frees the MLP's
/// record as mlp_backward does.
Tensor norm_mlp_backward(Norm& norm, ops::Activation activation, Linear& fc1, Linear& fc2,
                         const Tensor& dy, const Norm::Saved& norm_saved, MLP::Saved& mlp_saved);

/// Causal multi-head self-attention: qkv = Linear(dim, 3 dim), optional RoPE on q and k,
/// attention, proj = Linear(dim, dim).
class Attention {
 public:
  struct Saved {
    ops::AttentionShape shape;
    Linear::Saved qkv;
    Tensor qkv_act;  ///< [rows, 3 dim], after RoPE: the attention's input
    Tensor out;      ///< [rows, dim]: the attention's output (proj's input)
    Tensor lse;      ///< f32 [batch, heads, seq]
    Linear::Saved proj;
  };

  Attention(const BlockConfig& config, const Device& device, uint64_t seed, DType compute_dtype);

  /// y [batch*seq, dim] from x [batch*seq, dim], plus `residual` (optional, like y) added in
  /// proj's GEMM epilogue (Linear::forward). For ForwardMode::recompute, saved.qkv and saved.proj
  /// must hold the snapshots of the original forward (Linear::Saved::from_snapshot).
  Tensor forward(const Tensor& x, int64_t batch, int64_t seq, Saved& saved,
                 ForwardMode mode = ForwardMode::normal, const LinearObserver* observer = nullptr,
                 const Tensor& residual = Tensor());
  /// dx from dy; accumulates the Linear gradients. Frees each part of `saved` after its last use.
  /// proj's FP8 input, which a training forward releases, is made again from saved.out first;
  /// qkv's record is used as it is (the block releases and rebuilds its FP8 input).
  Tensor backward(const Tensor& dy, Saved& saved);

  Linear& qkv() { return qkv_; }
  Linear& proj() { return proj_; }
  const Linear& qkv() const { return qkv_; }
  const Linear& proj() const { return proj_; }

 private:
  int64_t heads_;
  int64_t head_dim_;
  bool rope_;
  float rope_theta_;
  Linear qkv_;
  Linear proj_;
};

/// Pre-norm block: x = x + attn(norm1(x)); x = x + mlp(norm2(x)), where mlp is a dense MLP or,
/// when config.moe is enabled, an nn::MoE. The residual adds run in the epilogue of the GEMM
/// before them (proj's and the dense fc2's; the MoE adds its residual after its combine).
///
/// Under FP8, a training forward keeps no FP8 input of the block's Linear layers: each is the
/// cast of a tensor the record keeps anyway for another backward (norm1's input x for qkv, the
/// attention's output for proj, norm2's input for fc1, the activation's input for fc2), so
/// backward makes it again just before that Linear's backward, with the forward's scales and
/// recording no amax: the same bytes, for one more cast pass each.
///
/// With recompute, forward keeps only the block's input and each Linear's Snapshot (the scales
/// and weight cast in use); backward first rebuilds the full record with ForwardMode::recompute,
/// which touches no FP8 state and reproduces the same bytes, so the gradients are bitwise those
/// of a run without recompute (DESIGN.md rule 1).
class TransformerBlock {
 public:
  struct Saved {
    Tensor input;  ///< [batch*seq, dim], always kept
    int64_t batch = 0;
    int64_t seq = 0;
    /// The full record: filled by a forward without recompute, or rebuilt by backward.
    bool complete = false;
    Norm::Saved norm1;
    Attention::Saved attn;
    Tensor residual;  ///< input + attention output: norm2's input
    Norm::Saved norm2;
    MLP::Saved mlp;
    /// The MoE layer's record; with recompute, only its Linear layers' snapshots.
    MoE::Saved moe;
    /// With recompute: each Linear's Snapshot, in LinearSlot order (fc1 and fc2 empty in an MoE
    /// block).
    std::array<Linear::Snapshot, kBlockLinears> snapshots;
  };

  TransformerBlock(const BlockConfig& config, const Device& device, uint64_t seed,
                   DType compute_dtype, bool recompute);

  /// y [batch*seq, dim] (x's dtype) from x [batch*seq, dim] f32|bf16. ForwardMode::inference
  /// leaves `saved` empty (no backward follows). `observer` sees each Linear's input.
  Tensor forward(const Tensor& x, int64_t batch, int64_t seq, Saved& saved,
                 ForwardMode mode = ForwardMode::normal, const LinearObserver* observer = nullptr);
  /// dx from dy; recomputes the forward first when the record is not complete. Accumulates every
  /// parameter gradient and releases the record. aux_loss_scale: the weight of an MoE layer's aux
  /// and z losses in the caller's loss (MoE::backward).
  Tensor backward(const Tensor& dy, Saved& saved, float aux_loss_scale = 1.0f);

  /// Zeroes every gradient, now or at its next write (ZeroGrad).
  void zero_grad(ZeroGrad how = ZeroGrad::now);
  /// settle_grad for every Linear and norm of the block.
  void settle_grads();
  /// Linear::on_weights_updated for every Linear of the block.
  void on_weights_updated(PreparedCast prepared = PreparedCast::dropped);

  bool recompute() const { return recompute_; }
  const BlockConfig& config() const { return config_; }
  Norm& norm1() { return norm1_; }
  Norm& norm2() { return norm2_; }
  Attention& attn() { return attn_; }
  /// The dense MLP (is_moe() false) or the MoE layer (is_moe() true); the other throws.
  MLP& mlp();
  MoE& moe();
  const MoE& moe() const;
  bool is_moe() const { return moe_.has_value(); }
  /// The block's Linear in `slot`; fc1 and fc2 exist only in a dense block (throws otherwise).
  Linear& linear(LinearSlot slot);
  const Linear& linear(LinearSlot slot) const;
  /// Whether the block has a Linear in `slot` (fc1 and fc2: only a dense block).
  bool has_linear(LinearSlot slot) const;

 private:
  /// The full forward into `saved` (snapshots already in place for recompute).
  Tensor forward_full(const Tensor& x, Saved& saved, ForwardMode mode,
                      const LinearObserver* observer);

  BlockConfig config_;
  bool recompute_;
  Norm norm1_;
  Attention attn_;
  Norm norm2_;
  std::optional<MLP> mlp_;  ///< a dense block's
  std::optional<MoE> moe_;  ///< an MoE block's
};

}  // namespace octet::nn
