// The GPT-style language model (GPT-2 or Llama flavour) built from nn modules, with explicit
// forward and backward over one microbatch.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "octet/core/tensor.h"
#include "octet/fp8/recipe.h"
#include "octet/nn/fp8_state.h"
#include "octet/nn/linear.h"
#include "octet/nn/moe.h"
#include "octet/train/config.h"

namespace octet::nn {
class Linear;
}

namespace octet::train {

/// The GEMM precision of a run: fp32, bf16 (BF16 GEMMs and activations), or fp8 under a recipe
/// (FP8 GEMMs in the transformer blocks, BF16 activations; embeddings, norms, attention and the
/// LM head stay in BF16, as Transformer Engine does).
struct Precision {
  enum class Kind : uint8_t { fp32, bf16, fp8 } kind = Kind::fp8;
  fp8::Recipe recipe;  ///< fp8 only

  /// fp8-delayed, fp8-current, fp8-block, fp8-mxfp8, bf16, fp32.
  static Precision from_name(std::string_view name);
  std::string name() const;
  /// Activation dtype: f32 for fp32, bf16 otherwise.
  DType activation_dtype() const;
  /// Whether the optimizer step writes the blocks' Linear weight casts for the next forward
  /// (nn::Linear::optimizer_writes_cast for this precision's format): bf16, and fp8 under delayed
  /// scaling.
  bool optimizer_writes_weight_casts() const;
};

/// A trainable tensor: FP32 master value and FP32 gradient on its stage's device.
struct Parameter {
  std::string name;  ///< e.g. "blocks.3.attn.qkv.weight" (checkpoint tensor name)
  Tensor value;
  Tensor grad;
  bool weight_decay = true;  ///< false for biases, norms and (tied) embeddings' position table
};

/// What the optimizer writes with a parameter's update (GPT::next_casts): the fields of
/// ops::AdamWTensor of the same names.
struct ParamCast {
  const ops::FusedQuantize* cast = nullptr;
  Tensor bf16_copy;
};

/// The nn::Linear a parameter belongs to (GPT::param_layers).
struct ParamLayer {
  nn::Linear* layer = nullptr;  ///< none: not a Linear's
  bool weight = false;          ///< the layer's weight, else its bias
};

/// One FP8 GEMM module, for statistics and checkpoints. Under fp8 precision the model creates
/// every module's FP8 state at construction (on the module's device) and registers it, so a
/// checkpoint can be restored into it before the first step.
struct Fp8Module {
  std::string name;  ///< e.g. "blocks.3.mlp.fc1"
  const nn::Linear* linear = nullptr;
  std::shared_ptr<nn::FP8State> state;
};

/// Quantization health of one FP8 module at the last statistics step: what each of its three
/// casts (nn::CastStats) did to the input, the weight and the gradient (grad_output).
struct Fp8LayerStats {
  std::string name;
  nn::CastStats input, weight, grad_output;
};

/// The routing of one MoE layer at the last training microbatch.
struct MoeLayerStats {
  int64_t layer = 0;  ///< the block's index
  nn::MoE::Load load;
};

/// Told by a training backward when parameters' gradients are final, so that data parallelism
/// can start reducing them while the backward goes on (grad_buckets.h).
class GradientReadyHook {
 public:
  virtual ~GradientReadyHook() = default;
  /// Every parameter from index `first` on (parameters() order) holds its final gradient of the
  /// step (the ones zero_grad(on_next_write) left unwritten are zeroed first). One backward
  /// calls it with decreasing `first`, the last time with 0.
  virtual void gradients_ready(size_t first) = 0;
};

class GPT {
 public:
  /// Builds the model on `device` with weights drawn from `seed` (deterministic).
  /// recompute: keep only each block's input and scales, and recompute during backward.
  /// amax_reducer: the registry's all-reduce of the FP8 amaxes over the data-parallel group
  /// (dist::make_amax_reducer); none: this process alone.
  GPT(const ModelConfig& config, const Precision& precision, const Device& device, uint64_t seed,
      bool recompute, std::shared_ptr<nn::AmaxReducer> amax_reducer = nullptr);
  /// Builds the model split into contiguous stages of blocks over `stages` (several GPUs, one
  /// process): stage s holds blocks [s L / S, (s + 1) L / S) of the L layers, the embeddings go
  /// with the first stage, the final norm and the head with the last. Activations and gradients
  /// cross between stages as stream-ordered copies, and a tied head reads the embedding through a
  /// copy on the last stage and adds its gradient to the embedding's in the one-device order, so
  /// every result is bitwise the one-device model's. A device may repeat (the stages' copies
  /// then run on one GPU). Needs 1 <= S <= L.
  GPT(const ModelConfig& config, const Precision& precision, const std::vector<Device>& stages,
      uint64_t seed, bool recompute, std::shared_ptr<nn::AmaxReducer> amax_reducer = nullptr);
  ~GPT();
  GPT(const GPT&) = delete;
  GPT& operator=(const GPT&) = delete;

