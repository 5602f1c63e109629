#include "octet/train/model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <numbers>
#include <optional>
#include <tuple>
#include <utility>

#include "octet/core/hash.h"
#include "octet/fp8/format.h"
#include "octet/nn/autocast.h"
#include "octet/nn/linear.h"
#include "octet/nn/transformer.h"
#include "octet/ops/embedding.h"
#include "octet/ops/gemm.h"
#include "octet/ops/quantize.h"

namespace octet::train {
namespace {

using nn::LinearSlot;

/// GPT-2's initialization: weights N(0, 0.02); the residual projections (attn.proj, mlp.fc2)
/// N(0, 0.02 / sqrt(2 * layers)) so the residual stream's variance does not grow with depth
/// (GPT-2 paper, section 2.3; llm.c). Used for both architectures.
constexpr float kInitStd = 0.02f;

/// splitmix64's increment (mix64 is its finalizer, core/hash.h): a counter-based generator, so
/// every element's draw depends only on (seed, parameter name, index), never on the device or
/// the thread that computes it.
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

/// Mantissa bits of a double: a draw keeps that many bits for a uniform in (0, 1].
constexpr int kDoubleMantissaBits = 53;

/// Uniform in (0, 1] from the counter `n` of the stream `key` (never 0, so log() is finite).
double uniform_open0(uint64_t key, uint64_t n) {
  const uint64_t bits = mix64(key + kGolden * (n + 1)) >> (64 - kDoubleMantissaBits);
  return std::ldexp(static_cast<double>(bits + 1), -kDoubleMantissaBits);
}

/// `count` draws of N(0, std) for the stream `key` (Box-Muller on consecutive counter pairs).
std::vector<float> normal_values(uint64_t key, int64_t count, float std) {
  std::vector<float> values(static_cast<size_t>(count));
  const int64_t pairs = (count + 1) / 2;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < pairs; ++p) {
    const double radius = std::sqrt(-2.0 * std::log(uniform_open0(key, 2 * p)));
    const double angle = 2.0 * std::numbers::pi * uniform_open0(key, 2 * p + 1);
    values[2 * p] = static_cast<float>(std * radius * std::cos(angle));
    if (2 * p + 1 < count) values[2 * p + 1] = static_cast<float>(std * radius * std::sin(angle));
  }
  return values;
}

enum class Init : uint8_t { normal, residual, zeros, ones };

/// One trainable tensor with its name, weight decay and initialization.
struct Entry {
  std::string name;
  Tensor value;
  Tensor grad;
  bool weight_decay;
  Init init;
  nn::Linear* weight_of = nullptr;  ///< the Linear whose weight `value` is, if any
  nn::Linear* bias_of = nullptr;    ///< the Linear whose bias `value` is, if any
};

constexpr const char* kSlotNames[nn::kBlockLinears] = {"attn.qkv", "attn.proj", "mlp.fc1",
                                                       "mlp.fc2"};

std::string module_name(size_t layer, LinearSlot slot) {
  return "blocks." + std::to_string(layer) + "." + kSlotNames[static_cast<int>(slot)];
}

/// One GEMM Linear of a block with its checkpoint/statistics name and initialization.
struct NamedLinear {
  std::string name;
  nn::Linear* linear;
  Init init;
};

/// Every Linear of block `layer`, in registration order: qkv, proj, then the dense fc1 and fc2,
/// or an MoE's experts ("blocks.3.moe.fc1.experts.5"), fc1's then fc2's, and its shared expert.
std::vector<NamedLinear> block_linears(nn::TransformerBlock& block, size_t layer) {
  std::vector<NamedLinear> out;
  for (LinearSlot slot : {LinearSlot::qkv, LinearSlot::proj, LinearSlot::fc1, LinearSlot::fc2}) {
    if (!block.has_linear(slot)) continue;
    const bool residual = slot == LinearSlot::proj || slot == LinearSlot::fc2;
    out.push_back({module_name(layer, slot), &block.linear(slot),
                   residual ? Init::residual : Init::normal});
  }
  if (!block.is_moe()) return out;
  nn::MoE& moe = block.moe();
  const std::string prefix = "blocks." + std::to_string(layer) + ".moe.";
  for (auto [name, group, init] : {std::tuple{"fc1", &moe.fc1(), Init::normal},
                                   std::tuple{"fc2", &moe.fc2(), Init::residual}}) {
    for (int64_t g = 0; g < group->experts(); ++g)
      out.push_back({prefix + name + ".experts." + std::to_string(g), &group->expert(g), init});
  }
  if (nn::MLP* shared = moe.shared()) {
    out.push_back({prefix + "shared.fc1", &shared->fc1(), Init::normal});
    out.push_back({prefix + "shared.fc2", &shared->fc2(), Init::residual});
  }
  return out;
}

/// t on `device` (t itself when it is there already).
Tensor on_device(const Tensor& t, const Device& device) {
  return t.device() == device ? t : t.to(device);
}

/// Checks an i32 [rows] id/target tensor and returns it on `device` as [rows].
Tensor token_tensor(const Tensor& t, int64_t rows, const Device& device, const char* what) {
  OCTET_CHECK(t.defined(), "GPT: ", what, " is an undefined tensor");
  OCTET_CHECK(t.dtype() == DType::i32 && t.numel() == rows, "GPT: ", what,
              " must be i32 with batch*seq = ", rows, " elements, got ", t.describe());
  return on_device(t, device).view({rows});
}

/// Targets that count towards the loss (a negative target is ignored), counted on the host.
int64_t counted_targets(const Tensor& targets) {
  const Tensor host = targets.to(Device::cpu());
  const int32_t* t = host.data<int32_t>();
  return std::count_if(t, t + host.numel(), [](int32_t v) { return v >= 0; });
}

/// The mean of the per-row losses (f32, any device; ignored rows hold 0) over the counted
/// targets, summed on the host in row order in float64. 0 when no target counts (such a
/// microbatch also contributes no gradient).
float mean_loss(const Tensor& losses, int64_t counted) {
  if (counted == 0) return 0.0f;
  double total = 0;
  for (float v : host_values_f32(losses)) total += v;
  return static_cast<float>(total / static_cast<double>(counted));
}

/// The stages' devices after checking that there are 1 to `layers` of them.
std::vector<Device> checked_stages(const std::vector<Device>& stages, int64_t layers) {
  OCTET_CHECK(!stages.empty(), "GPT: no device to build the model on");
  OCTET_CHECK(static_cast<int64_t>(stages.size()) <= layers, "GPT: a split over ", stages.size(),
              " devices (", device_list_str(stages), ") needs at least as many layers, got ",
              layers);
  for (const Device& d : stages) check_device_available(d);
  return stages;
}

/// The config, after validate() (which throws naming the offending fields).
ModelConfig validated(const ModelConfig& config) {
  config.validate();
  return config;
}

/// The precision, after validating its recipe (fp8 only).
Precision validated(const Precision& precision) {
  if (precision.kind == Precision::Kind::fp8) precision.recipe.validate();
  return precision;
}

}  // namespace

