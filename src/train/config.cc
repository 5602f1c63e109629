#include "octet/train/config.h"

#include <cmath>
#include <sstream>

#include "core/int_math.h"
#include "octet/core/error.h"
#include "octet/ops/moe.h"

namespace octet::train {
namespace {
// The FP8 GEMM shape rule (cuBLASLt): every GEMM dimension a multiple of 16.
constexpr int64_t kShapeMultiple = 16;

ModelConfig make(std::string name, Arch arch, int64_t layers, int64_t dim, int64_t heads,
                 int64_t ffn, int64_t vocab, int64_t max_seq) {
  ModelConfig c;
  c.preset = std::move(name);
  c.arch = arch;
  c.layers = layers;
  c.dim = dim;
  c.heads = heads;
  c.ffn = ffn;
  c.vocab = vocab;
  c.max_seq = max_seq;
  return c;
}
}  // namespace

ops::MoeActivation ModelConfig::moe_activation_kind() const {
  for (auto act : {ops::MoeActivation::swiglu, ops::MoeActivation::geglu,
                   ops::MoeActivation::srelu, ops::MoeActivation::gelu})
    if (moe_activation == ops::moe_activation_name(act)) return act;
  OCTET_ERROR("unknown MoE activation '", moe_activation, "'; expected swiglu, geglu, srelu or gelu");
}

std::string_view arch_name(Arch arch) { return arch == Arch::gpt2 ? "gpt2" : "llama"; }

// GPT-2 sizes from the GPT-2 paper (vocab 50257 padded to 50304 as llm.c does); llama-1b follows
// Llama 3.2 1B's depth and width with multi-head attention and a byte-level-friendly vocab.
ModelConfig model_preset(std::string_view name) {
  if (name == "tiny") return make("tiny", Arch::gpt2, 2, 128, 4, 512, 256, 128);
  if (name == "gpt2-124m") return make("gpt2-124m", Arch::gpt2, 12, 768, 12, 3072, 50304, 1024);
  if (name == "gpt2-350m") return make("gpt2-350m", Arch::gpt2, 24, 1024, 16, 4096, 50304, 1024);
  if (name == "gpt2-1.5b") return make("gpt2-1.5b", Arch::gpt2, 48, 1600, 25, 6400, 50304, 1024);
  if (name == "moe-tiny") {  // trains on a CPU in seconds
    ModelConfig c = make("moe-tiny", Arch::gpt2, 2, 128, 4, 256, 256, 128);
    c.experts = 4;
    c.topk = 2;
    return c;
  }
  if (name == "moe-16x2048") {  // the field shape of FIELD-NOTES section 3, Llama-style
    ModelConfig c = make("moe-16x2048", Arch::llama, 4, 2048, 16, 2048, 32000, 1024);
    c.experts = 16;
    c.topk = 2;
    c.rope_theta = 500000.0f;
    return c;
  }
  if (name == "llama-1b") {
    ModelConfig c = make("llama-1b", Arch::llama, 16, 2048, 32, 5632, 32000, 2048);
    c.rope_theta = 500000.0f;
    return c;
  }
  std::ostringstream names;
  for (const auto& n : model_preset_names()) names << " " << n;
  OCTET_ERROR("unknown model preset '", name, "'; expected one of:", names.str());
}

std::vector<std::string> model_preset_names() {
  return {"tiny", "gpt2-124m", "gpt2-350m", "gpt2-1.5b", "llama-1b", "moe-tiny", "moe-16x2048"};
}

ops::RouterScoring ModelConfig::router_scoring() const {
  for (ops::RouterScoring s : {ops::RouterScoring::softmax, ops::RouterScoring::sigmoid})
    if (router == ops::router_scoring_name(s)) return s;
  OCTET_ERROR("unknown MoE router '", router, "'; expected softmax or sigmoid");
}

int64_t ModelConfig::parameter_count() const {
  const int64_t embeddings = vocab * dim + (arch == Arch::gpt2 ? max_seq * dim : 0);
  const int64_t head = tied_embeddings() ? 0 : vocab * dim;
  const int64_t norm = arch == Arch::gpt2 ? 2 * dim : dim;  // gamma (+ beta)
  const int64_t bias = arch == Arch::gpt2 ? 1 : 0;
  const int64_t attention = dim * 3 * dim + dim * dim + bias * (3 * dim + dim);
  const int64_t mlp_in = arch == Arch::llama ? 2 * ffn : ffn;
  const int64_t mlp = dim * mlp_in + ffn * dim + bias * (mlp_in + dim);
  int64_t blocks = 0;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t expert_in = ops::moe_activation_input_cols(moe_activation_kind(), ffn);
    const int64_t moe = experts * (dim * expert_in + ffn * dim + bias * (expert_in + dim)) +
                        experts * dim +  // the experts and the router
                        (shared_expert ? mlp : 0);
    blocks += 2 * norm + attention + (is_moe_layer(l) ? moe : mlp);
  }
  return embeddings + head + blocks + norm;
}

void ModelConfig::validate() const {
  OCTET_CHECK(layers > 0 && dim > 0 && heads > 0 && ffn > 0 && vocab > 0 && max_seq > 0,
              "model sizes must be positive, got layers ", layers, ", dim ", dim, ", heads ", heads,
              ", ffn ", ffn, ", vocab ", vocab, ", seq ", max_seq);
  OCTET_CHECK(dim % heads == 0, "heads (", heads, ") must divide dim (", dim, ")");
  OCTET_CHECK(dim % kShapeMultiple == 0 && ffn % kShapeMultiple == 0,
              "dim (", dim, ") and ffn (", ffn, ") must be multiples of ", kShapeMultiple,
              " (the FP8 GEMM shape rule)");
  OCTET_CHECK(arch == Arch::gpt2 || head_dim() % 2 == 0,
              "RoPE needs an even head dimension, got ", head_dim());
  if (experts > 0) {
    OCTET_CHECK(topk >= 1 && topk <= experts, "--topk (", topk, ") must be in [1, --experts = ",
                experts, "]");
    OCTET_CHECK(moe_every >= 1 && moe_every <= layers, "--moe-every (", moe_every,
                ") must be in [1, layers = ", layers, "]");
    OCTET_CHECK(aux_loss_coef >= 0.0f, "--aux-loss-coef must be >= 0, got ", aux_loss_coef);
    OCTET_CHECK(z_loss_coef >= 0.0f && std::isfinite(z_loss_coef),
                "--z-loss-coef must be a finite number >= 0, got ", z_loss_coef);
    moe_activation_kind();  // throws on an unknown name
    router_scoring();
  }
  OCTET_CHECK(vocab % kShapeMultiple == 0, "vocab (", vocab, ") must be a multiple of ",
              kShapeMultiple, "; use ", round_up(vocab, kShapeMultiple));
}

std::string ModelConfig::describe() const {
  std::ostringstream out;
  out << preset << " (" << arch_name(arch) << ", " << layers << " layers, dim " << dim << ", "
      << heads << " heads, ffn " << ffn << ", vocab " << vocab << ", seq " << max_seq << ", "
      << parameter_count() / 1e6 << "M parameters";
  if (experts > 0) {
    out << "; MoE: " << experts << " experts, top-" << topk << ", " << moe_activation
        << ", every " << moe_every << (moe_every == 1 ? " layer" : " layers") << ", aux loss "
        << aux_loss_coef << ", " << router << " router";
    if (z_loss_coef > 0.0f) out << ", z-loss " << z_loss_coef;
    if (shared_expert) out << ", shared expert";
  }
  out << ")";
  return out.str();
}

}  // namespace octet::train
