#include "octet/nn/moe.h"

#include <utility>

#include "octet/core/hash.h"
#include "octet/nn/fusion.h"
#include "octet/ops/activation.h"
#include "octet/ops/gemm.h"
#include "octet/ops/quantize.h"

namespace octet::nn {
namespace {

/// Seed of one part of the layer, derived from the layer's seed (distinct per part).
uint64_t part_seed(uint64_t seed, std::string_view part) { return mix64(seed ^ fnv1a(part)); }

Tensor empty_like(const Tensor& t) { return Tensor::empty(t.shape(), t.dtype(), t.device()); }

MoeConfig checked(const BlockConfig& config) {
  const MoeConfig& m = config.moe;
  OCTET_CHECK(m.enabled(), "nn::MoE needs experts > 0, got ", m.experts);
  OCTET_CHECK(m.topk >= 1 && m.topk <= m.experts, "nn::MoE: topk must be in [1, experts = ",
              m.experts, "], got ", m.topk);
  OCTET_CHECK(config.dim > 0 && config.ffn > 0, "nn::MoE needs positive dim and ffn, got dim ",
              config.dim, ", ffn ", config.ffn);
  return m;
}

/// The group offsets of `plan` on the host: the one host read of a forward.
std::vector<int64_t> host_offsets(const ops::MoePlan& plan) {
  const Tensor host = plan.offsets.to(Device::cpu());
  const int32_t* o = host.data<int32_t>();
  return std::vector<int64_t>(o, o + host.numel());
}

}  // namespace

MoE::Saved MoE::Saved::for_recompute(bool keep_input) const {
  Saved out;
  if (keep_input) out.input = input;
  out.fc1 = fc1.snapshot_only();
  out.fc2 = fc2.snapshot_only();
  if (shared.fc1.snapshot.weight) {
    out.shared.fc1 = Linear::Saved::from_snapshot(shared.fc1.snapshot);
    out.shared.fc2 = Linear::Saved::from_snapshot(shared.fc2.snapshot);
  }
  return out;
}

MoE::MoE(const BlockConfig& config, const Device& device, uint64_t seed, DType compute_dtype,
         bool recompute)
    : config_(checked(config)),
      dim_(config.dim),
      ffn_(config.ffn),
      device_(device),
      recompute_(recompute),
      fc1_(config_.experts, config.dim, ops::moe_activation_input_cols(config_.activation, ffn_),
           config.bias, device, part_seed(seed, "fc1"), compute_dtype),
      fc2_(config_.experts, ffn_, config.dim, config.bias, device, part_seed(seed, "fc2"),
           compute_dtype) {
  // The router keeps a Linear's initialization (uniform in +-1/sqrt(dim)) but runs its own FP32
  // GEMMs: inside fp8_autocast a Linear would run in FP8.
  router_weight_ =
      Linear(dim_, config_.experts, /*bias=*/false, device, part_seed(seed, "router")).weight();
  router_grad_ = Tensor::zeros(router_weight_.shape(), DType::f32, device);
  if (config_.activation_bias) {
    activation_bias_ = Tensor::zeros({config_.experts, ffn_}, DType::f32, device);
    activation_bias_grad_ = Tensor::zeros({config_.experts, ffn_}, DType::f32, device);
  }
  if (config_.shared_expert) shared_.emplace(config, device, part_seed(seed, "shared"), compute_dtype);
}

ops::RouterArgs MoE::router_args(float loss_scale) const {
  ops::RouterArgs args;
  args.scoring = config_.scoring;
  args.topk = config_.topk;
  args.aux_loss_coef = config_.aux_loss_coef * loss_scale;
  args.z_loss_coef = config_.z_loss_coef * loss_scale;
  return args;
}

Tensor MoE::forward(const Tensor& input, Saved& saved, ForwardMode mode, const Tensor& residual) {
  const Tensor x = input;  // a handle of its own: a recompute passes saved.input, moved below
  OCTET_CHECK(x.defined() && x.ndim() == 2 && x.cols() == dim_ &&
                  (x.dtype() == DType::f32 || x.dtype() == DType::bf16),
              "nn::MoE(dim=", dim_, ") expects x [tokens, ", dim_, "] f32 or bf16, got ",
              x.defined() ? x.describe() : "none");
  OCTET_CHECK(x.device() == device_, "nn::MoE lives on ", device_, ", x is on ", x.device());
  const bool recompute = mode == ForwardMode::recompute;
  OCTET_CHECK(!recompute || saved.fc1.experts.size() == static_cast<size_t>(experts()),
              "nn::MoE::forward(recompute) needs the record of the original forward "
              "(Saved::for_recompute), got a record of ", saved.fc1.experts.size(), " experts");
  Saved full = recompute ? std::move(saved) : Saved{};
  full.input = x;
  const int64_t tokens = x.rows();
  const int64_t experts = config_.experts;

  full.logits = Tensor::empty({tokens, experts}, DType::f32, device_);
  ops::router_logits(x, router_weight_, full.logits);
  full.router = ops::RouterOutputs::allocate(tokens, experts, config_.topk, device_);
  ops::router_forward(full.logits, router_args(), full.router);
  full.plan = ops::MoePlan::allocate(tokens, config_.topk, experts, device_);
  ops::moe_plan(full.router.expert, full.plan);
  full.offsets = host_offsets(full.plan);
  const int64_t capacity = full.plan.capacity();

  // The permuted buffers hold `capacity` rows (an upper bound known without the counts); the
  // experts' GEMMs cover offsets.back() of them and zero the padding tail.
  Tensor permuted = Tensor::empty({capacity, dim_}, x.dtype(), device_);
  ops::moe_dispatch(x, full.plan, permuted);
  full.fc1_out = fc1_.forward(permuted, full.offsets, full.fc1, mode);
  permuted = Tensor();
  full.row_prob = Tensor::empty({capacity}, DType::f32, device_);
  ops::moe_gather_row_probs(full.router.prob, full.plan, full.row_prob);
  // Under delayed scaling, once every expert with rows is calibrated, the activation writes FC2's
  // FP8 input itself, each expert's rows with its own scale, and h is never stored.
  const std::optional<std::vector<ops::FusedQuantize>> fc2_input =
      fusion_enabled(Fusion::moe_activation_cast)
          ? fc2_.fused_input(full.offsets, x.dtype(), full.fc2, mode)
          : std::nullopt;
  const Tensor h = fc2_input ? Tensor() : Tensor::empty({capacity, ffn_}, x.dtype(), device_);
  ops::MoeExpertCasts casts{full.offsets, {}};
  if (fc2_input) casts.experts = *fc2_input;
  ops::moe_scaled_activation_forward(config_.activation, full.fc1_out, full.row_prob, full.plan,
                                     activation_bias_, h, fc2_input ? &casts : nullptr);
  const Tensor expert_out = fc2_.forward(h, full.offsets, full.fc2, mode, capacity);
  if (mode != ForwardMode::inference) {
    full.fc1.release_forward_only();
    full.fc2.release_forward_only();
  }

  Tensor y = empty_like(x);
  ops::moe_combine(expert_out, Tensor(), full.plan, y);
  if (shared_) {
    const Tensor s = shared_->forward(x, full.shared, mode, nullptr, residual);
    ops::add(y, s, y);
  } else if (residual.defined()) {
    ops::add(y, residual, y);
  }
  full.complete = true;

  if (mode == ForwardMode::normal) {
    last_counts_ = full.router.counts;
    last_aux_loss_ = full.router.aux_loss;
    last_z_loss_ = full.router.z_loss;
  }
  if (mode == ForwardMode::inference) {
    saved = Saved();
  } else if (recompute_ && mode == ForwardMode::normal) {
    saved = full.for_recompute(/*keep_input=*/true);
  } else {
    saved = std::move(full);
  }
  return y;
}

Tensor MoE::backward(const Tensor& dy, Saved& saved, float aux_loss_scale) {
  OCTET_CHECK(saved.input.defined(),
              "nn::MoE::backward needs the Saved of a training forward, got an empty one");
  if (!saved.complete) forward(saved.input, saved, ForwardMode::recompute);
  const Tensor& x = saved.input;
  OCTET_CHECK(dy.defined() && dy.shape() == x.shape() && dy.dtype() == x.dtype(),
              "nn::MoE::backward expects dy like its input ", x.describe(), ", got ",
              dy.defined() ? dy.describe() : "none");
  const int64_t capacity = saved.plan.capacity();

  // The prob was applied in the activation: the combine's backward is a plain scatter.
  Tensor d_expert_out = Tensor::empty({capacity, dim_}, dy.dtype(), device_);
  ops::moe_combine_backward(dy, Tensor(), Tensor(), saved.plan, d_expert_out, Tensor());
  const Tensor dh = fc2_.backward(d_expert_out, saved.fc2);
  d_expert_out = Tensor();

  Tensor dfc1 = empty_like(saved.fc1_out);
  Tensor d_row_prob = Tensor::empty({capacity}, DType::f32, device_);
  // The op overwrites dbias: straight into the gradient when that is due for an overwrite.
  const bool bias = activation_bias_.defined();
  const Tensor dbias = !bias              ? Tensor()
                       : grads_unwritten_ ? activation_bias_grad_
                                          : empty_like(activation_bias_grad_);
  ops::moe_scaled_activation_backward(config_.activation, dh, saved.fc1_out, saved.row_prob,
                                      saved.plan, activation_bias_, dfc1, d_row_prob, dbias);
  if (bias && !grads_unwritten_) ops::add(activation_bias_grad_, dbias, activation_bias_grad_);
  Tensor d_permuted = fc1_.backward(dfc1, saved.fc1);
  dfc1 = Tensor();
  Tensor dx = empty_like(x);
  ops::moe_dispatch_backward(d_permuted, saved.plan, dx);
  d_permuted = Tensor();

  // The router: dprob from the experts, plus the aux and z losses' own gradients.
  Tensor dprob = Tensor::empty({x.rows(), config_.topk}, DType::f32, device_);
  ops::moe_scatter_row_probs(d_row_prob, saved.plan, dprob);
  last_dprob_ = dprob;
  Tensor dlogits = empty_like(saved.logits);
  ops::router_backward(saved.logits, router_args(aux_loss_scale), saved.router, dprob, dlogits);
  // dx gains the router's part; router_grad_ is written or accumulated.
  ops::router_logits_backward(x, router_weight_, dlogits, dx, router_grad_, !grads_unwritten_);
  grads_unwritten_ = false;
  if (shared_) ops::add(dx, shared_->backward(dy, saved.shared), dx);
  saved = Saved();
  return dx;
}

std::optional<MoE::Load> MoE::last_load() const {
  if (!last_counts_.defined()) return std::nullopt;
  Load load;
  const Tensor counts = last_counts_.to(Device::cpu());
  const int32_t* c = counts.data<int32_t>();
  load.tokens.assign(c, c + counts.numel());
  load.aux_loss = host_values_f32(last_aux_loss_).at(0);
  load.z_loss = host_values_f32(last_z_loss_).at(0);
  return load;
}

void MoE::zero_grad(ZeroGrad how) {
  fc1_.zero_grad(how);
  fc2_.zero_grad(how);
  if (shared_) {
    shared_->fc1().zero_grad(how);
    shared_->fc2().zero_grad(how);
  }
  grads_unwritten_ = how == ZeroGrad::on_next_write;
  if (grads_unwritten_) return;
  router_grad_.zero();
  if (activation_bias_grad_.defined()) activation_bias_grad_.zero();
}

void MoE::settle_grad() {
  fc1_.settle_grad();
  fc2_.settle_grad();
  if (shared_) {
    shared_->fc1().settle_grad();
    shared_->fc2().settle_grad();
  }
  if (grads_unwritten_) {
    grads_unwritten_ = false;
    router_grad_.zero();
    if (activation_bias_grad_.defined()) activation_bias_grad_.zero();
  }
}

void MoE::on_weights_updated(PreparedCast prepared) {
  fc1_.on_weights_updated(prepared);
  fc2_.on_weights_updated(prepared);
  if (shared_) {
    shared_->fc1().on_weights_updated(prepared);
    shared_->fc2().on_weights_updated(prepared);
  }
}

}  // namespace octet::nn