// ----------------------------------------------------------------------------
// Precision

Precision Precision::from_name(std::string_view name) {
  Precision p;
  if (name == "fp32") {
    p.kind = Kind::fp32;
  } else if (name == "bf16") {
    p.kind = Kind::bf16;
  } else {
    OCTET_CHECK(name.starts_with("fp8-"), "unknown precision '", name,
                "'; expected fp8-delayed, fp8-current, fp8-block, fp8-mxfp8, bf16 or fp32");
    p.kind = Kind::fp8;
    p.recipe = fp8::recipe_from_name(name);
  }
  return p;
}

std::string Precision::name() const {
  switch (kind) {
    case Kind::fp32:
      return "fp32";
    case Kind::bf16:
      return "bf16";
    case Kind::fp8:
      return recipe.name();
  }
  return "unknown";
}

DType Precision::activation_dtype() const { return kind == Kind::fp32 ? DType::f32 : DType::bf16; }

bool Precision::optimizer_writes_weight_casts() const {
  return nn::Linear::optimizer_writes_cast(kind == Kind::fp8
                                               ? nn::WeightCast::Key::fp8_weight(recipe)
                                               : nn::WeightCast::Key{.dtype = activation_dtype()});
}

// ----------------------------------------------------------------------------
// GPT

struct GPT::Impl {
  ModelConfig config;
  Precision precision;
  std::vector<Device> stages;
  Device device;                    ///< the first stage's: embeddings and ids
  Device head_device;               ///< the last stage's: final norm, head, targets and loss
  std::vector<size_t> block_stage;  ///< per block, its stage
  DType act;
  bool fp8;
  Tensor wte, grad_wte;
  Tensor wpe, grad_wpe;          ///< gpt2 only
  Tensor lm_head, grad_lm_head;  ///< llama only (gpt2 ties the head to wte)
  std::vector<nn::TransformerBlock> blocks;
  nn::Norm final_norm;
  nn::AmaxRegistry registry;
  /// The head weight in the activation dtype on the head's device, cast once per optimizer step
  /// (for fp32, a copy of the master only when a tied head sits on another stage).
  Tensor head_cast;
  /// next_casts()' target for the next step's head_cast, written by the optimizer.
  Tensor next_head_cast;
  bool collect_stats = false;
  /// Per block, per LinearSlot: the statistics of the last microbatch that collected them.
  std::vector<std::array<Fp8LayerStats, nn::kBlockLinears>> stats;
  ActivationHook activation_hook;
  GradientReadyHook* ready_hook = nullptr;
  /// Where each part's parameters start in entries(): what ready_hook is told.
  struct ParamStarts {
    std::vector<size_t> blocks;
    size_t final_norm = 0, lm_head = 0;
  } starts;