  const ModelConfig& config() const;
  const Precision& precision() const;
  /// The first stage's device: the embeddings', where ids go in.
  const Device& device() const;
  /// Every stage's device, first to last (one entry for an unsplit model).
  const std::vector<Device>& devices() const;

  /// One training microbatch: forward, loss, backward. ids/targets: i32 [batch*seq] (any device;
  /// copied to the model's device). Gradients accumulate (+=) scaled by grad_scale (e.g.
  /// 1/accumulation steps). Returns the mean loss over the microbatch's tokens. Exactly one FP8
  /// forward and one backward state update happen per call.
  float train_microbatch(const Tensor& ids, const Tensor& targets, int64_t batch, int64_t seq,
                         float grad_scale);
  /// Mean loss without gradients and without touching FP8 state (evaluation).
  float evaluate(const Tensor& ids, const Tensor& targets, int64_t batch, int64_t seq);
  /// Logits at `position` of each sequence: f32 [batch, vocab] on the CPU (generation). Causal
  /// attention makes them independent of the tokens after `position`, so callers may pad the
  /// sequence (FP8 GEMMs need batch*seq to be a multiple of 16). No FP8 state changes.
  Tensor logits_at(const Tensor& ids, int64_t batch, int64_t seq, int64_t position);

  /// Every trainable parameter, in a fixed order (the optimizer's and the checkpoint's order).
  std::vector<Parameter> parameters();
  /// The FP8 GEMM modules in registration order.
  std::vector<Fp8Module> fp8_modules() const;
  nn::AmaxRegistry& registry();

  /// When on, the next train_microbatch also measures Fp8LayerStats for every FP8 module (a few
  /// extra passes and host reads per module: use it every N steps, not every step). It changes
  /// no result: the measured gradients take unfused paths, which are bitwise the fused ones.
  void set_collect_fp8_stats(bool on);
  /// The statistics of the last microbatch that collected them, in fp8_modules() order.
  std::vector<Fp8LayerStats> fp8_layer_stats() const;
  /// Per MoE layer, in layer order: tokens per expert and the aux and z losses of the last
  /// training microbatch (read from the device now). Empty for a dense model.
  std::vector<MoeLayerStats> moe_layer_stats() const;

  /// Zeroes every gradient; `how` applies to the blocks' Linear and norm gradients and the final
  /// norm's (nn::ZeroGrad: on_next_write skips their zeroing; call settle_grads() before reading
  /// them). The embedding and head gradients are zeroed now.
  void zero_grad(nn::ZeroGrad how = nn::ZeroGrad::now);
  /// Zeroes the gradients that zero_grad(on_next_write) left for a backward that did not come;
  /// free when every module ran its backward. Call before reading gradients.
  void settle_grads();
  /// For each of parameters(), in its order, what the optimizer writes with its update so that
  /// the next forward casts nothing (nn::Linear::prepare_next_cast: a Linear weight's FP8 cast or
  /// bf16 copy, a Linear bias's bf16 copy; empty for everything else); call after the step's
  /// last backward: this step's casts are dropped.
  std::vector<ParamCast> next_casts();
  /// For each of parameters(), in its order, the nn::Linear it belongs to, if any. A Linear's
  /// weight is a master read only to make that layer's casts, which ZeRO-1 keeps on one rank.
  std::vector<ParamLayer> param_layers();
  /// The optimizer changed the master weights: FP8/BF16 weight casts are redone next forward,
  /// or, with nn::PreparedCast::written, adopted where the optimizer wrote next_casts().
  void on_weights_updated(nn::PreparedCast prepared = nn::PreparedCast::dropped);
  /// Bytes of the weight casts held now: every Linear's (nn::Linear::weight_cast_bytes) and the
  /// head's copy in the activation dtype. Between steps these are the casts the next forward
  /// uses, so the same bytes are held at a step's peak.
  int64_t weight_cast_bytes();

  /// The next train_microbatch calls `hook` as each part's gradients become final: the head (when
  /// not tied), the final norm, each block from the last, the embeddings. Set it for a step's
  /// last microbatch only: later backwards must not add to the gradients. Null: none.
  void set_gradient_ready_hook(GradientReadyHook* hook);

  /// Testing aid (fault injection): called with block `layer`'s output [batch*seq, dim] in every
  /// training forward, before the next block reads it. Empty: none (the default).
  using ActivationHook = std::function<void(int64_t layer, const Tensor& x)>;
  void set_activation_hook(ActivationHook hook);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace octet::train
