// The sizes and flavour of a transformer block, its mixture-of-experts variant included.
#pragma once

#include <cstdint>

#include "octet/ops/activation.h"
#include "octet/ops/moe.h"

namespace octet::nn {

enum class NormKind : uint8_t {
  layernorm,  ///< (x - mean) * rstd * gamma + beta
  rmsnorm,    ///< x * rstd * gamma
};

/// A block's mixture-of-experts layer (nn::MoE): router, experts, optional shared expert.
struct MoeConfig {
  int64_t experts = 0;  ///< 0: the block has a dense MLP
  int64_t topk = 2;     ///< experts per token
  ops::RouterScoring scoring = ops::RouterScoring::softmax;
  ops::MoeActivation activation = ops::MoeActivation::swiglu;
  /// Load-balancing loss weight (Switch/Mixtral form, ops::RouterArgs); 0 turns it off.
  float aux_loss_coef = 0.01f;
  /// Router z-loss weight (ST-MoE); 0 turns it off.
  float z_loss_coef = 0.0f;
  /// A dense MLP of width ffn every token goes through, added to the routed output.
  bool shared_expert = false;
  /// A per-expert bias on the activation's output (ops::moe_scaled_activation_forward's bias).
  bool activation_bias = false;

  bool enabled() const { return experts > 0; }
};

/// Sizes and flavour of a block.
struct BlockConfig {
  NormKind norm = NormKind::layernorm;
  int64_t dim = 0;
  int64_t heads = 0;
  int64_t ffn = 0;  ///< MLP hidden width (per branch for SwiGLU)
  ops::Activation activation = ops::Activation::gelu;
  bool bias = true;   ///< biases on the four Linear layers
  bool rope = false;  ///< rotary position embeddings on q and k
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  /// A mixture-of-experts layer (nn::MoE) instead of the dense MLP when moe.enabled().
  MoeConfig moe;
};

}  // namespace octet::nn