  Impl(const ModelConfig& c, const Precision& p, const std::vector<Device>& s, uint64_t seed,
       bool recompute, std::shared_ptr<nn::AmaxReducer> reducer);

  /// Every trainable tensor in parameters() order; fills `starts` when given.
  std::vector<Entry> entries(ParamStarts* starts = nullptr);
  /// Tells ready_hook, if any, that the parameters from `first` on are final.
  void gradients_ready(size_t first) const {
    if (ready_hook != nullptr) ready_hook->gradients_ready(first);
  }
  void initialize(uint64_t seed);
  const Tensor& head_weight() const { return config.tied_embeddings() ? wte : lm_head; }
  const Tensor& head_grad() const { return config.tied_embeddings() ? grad_wte : grad_lm_head; }
  /// A tied head on another stage than the embedding it shares: it reads and adds to copies.
  bool head_apart() const { return config.tied_embeddings() && stages.size() > 1; }
  /// t handed from one stage to the next (or back, in backward): a copy on `to`'s device, also
  /// when two stages share a GPU, so a split runs the same copies wherever its stages are.
  Tensor cross(const Tensor& t, size_t from, size_t to) const {
    return from == to ? t : t.to(stages[to]);
  }
  /// The head weight in the activation dtype (the FP32 master itself for fp32).
  const Tensor& head_compute_weight();

  void check_batch(int64_t batch, int64_t seq) const;
  /// Runs `forward` inside an Fp8Autocast on `registry` under fp8 precision (its end finalizes
  /// the forward pass once), plainly otherwise.
  void with_autocast(nn::AmaxRegistry& reg, const std::function<void()>& forward);
  /// Token (+ position) embeddings, then every block: the residual stream [batch*seq, dim].
  Tensor trunk(const Tensor& ids, int64_t batch, int64_t seq, nn::ForwardMode mode,
               std::vector<nn::TransformerBlock::Saved>& saved);
  /// logits [rows, vocab] = x @ W^T in the activation dtype (a dense GEMM, as Transformer Engine
  /// keeps the LM head out of FP8).
  Tensor head_forward(const Tensor& x);
  /// dx of the head from dlogits; accumulates the head weight's gradient.
  Tensor head_backward(const Tensor& dlogits, const Tensor& x);
  /// Observers that measure each block's Linear inputs and weights into `stats`.
  std::vector<nn::LinearObserver> stats_observers();
  /// Points (or, with false, stops pointing) every FP8 Linear's grad_output measurement at
  /// `stats`.
  void measure_gradients(bool on);
};

