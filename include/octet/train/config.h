// Model configurations: GPT-2 style and Llama style, with named presets.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "octet/ops/moe.h"

namespace octet::train {

enum class Arch : uint8_t {
  gpt2,   ///< LayerNorm, GELU, learned positions, tied embeddings
  llama,  ///< RMSNorm, SwiGLU, RoPE, untied embeddings
};

struct ModelConfig {
  std::string preset = "custom";
  Arch arch = Arch::gpt2;
  int64_t layers = 2;
  int64_t dim = 128;
  int64_t heads = 4;
  int64_t ffn = 512;       ///< hidden width of the MLP (per branch for SwiGLU)
  int64_t vocab = 256;     ///< rounded up to a multiple of 16 for the FP8/GEMM shape rules
  int64_t max_seq = 128;   ///< size of the position table (gpt2) / longest sequence
  float norm_eps = 1e-5f;
  float rope_theta = 10000.0f;
  /// Mixture of experts: 0 = dense. With experts > 0, every moe_every-th block (the 1st, 2nd, ...
  /// counted from 1: layer l when (l + 1) % moe_every == 0) has an nn::MoE of `experts` experts of
  /// width ffn, top-k routed, instead of its MLP.
  int64_t experts = 0;
  int64_t topk = 2;
  int64_t moe_every = 1;
  std::string moe_activation = "swiglu";  ///< swiglu, geglu, srelu or gelu
  float aux_loss_coef = 0.01f;            ///< load-balancing loss weight (0: off)
  std::string router = "softmax";         ///< the router's scoring: softmax or sigmoid
  float z_loss_coef = 0.0f;               ///< router z-loss weight (0: off)
  bool shared_expert = false;             ///< a dense MLP of width ffn every token also takes

  int64_t head_dim() const { return dim / heads; }
  bool tied_embeddings() const { return arch == Arch::gpt2; }
  /// moe_activation as an enum (throws on an unknown name).
  ops::MoeActivation moe_activation_kind() const;
  /// router as an enum (throws on an unknown name).
  ops::RouterScoring router_scoring() const;
  /// Whether block `layer` (0-based) is an MoE layer.
  bool is_moe_layer(int64_t layer) const {
    return experts > 0 && (layer + 1) % moe_every == 0;
  }
  /// Number of trainable parameters.
  int64_t parameter_count() const;
  /// Throws octet::Error naming the offending fields (heads must divide dim, sizes positive, ...).
  void validate() const;
  /// "gpt2-124m (12 layers, dim 768, 12 heads, ffn 3072, vocab 50304, seq 1024)".
  std::string describe() const;
};

/// Presets: tiny (CPU), gpt2-124m, gpt2-350m, gpt2-1.5b, llama-1b (Llama-style, MHA), and the
/// mixture-of-experts moe-tiny (CPU) and moe-16x2048 (GPU: 16 experts, top-2, hidden 2048).
ModelConfig model_preset(std::string_view name);
std::vector<std::string> model_preset_names();

std::string_view arch_name(Arch arch);

}  // namespace octet::train