GPT::Impl::Impl(const ModelConfig& c, const Precision& p, const std::vector<Device>& s,
                uint64_t seed, bool recompute, std::shared_ptr<nn::AmaxReducer> reducer)
    : config(validated(c)),
      precision(validated(p)),
      stages(checked_stages(s, config.layers)),
      device(stages.front()),
      head_device(stages.back()),
      act(p.activation_dtype()),
      fp8(p.kind == Precision::Kind::fp8),
      final_norm(c.arch == Arch::gpt2 ? nn::NormKind::layernorm : nn::NormKind::rmsnorm, c.dim,
                 c.norm_eps, stages.back()),
      registry(std::move(reducer)) {
  const bool gpt2 = config.arch == Arch::gpt2;
  wte = Tensor::empty({config.vocab, config.dim}, DType::f32, device);
  grad_wte = Tensor::zeros({config.vocab, config.dim}, DType::f32, device);
  if (gpt2) {
    wpe = Tensor::empty({config.max_seq, config.dim}, DType::f32, device);
    grad_wpe = Tensor::zeros({config.max_seq, config.dim}, DType::f32, device);
  } else {
    lm_head = Tensor::empty({config.vocab, config.dim}, DType::f32, head_device);
    grad_lm_head = Tensor::zeros({config.vocab, config.dim}, DType::f32, head_device);
  }
  nn::BlockConfig block{
      .norm = gpt2 ? nn::NormKind::layernorm : nn::NormKind::rmsnorm,
      .dim = config.dim,
      .heads = config.heads,
      .ffn = config.ffn,
      .activation = gpt2 ? ops::Activation::gelu : ops::Activation::swiglu,
      .bias = gpt2,
      .rope = !gpt2,
      .rope_theta = config.rope_theta,
      .norm_eps = config.norm_eps,
      .moe = {},
  };
  nn::MoeConfig moe;
  moe.experts = config.experts;
  moe.topk = config.topk;
  moe.activation = config.experts > 0 ? config.moe_activation_kind() : moe.activation;
  moe.aux_loss_coef = config.aux_loss_coef;
  moe.scoring = config.experts > 0 ? config.router_scoring() : moe.scoring;
  moe.z_loss_coef = config.z_loss_coef;
  moe.shared_expert = config.shared_expert;
  // Linear's compute dtype outside FP8 autocast is the activation dtype. The layers' own
  // (uniform) initialization is replaced by initialize() below.
  blocks.reserve(static_cast<size_t>(config.layers));
  const auto count = static_cast<int64_t>(stages.size());
  for (int64_t l = 0; l < config.layers; ++l) {
    block.moe = config.is_moe_layer(l) ? moe : nn::MoeConfig{};
    // Contiguous stages of (nearly) equal block counts: stage s ends at layer (s + 1) L / S.
    block_stage.push_back(static_cast<size_t>((l * count + count - 1) / config.layers));
    blocks.emplace_back(block, stages[block_stage.back()], mix64(seed + kGolden * (l + 1)), act,
                        recompute);
  }
  initialize(seed);
  if (fp8) {  // every state exists and is registered before the first step (checkpoint restore)
    for (size_t l = 0; l < blocks.size(); ++l) {
      for (const NamedLinear& n : block_linears(blocks[l], l)) {
        n.linear->ensure_fp8_state(precision.recipe);
        registry.register_state(n.linear->fp8_state());
      }
    }
  }
}

std::vector<Entry> GPT::Impl::entries(ParamStarts* starts) {
  std::vector<Entry> out;
  ParamStarts unused;
  ParamStarts& at = starts != nullptr ? *starts : unused;
  at.blocks.clear();
  out.push_back({"wte", wte, grad_wte, true, Init::normal});
  if (wpe.defined()) out.push_back({"wpe", wpe, grad_wpe, false, Init::normal});
  auto add_norm = [&](const std::string& prefix, nn::Norm& norm) {
    out.push_back({prefix + ".gamma", norm.gamma(), norm.grad_gamma(), false, Init::ones});
    if (norm.beta().defined())
      out.push_back({prefix + ".beta", norm.beta(), norm.grad_beta(), false, Init::zeros});
  };
  auto add_linear = [&](const std::string& prefix, nn::Linear& linear, Init init) {
    out.push_back({prefix + ".weight", linear.weight(), linear.grad_weight(), true, init, &linear});
    if (linear.bias().defined())
      out.push_back({prefix + ".bias", linear.bias(), linear.grad_bias(), false, Init::zeros,
                     nullptr, &linear});
  };
  for (size_t l = 0; l < blocks.size(); ++l) {
    nn::TransformerBlock& b = blocks[l];
    const std::string prefix = "blocks." + std::to_string(l) + ".";
    const std::vector<NamedLinear> linears = block_linears(b, l);
    at.blocks.push_back(out.size());
    add_norm(prefix + "norm1", b.norm1());
    for (size_t i = 0; i < 2; ++i) add_linear(linears[i].name, *linears[i].linear, linears[i].init);
    add_norm(prefix + "norm2", b.norm2());
    if (b.is_moe()) {
      const nn::MoE& moe = b.moe();
      out.push_back({prefix + "moe.router.weight", moe.router_weight(), moe.router_grad(), true,
                     Init::normal});
      if (moe.activation_bias().defined())
        out.push_back({prefix + "moe.activation_bias", moe.activation_bias(),
                       moe.activation_bias_grad(), false, Init::zeros});
    }
    for (size_t i = 2; i < linears.size(); ++i)
      add_linear(linears[i].name, *linears[i].linear, linears[i].init);
  }
  at.final_norm = out.size();
  add_norm("final_norm", final_norm);
  at.lm_head = out.size();
  if (lm_head.defined()) out.push_back({"lm_head", lm_head, grad_lm_head, true, Init::normal});
  return out;
}

void GPT::Impl::initialize(uint64_t seed) {
  const float residual_std = kInitStd / std::sqrt(2.0f * static_cast<float>(config.layers));
  for (Entry& e : entries()) {
    const int64_t n = e.value.numel();
    std::vector<float> values;
    switch (e.init) {
      case Init::normal:
      case Init::residual:
        values = normal_values(mix64(seed ^ fnv1a(e.name)), n,
                               e.init == Init::normal ? kInitStd : residual_std);
        break;
      case Init::zeros:
        values.assign(static_cast<size_t>(n), 0.0f);
        break;
      case Init::ones:
        values.assign(static_cast<size_t>(n), 1.0f);
        break;
    }
    e.value.copy_from(Tensor::from_vector(values, e.value.shape()));
  }
}

const Tensor& GPT::Impl::head_compute_weight() {
  if (act == DType::f32 && !head_apart()) return head_weight();
  if (!head_cast.defined()) {
    Tensor cast = head_weight();
    if (act != DType::f32) {  // cast where the master is, then hand the cast over
      cast = Tensor::empty(head_weight().shape(), act, head_weight().device());
      ops::cast(head_weight(), cast);
    }
    head_cast = head_apart() ? cast.to(head_device) : cast;
  }
  return head_cast;
}

void GPT::Impl::check_batch(int64_t batch, int64_t seq) const {
  OCTET_CHECK(batch >= 1 && seq >= 1 && seq <= config.max_seq, "GPT: expected batch >= 1 and ",
              "1 <= seq <= max_seq (", config.max_seq, "), got batch ", batch, ", seq ", seq);
}

void GPT::Impl::with_autocast(nn::AmaxRegistry& reg, const std::function<void()>& forward) {
  if (fp8) {
    nn::Fp8Autocast scope(precision.recipe, reg);
    forward();
  } else {
    forward();
  }
}

Tensor GPT::Impl::trunk(const Tensor& ids, int64_t batch, int64_t seq, nn::ForwardMode mode,
                        std::vector<nn::TransformerBlock::Saved>& saved) {
  Tensor x = Tensor::empty({batch * seq, config.dim}, act, device);
  ops::embedding_forward(ids, wte, wpe, seq, x);
  std::vector<nn::LinearObserver> observers;
  if (collect_stats && fp8 && mode == nn::ForwardMode::normal) observers = stats_observers();
  saved.resize(blocks.size());
  for (size_t l = 0; l < blocks.size(); ++l) {
    x = cross(x, l == 0 ? 0 : block_stage[l - 1], block_stage[l]);
    x = blocks[l].forward(x, batch, seq, saved[l], mode,
                          observers.empty() ? nullptr : &observers[l]);
    if (activation_hook && mode == nn::ForwardMode::normal)
      activation_hook(static_cast<int64_t>(l), x);
  }
  return x;
}

Tensor GPT::Impl::head_forward(const Tensor& x) {
  Tensor logits = Tensor::empty({x.rows(), config.vocab}, act, head_device);
  ops::gemm(ops::GemmOperand::dense(x), ops::GemmOperand::dense(head_compute_weight(), true),
            logits);
  return logits;
}

Tensor GPT::Impl::head_backward(const Tensor& dlogits, const Tensor& x) {
  const Tensor& w = head_compute_weight();
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), head_device);
  // dx [rows, dim] = dlogits [rows, vocab] W [vocab, dim].
  ops::gemm(ops::GemmOperand::dense(dlogits), ops::GemmOperand::dense(w), dx);
  // dW [vocab, dim] += dlogits^T x; for tied weights this adds to the embedding's gradient, on
  // the head's stage through a copy that goes back before the embedding adds its part.
  ops::GemmArgs accumulate;
  accumulate.beta = 1.0f;
  const Tensor grad = head_apart() ? head_grad().to(head_device) : head_grad();
  ops::gemm(ops::GemmOperand::dense(dlogits, true), ops::GemmOperand::dense(x), grad, accumulate);
  if (head_apart()) grad_wte.copy_from(grad);  // a tied head's gradient is the embedding's
  return dx;
}

std::vector<nn::LinearObserver> GPT::Impl::stats_observers() {
  stats.assign(blocks.size(), {});
  std::vector<nn::LinearObserver> observers;
  for (size_t l = 0; l < blocks.size(); ++l) {
    observers.emplace_back(
        [this, l](LinearSlot slot, const Tensor& input, const nn::Linear::Saved& saved) {
          if (!saved.snapshot.fp8) return;
          Fp8LayerStats& s = stats[l][static_cast<int>(slot)];
          s.name = module_name(l, slot);
          s.input = nn::measure_cast(input, saved.input_q.data, saved.snapshot.input_scale);
          const nn::WeightCast& w = *saved.snapshot.weight;
          // A master another rank keeps (ZeRO-1) is measured there.
          if (const Tensor& master = blocks[l].linear(slot).weight(); master.defined())
            s.weight = nn::measure_cast(master, w.q.data, w.scale);
        });
  }
  return observers;
}

void GPT::Impl::measure_gradients(bool on) {
  for (size_t l = 0; l < blocks.size(); ++l)
    for (int slot = 0; slot < nn::kBlockLinears; ++slot)
      if (blocks[l].has_linear(static_cast<LinearSlot>(slot)))
        blocks[l].linear(static_cast<LinearSlot>(slot))
            .measure_grad_output(on ? &stats[l][slot].grad_output : nullptr);
}

GPT::GPT(const ModelConfig& config, const Precision& precision, const Device& device, uint64_t seed,
         bool recompute, std::shared_ptr<nn::AmaxReducer> amax_reducer)
    : GPT(config, precision, std::vector<Device>{device}, seed, recompute,
          std::move(amax_reducer)) {}

GPT::GPT(const ModelConfig& config, const Precision& precision, const std::vector<Device>& stages,
         uint64_t seed, bool recompute, std::shared_ptr<nn::AmaxReducer> amax_reducer)
    : impl_(std::make_unique<Impl>(config, precision, stages, seed, recompute,
                                   std::move(amax_reducer))) {}

GPT::~GPT() = default;

const ModelConfig& GPT::config() const { return impl_->config; }
const Precision& GPT::precision() const { return impl_->precision; }
const Device& GPT::device() const { return impl_->device; }
const std::vector<Device>& GPT::devices() const { return impl_->stages; }

float GPT::train_microbatch(const Tensor& ids, const Tensor& targets, int64_t batch, int64_t seq,
                            float grad_scale) {
  Impl& m = *impl_;
  m.check_batch(batch, seq);
  const int64_t rows = batch * seq;
  const Tensor ids_d = token_tensor(ids, rows, m.device, "ids");
  const Tensor targets_d = token_tensor(targets, rows, m.head_device, "targets");
  const int64_t counted = counted_targets(targets);
  const float scale = counted > 0 ? grad_scale / static_cast<float>(counted) : 0.0f;

  std::vector<nn::TransformerBlock::Saved> saved;
  nn::Norm::Saved norm_saved;
  Tensor xf, dlogits;
  const Tensor losses = Tensor::empty({rows}, DType::f32, m.head_device);
  m.with_autocast(m.registry, [&] {
    const Tensor x = m.trunk(ids_d, batch, seq, nn::ForwardMode::normal, saved);
    xf = m.final_norm.forward(x, norm_saved);
    // The gradient overwrites the logits, its last use (cross_entropy reads a row before
    // writing it): one [rows, vocab] buffer at the step's peak instead of two.
    dlogits = m.head_forward(xf);
    ops::cross_entropy(dlogits, targets_d, losses, dlogits, scale);
  });

  const bool measure = m.collect_stats && m.fp8;
  if (measure) m.measure_gradients(true);
  Tensor dx = m.head_backward(dlogits, xf);
  dlogits = xf = Tensor();
  // A tied head's gradient is the embedding's, final only after the embedding's backward.
  if (!m.config.tied_embeddings()) m.gradients_ready(m.starts.lm_head);
  dx = m.final_norm.backward(dx, norm_saved);
  norm_saved = nn::Norm::Saved();
  if (m.ready_hook != nullptr) {
    m.final_norm.settle_grad();
    m.gradients_ready(m.starts.final_norm);
  }
  for (size_t l = m.blocks.size(); l-- > 0;) {
    dx = m.blocks[l].backward(dx, saved[l], grad_scale);
    dx = m.cross(dx, m.block_stage[l], l == 0 ? 0 : m.block_stage[l - 1]);
    if (m.ready_hook == nullptr) continue;
    m.blocks[l].settle_grads();  // an expert that got no token: its gradient is zero
    m.gradients_ready(m.starts.blocks[l]);
  }
  ops::embedding_backward(ids_d, dx, seq, m.grad_wte, m.grad_wpe);
  m.gradients_ready(0);
  if (measure) m.measure_gradients(false);
  if (m.fp8) m.registry.finalize_backward();
  // The objective is the cross-entropy plus every MoE layer's aux and z losses (whose gradients
  // backward added with the same grad_scale).
  float router_losses = 0.0f;
  for (const nn::TransformerBlock& b : m.blocks) {
    if (!b.is_moe()) continue;
    const std::optional<nn::MoE::Load> load = b.moe().last_load();
    router_losses += load->aux_loss + load->z_loss;
  }
  return mean_loss(losses, counted) + router_losses;
}

float GPT::evaluate(const Tensor& ids, const Tensor& targets, int64_t batch, int64_t seq) {
  Impl& m = *impl_;
  m.check_batch(batch, seq);
  const int64_t rows = batch * seq;
  const Tensor ids_d = token_tensor(ids, rows, m.device, "ids");
  const Tensor targets_d = token_tensor(targets, rows, m.head_device, "targets");
  const Tensor losses = Tensor::empty({rows}, DType::f32, m.head_device);
  // Inference forwards register and record nothing; the scope's finalize goes to a registry of
  // its own, so the model's FP8 state and update counts stay exactly as they were.
  nn::AmaxRegistry untouched;
  m.with_autocast(untouched, [&] {
    std::vector<nn::TransformerBlock::Saved> saved;
    const Tensor x = m.trunk(ids_d, batch, seq, nn::ForwardMode::inference, saved);
    nn::Norm::Saved norm_saved;
    const Tensor logits = m.head_forward(m.final_norm.forward(x, norm_saved));
    ops::cross_entropy(logits, targets_d, losses, Tensor(), 0.0f);
  });
  return mean_loss(losses, counted_targets(targets));
}

Tensor GPT::logits_at(const Tensor& ids, int64_t batch, int64_t seq, int64_t position) {
  Impl& m = *impl_;
  m.check_batch(batch, seq);
  OCTET_CHECK(position >= 0 && position < seq,
              "GPT::logits_at: position must be in [0, seq = ", seq, "), got ", position);
  const Tensor ids_d = token_tensor(ids, batch * seq, m.device, "ids");
  Tensor logits;
  nn::AmaxRegistry untouched;
  m.with_autocast(untouched, [&] {
    std::vector<nn::TransformerBlock::Saved> saved;
    const Tensor x = m.trunk(ids_d, batch, seq, nn::ForwardMode::inference, saved);
    // Norm and head are per row: only the rows at `position` are needed.
    Tensor rows = Tensor::empty({batch, m.config.dim}, m.act, m.head_device);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t r = b * seq + position;
      rows.slice(b, b + 1).copy_from(x.slice(r, r + 1));
    }
    nn::Norm::Saved norm_saved;
    logits = m.head_forward(m.final_norm.forward(rows, norm_saved));
  });
  Tensor out = Tensor::empty(logits.shape(), DType::f32, m.head_device);
  ops::cast(logits, out);
  return out.to(Device::cpu());
}

std::vector<Parameter> GPT::parameters() {
  std::vector<Parameter> out;
  for (Entry& e : impl_->entries())
    out.push_back({std::move(e.name), std::move(e.value), std::move(e.grad), e.weight_decay});
  return out;
}

std::vector<Fp8Module> GPT::fp8_modules() const {
  std::vector<Fp8Module> out;
  if (!impl_->fp8) return out;
  for (size_t l = 0; l < impl_->blocks.size(); ++l)
    for (const NamedLinear& n : block_linears(impl_->blocks[l], l))
      out.push_back({n.name, n.linear, n.linear->fp8_state()});
  return out;
}

std::vector<MoeLayerStats> GPT::moe_layer_stats() const {
  std::vector<MoeLayerStats> out;
  for (size_t l = 0; l < impl_->blocks.size(); ++l) {
    const nn::TransformerBlock& b = impl_->blocks[l];
    if (!b.is_moe()) continue;
    if (std::optional<nn::MoE::Load> load = b.moe().last_load())
      out.push_back({static_cast<int64_t>(l), std::move(*load)});
  }
  return out;
}

nn::AmaxRegistry& GPT::registry() { return impl_->registry; }

void GPT::set_collect_fp8_stats(bool on) { impl_->collect_stats = on; }

std::vector<Fp8LayerStats> GPT::fp8_layer_stats() const {
  std::vector<Fp8LayerStats> out;
  for (const auto& block : impl_->stats)
    for (const Fp8LayerStats& s : block)
      if (s.input.measured) out.push_back(s);
  return out;
}

void GPT::zero_grad(nn::ZeroGrad how) {
  Impl& m = *impl_;
  for (nn::TransformerBlock& b : m.blocks) b.zero_grad(how);
  m.final_norm.zero_grad(how);
  for (Tensor* g : {&m.grad_wte, &m.grad_wpe, &m.grad_lm_head})
    if (g->defined()) g->zero();
}

void GPT::settle_grads() {
  for (nn::TransformerBlock& b : impl_->blocks) b.settle_grads();
  impl_->final_norm.settle_grad();
}

std::vector<ParamCast> GPT::next_casts() {
  std::vector<Entry> entries = impl_->entries();
  for (Entry& e : entries)
    if (e.weight_of != nullptr) e.weight_of->prepare_next_cast();
  std::vector<ParamCast> casts(entries.size());
  Impl& m = *impl_;
  m.head_cast = m.next_head_cast = Tensor();  // as Linear::prepare_next_cast: read no more
  for (size_t i = 0; i < entries.size(); ++i) {
    // A Linear's weight may have no master here (ZeRO-1): it is told apart without reading it.
    if (const nn::Linear* w = entries[i].weight_of) {
      casts[i].cast = w->prepared_next_cast().weight_fp8;
      casts[i].bf16_copy = w->prepared_next_cast().weight_bf16;
    } else if (const nn::Linear* b = entries[i].bias_of) {
      casts[i].bf16_copy = b->prepared_next_cast().bias_bf16;
    } else if (m.act != DType::f32 && entries[i].value.raw_data() == m.head_weight().raw_data()) {
      m.next_head_cast = Tensor::empty(m.head_weight().shape(), m.act, m.head_weight().device());
      casts[i].bf16_copy = m.next_head_cast;
    }
  }
  return casts;
}

std::vector<ParamLayer> GPT::param_layers() {
  std::vector<ParamLayer> out;
  for (const Entry& e : impl_->entries())
    out.push_back(e.weight_of != nullptr ? ParamLayer{e.weight_of, true} : ParamLayer{e.bias_of});
  return out;
}

int64_t GPT::weight_cast_bytes() {
  Impl& m = *impl_;
  int64_t total = 0;
  for (size_t l = 0; l < m.blocks.size(); ++l)
    for (const NamedLinear& n : block_linears(m.blocks[l], l))
      total += n.linear->weight_cast_bytes();
  for (const Tensor* t : {&m.head_cast, &m.next_head_cast})
    if (t->defined() && t->raw_data() != m.head_weight().raw_data())
      total += static_cast<int64_t>(t->nbytes());
  return total;
}

void GPT::set_activation_hook(ActivationHook hook) { impl_->activation_hook = std::move(hook); }

void GPT::set_gradient_ready_hook(GradientReadyHook* hook) {
  Impl& m = *impl_;
  // The parts' places in parameters() order never change: found at the first hook.
  if (hook != nullptr && m.starts.blocks.size() != m.blocks.size()) m.entries(&m.starts);
  m.ready_hook = hook;
}

void GPT::on_weights_updated(nn::PreparedCast prepared) {
  Impl& m = *impl_;
  for (nn::TransformerBlock& b : m.blocks) b.on_weights_updated(prepared);
  m.head_cast = Tensor();
  if (prepared == nn::PreparedCast::written && m.next_head_cast.defined())
    m.head_cast = m.head_apart() ? m.next_head_cast.to(m.head_device) : m.next_head_cast;
  m.next_head_cast = Tensor();
}

}  // namespace octet::train
