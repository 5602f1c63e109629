#include "octet/nn/transformer.h"

#include <utility>

#include "octet/nn/fusion.h"
#include "octet/ops/norm.h"
#include "octet/ops/quantize.h"

namespace octet::nn {
namespace {

/// Seeds of the Linear layers of a block, derived from the block's seed (distinct per layer).
constexpr uint64_t kSeedStride = 0x9E3779B97F4A7C15ull;  // 2^64 / golden ratio (splitmix64)
uint64_t layer_seed(uint64_t seed, LinearSlot slot) {
  return seed + kSeedStride * (static_cast<uint64_t>(slot) + 1);
}

Tensor empty_like(const Tensor& t) { return Tensor::empty(t.shape(), t.dtype(), t.device()); }

/// After a Linear's forward: calls the observer, when there is one, for a normal (training)
/// forward; then, unless this was inference, frees the record's forward-only part.
void after_linear(const LinearObserver* observer, ForwardMode mode, LinearSlot slot,
                  const Tensor& x, Linear::Saved& saved) {
  if (observer != nullptr && *observer && mode == ForwardMode::normal) (*observer)(slot, x, saved);
  if (mode != ForwardMode::inference) saved.release_forward_only();
}

/// Frees a training forward's FP8 input of a Linear whose backward casts it again (refill_input
/// below), under Fusion::input_recast.
void release_for_recast(ForwardMode mode, Linear::Saved& saved) {
  if (mode == ForwardMode::normal && fusion_enabled(Fusion::input_recast))
    saved.release_fp8_input();
}

/// The FP8 input that a training forward released (Linear::Saved::release_fp8_input), rebuilt
/// before `linear`'s backward; a record that kept it (a recompute's, or a high-precision one) is
/// left alone. produce(fused) runs the input's producer as the forward ran it: with `fused`, it
/// writes the FP8 copies only (where the forward could fuse that cast: `fusable`, its switch on,
/// and delayed scaling), else it returns the input, quantized here. A fused producer gets the
/// row-wise copy too when `rowwise` (a norm writes both in one pass), freed at once.
template <typename Produce>
void refill_input(Linear& linear, Linear::Saved& saved, bool fusable, bool rowwise,
                  Produce&& produce) {
  if (!saved.snapshot.fp8 || saved.input_q.has_columnwise()) return;
  if (fusable && linear.takes_fused_input(saved, ForwardMode::recompute)) {
    const ops::FusedQuantize target = linear.refill_input(saved, rowwise);
    produce(&target);
    saved.release_forward_only();
  } else {
    const ops::FusedQuantize target = linear.refill_input(saved);
    ops::quantize(produce(nullptr), *target.out, target.args);
  }
}

/// Rebuilds `linear`'s FP8 input norm(x), which a training forward released.
void refill_norm_output(const Norm& norm, const Tensor& x, Linear& linear, Linear::Saved& saved) {
  refill_input(linear, saved, fusion_enabled(Fusion::norm_cast), /*rowwise=*/true,
               [&](const ops::FusedQuantize* fused) {
                 Norm::Saved stats;  // the forward's again; backward reads the forward's own
                 return norm.forward(x, stats, fused, /*output=*/fused == nullptr);
               });
}

/// The activation's output for `hidden` (fc1's output), `cols` wide.
Tensor activation_output(const Tensor& hidden, int64_t cols) {
  Shape shape = hidden.shape();
  shape.back() = cols;
  return Tensor::empty(shape, hidden.dtype(), hidden.device());
}

}  // namespace

// ----------------------------------------------------------------------------
// Norm

Norm::Norm(NormKind kind, int64_t dim, float eps, const Device& device)
    : kind_(kind), dim_(dim), eps_(eps), device_(device) {
  OCTET_CHECK(dim > 0, "Norm needs a positive dim, got ", dim);
  check_device_available(device);
  gamma_ =
      Tensor::from_vector(std::vector<float>(static_cast<size_t>(dim), 1.0f), {dim}).to(device);
  grad_gamma_ = Tensor::zeros({dim}, DType::f32, device);
  if (kind == NormKind::layernorm) {
    beta_ = Tensor::zeros({dim}, DType::f32, device);
    grad_beta_ = Tensor::zeros({dim}, DType::f32, device);
  }
}

Tensor Norm::forward(const Tensor& x, Saved& saved, const ops::FusedQuantize* fused,
                     bool output) const {
  OCTET_CHECK(x.defined() && x.ndim() >= 1 && x.size(-1) == dim_, "Norm(dim=", dim_,
              ") expects an input [..., ", dim_, "], got ", x.defined() ? x.describe() : "none");
  OCTET_CHECK(output || fused != nullptr,
              "Norm::forward: output = false needs a fused FP8 output to produce instead");
  const Tensor x2 = x.view({-1, dim_});
  Saved out;
  out.input = x2;
  out.rstd = Tensor::empty({x2.rows()}, DType::f32, device_);
  Tensor y = output ? empty_like(x) : Tensor();
  const Tensor y2 = output ? y.view({-1, dim_}) : Tensor();
  if (kind_ == NormKind::layernorm) {
    out.mean = Tensor::empty({x2.rows()}, DType::f32, device_);
    ops::layernorm_forward(x2, gamma_, beta_, eps_, y2, out.mean, out.rstd, fused);
  } else {
    ops::rmsnorm_forward(x2, gamma_, eps_, y2, out.rstd, fused);
  }
  saved = std::move(out);
  return y;
}

Tensor Norm::backward(const Tensor& dy, const Saved& saved, const Tensor& residual) {
  OCTET_CHECK(saved.input.defined(),
              "Norm::backward needs the Saved of a forward, got an empty one");
  OCTET_CHECK(dy.defined() && dy.numel() == saved.input.numel() && dy.size(-1) == dim_,
              "Norm::backward expects dy shaped like the input ", saved.input.describe(), ", got ",
              dy.defined() ? dy.describe() : "none");
  const Tensor dy2 = dy.view({-1, dim_});
  Tensor dx = empty_like(dy);
  const Tensor dx2 = dx.view({-1, dim_});
  const Tensor residual2 = residual.defined() ? residual.view({-1, dim_}) : Tensor();
  const bool accumulate = !grads_unwritten_;
  grads_unwritten_ = false;
  if (kind_ == NormKind::layernorm) {
    ops::layernorm_backward(dy2, saved.input, gamma_, saved.mean, saved.rstd, dx2, grad_gamma_,
                            grad_beta_, residual2, accumulate);
  } else {
    ops::rmsnorm_backward(dy2, saved.input, gamma_, saved.rstd, dx2, grad_gamma_, residual2,
                          accumulate);
  }
  return dx;
}

void Norm::zero_grad(ZeroGrad how) {
  grads_unwritten_ = how == ZeroGrad::on_next_write;
  if (grads_unwritten_) return;
  grad_gamma_.zero();
  if (grad_beta_.defined()) grad_beta_.zero();
}

void Norm::settle_grad() {
  if (grads_unwritten_) zero_grad(ZeroGrad::now);
}

namespace {

/// x viewed as [rows, dim] after checking it against the norm; `who` names the caller.
Tensor norm_rows(const Norm& norm, const Tensor& x, const char* who) {
  OCTET_CHECK(x.defined() && x.ndim() >= 1 && x.size(-1) == norm.dim(), who, ": the norm (dim ",
              norm.dim(), ") expects an input [..., ", norm.dim(), "], got ",
              x.defined() ? x.describe() : "none");
  return x.view({-1, norm.dim()});
}

/// norm(x2) as `consumer`'s input: where the Linear can take its FP8 input from the producer, the
/// norm writes it and returns no high-precision output (an undefined tensor).
Tensor norm_into(const Norm& norm, Linear& consumer, const Tensor& x2, Norm::Saved& norm_saved,
                 Linear::Saved& consumer_saved, ForwardMode mode) {
  const auto fused = fusion_enabled(Fusion::norm_cast)
                         ? consumer.fused_input(x2.rows(), x2.dtype(), consumer_saved, mode)
                         : std::nullopt;
  return norm.forward(x2, norm_saved, fused ? &*fused : nullptr, /*output=*/!fused);
}

/// `t` [rows, cols] viewed with like's leading dimensions: [..., cols].
Tensor with_leading_dims(const Tensor& t, const Tensor& like) {
  Shape shape = like.shape();
  shape.back() = t.size(-1);
  return t.view(shape);
}

/// dy viewed as [rows, cols] after checking its last dimension; `who` names the caller.
Tensor grad_rows(const Tensor& dy, int64_t cols, const char* who) {
  OCTET_CHECK(dy.defined() && dy.ndim() >= 1 && dy.size(-1) == cols, who, ": expected dy [..., ",
              cols, "], got ", dy.defined() ? dy.describe() : "none");
  return dy.view({-1, cols});
}

}  // namespace

Tensor norm_linear_forward(const Norm& norm, Linear& linear, const Tensor& x,
                           Norm::Saved& norm_saved, Linear::Saved& linear_saved, ForwardMode mode) {
  const Tensor x2 = norm_rows(norm, x, "norm_linear_forward");
  const Tensor h = norm_into(norm, linear, x2, norm_saved, linear_saved, mode);
  return with_leading_dims(linear.forward(h, linear_saved, mode), x);
}

Tensor norm_linear_backward(Norm& norm, Linear& linear, const Tensor& dy,
                            const Norm::Saved& norm_saved, const Linear::Saved& linear_saved) {
  const Tensor dy2 = grad_rows(dy, linear.out_features(), "norm_linear_backward");
  return with_leading_dims(norm.backward(linear.backward(dy2, linear_saved), norm_saved), dy);
}

Tensor norm_mlp_forward(const Norm& norm, ops::Activation activation, Linear& fc1, Linear& fc2,
                        const Tensor& x, Norm::Saved& norm_saved, MLP::Saved& mlp_saved,
                        ForwardMode mode) {
  const Tensor x2 = norm_rows(norm, x, "norm_mlp_forward");
  const Tensor h = norm_into(norm, fc1, x2, norm_saved, mlp_saved.fc1, mode);
  return with_leading_dims(mlp_forward(activation, fc1, fc2, h, mlp_saved, mode), x);
}

Tensor norm_mlp_backward(Norm& norm, ops::Activation activation, Linear& fc1, Linear& fc2,
                         const Tensor& dy, const Norm::Saved& norm_saved, MLP::Saved& mlp_saved) {
  const Tensor dy2 = grad_rows(dy, fc2.out_features(), "norm_mlp_backward");
  const Tensor dh = mlp_backward(activation, fc1, fc2, dy2, mlp_saved);
  return with_leading_dims(norm.backward(dh, norm_saved), dy);
}

// ----------------------------------------------------------------------------
// Attention

Attention::Attention(const BlockConfig& config, const Device& device, uint64_t seed,
                     DType compute_dtype)
    : heads_(config.heads),
      head_dim_(config.heads > 0 ? config.dim / config.heads : 0),
      rope_(config.rope),
      rope_theta_(config.rope_theta),
      qkv_(config.dim, 3 * config.dim, config.bias, device, layer_seed(seed, LinearSlot::qkv),
           compute_dtype),
      proj_(config.dim, config.dim, config.bias, device, layer_seed(seed, LinearSlot::proj),
            compute_dtype) {
  OCTET_CHECK(config.heads > 0 && config.dim % config.heads == 0, "Attention: heads (",
              config.heads, ") must be positive and divide dim (", config.dim, ")");
}

Tensor Attention::forward(const Tensor& x, int64_t batch, int64_t seq, Saved& saved,
                          ForwardMode mode, const LinearObserver* observer,
                          const Tensor& residual) {
  // x may be undefined when qkv's FP8 input was written by the op before (Linear::fused_input).
  OCTET_CHECK(x.defined() ? x.ndim() == 2 && x.size(0) == batch * seq
                          : saved.qkv.input_prefilled && saved.qkv.input_q.rows == batch * seq,
              "Attention expects x [batch*seq, dim] = [", batch * seq, ", ", heads_ * head_dim_,
              "] (or qkv's fused input of as many rows), got ",
              x.defined() ? x.describe() : "none");
  saved.shape = {.batch = batch, .seq = seq, .heads = heads_, .head_dim = head_dim_};
  saved.qkv_act = qkv_.forward(x, saved.qkv, mode);
  after_linear(observer, mode, LinearSlot::qkv, x, saved.qkv);
  // Rotating in place is safe: the FP8 Saved of qkv holds its input, not its output.
  if (rope_) ops::rope(saved.qkv_act, saved.shape, rope_theta_, /*inverse=*/false);
  const Tensor& act = saved.qkv_act;
  saved.out = Tensor::empty({batch * seq, heads_ * head_dim_}, act.dtype(), act.device());
  saved.lse = Tensor::empty({batch, heads_, seq}, DType::f32, act.device());
  ops::attention_forward(saved.qkv_act, saved.shape, saved.out, saved.lse);
  Tensor y = proj_.forward(saved.out, saved.proj, mode, residual);
  after_linear(observer, mode, LinearSlot::proj, saved.out, saved.proj);
  // proj's input is kept for the attention's backward: its FP8 copy is made again from it.
  release_for_recast(mode, saved.proj);
  return y;
}

Tensor Attention::backward(const Tensor& dy, Saved& saved) {
  OCTET_CHECK(saved.lse.defined(), "Attention::backward needs the Saved of a forward");
  refill_input(proj_, saved.proj, /*fusable=*/false, /*rowwise=*/false,
               [&](const ops::FusedQuantize*) { return saved.out; });
  Tensor dout = proj_.backward(dy, saved.proj);
  saved.proj = Linear::Saved();
  Tensor dqkv = empty_like(saved.qkv_act);
  ops::attention_backward(dout, saved.qkv_act, saved.out, saved.lse, saved.shape, dqkv);
  dout = Tensor();
  saved.qkv_act = saved.out = saved.lse = Tensor();
  // RoPE is a rotation: its backward is the opposite rotation of the gradient.
  if (rope_) ops::rope(dqkv, saved.shape, rope_theta_, /*inverse=*/true);
  Tensor dx = qkv_.backward(dqkv, saved.qkv);
  saved.qkv = Linear::Saved();
  return dx;
}

// ----------------------------------------------------------------------------
// MLP

MLP::MLP(const BlockConfig& config, const Device& device, uint64_t seed, DType compute_dtype)
    : activation_(config.activation),
      fc1_(config.dim, ops::activation_input_cols(config.activation, config.ffn), config.bias,
           device, layer_seed(seed, LinearSlot::fc1), compute_dtype),
      fc2_(config.ffn, config.dim, config.bias, device, layer_seed(seed, LinearSlot::fc2),
           compute_dtype) {}

Tensor mlp_forward(ops::Activation activation, Linear& fc1, Linear& fc2, const Tensor& x,
                   MLP::Saved& saved, ForwardMode mode, const LinearObserver* observer,
                   const Tensor& residual) {
  saved.hidden = fc1.forward(x, saved.fc1, mode);
  after_linear(observer, mode, LinearSlot::fc1, x, saved.fc1);
  const auto fused =
      fusion_enabled(Fusion::activation_cast)
          ? fc2.fused_input(saved.hidden.rows(), saved.hidden.dtype(), saved.fc2, mode)
          : std::nullopt;
  // With fc2's input cast fused, the activation's high-precision output is needed only by an
  // observer (the FP8 statistics); otherwise it is never written.
  const bool observed = observer != nullptr && *observer && mode == ForwardMode::normal;
  const Tensor act =
      !fused || observed ? activation_output(saved.hidden, fc2.in_features()) : Tensor();
  ops::activation_forward(activation, saved.hidden, act, fused ? &*fused : nullptr);
  Tensor y = fc2.forward(act, saved.fc2, mode, residual);
  after_linear(observer, mode, LinearSlot::fc2, act, saved.fc2);
  // The activation's input is kept for its backward: fc2's FP8 input is made again from it.
  release_for_recast(mode, saved.fc2);
  return y;
}

Tensor mlp_backward(ops::Activation activation, Linear& fc1, Linear& fc2, const Tensor& dy,
                    MLP::Saved& saved) {
  OCTET_CHECK(saved.hidden.defined(), "MLP::backward needs the Saved of a forward");
  refill_input(fc2, saved.fc2, fusion_enabled(Fusion::activation_cast), /*rowwise=*/false,
               [&](const ops::FusedQuantize* fused) {
                 const Tensor act =
                     fused ? Tensor() : activation_output(saved.hidden, fc2.in_features());
                 ops::activation_forward(activation, saved.hidden, act, fused);
                 return act;
               });
  Tensor dact = fc2.backward(dy, saved.fc2);
  saved.fc2 = Linear::Saved();
  // The activation's backward writes fc1's FP8 grad_output (and its bias gradient) directly.
  fp8::QuantizedTensor dhidden_q;
  const auto fused = fusion_enabled(Fusion::activation_grad_cast)
                         ? fc1.fused_grad_output(saved.hidden.rows(), saved.fc1, dhidden_q)
                         : std::nullopt;
  const Tensor dhidden = fused ? Tensor() : empty_like(saved.hidden);
  ops::activation_backward(activation, dact, saved.hidden, dhidden, fused ? &*fused : nullptr);
  dact = saved.hidden = Tensor();
  Tensor dx = fused ? fc1.backward(dhidden_q, saved.fc1) : fc1.backward(dhidden, saved.fc1);
  saved.fc1 = Linear::Saved();
  return dx;
}

Tensor MLP::forward(const Tensor& x, Saved& saved, ForwardMode mode, const LinearObserver* observer,
                    const Tensor& residual) {
  return mlp_forward(activation_, fc1_, fc2_, x, saved, mode, observer, residual);
}

Tensor MLP::backward(const Tensor& dy, Saved& saved) {
  return mlp_backward(activation_, fc1_, fc2_, dy, saved);
}

// ----------------------------------------------------------------------------
// TransformerBlock

TransformerBlock::TransformerBlock(const BlockConfig& config, const Device& device, uint64_t seed,
                                   DType compute_dtype, bool recompute)
    : config_(config),
      recompute_(recompute),
      norm1_(config.norm, config.dim, config.norm_eps, device),
      attn_(config, device, seed, compute_dtype),
      norm2_(config.norm, config.dim, config.norm_eps, device) {
  // The MoE layer is rebuilt by the block's own recompute, so it keeps full records itself.
  if (config.moe.enabled()) {
    moe_.emplace(config, device, seed, compute_dtype, /*recompute=*/false);
  } else {
    mlp_.emplace(config, device, seed, compute_dtype);
  }
}

MLP& TransformerBlock::mlp() {
  OCTET_CHECK(mlp_.has_value(), "TransformerBlock::mlp: this block has an MoE layer (moe())");
  return *mlp_;
}

MoE& TransformerBlock::moe() { return const_cast<MoE&>(std::as_const(*this).moe()); }

const MoE& TransformerBlock::moe() const {
  OCTET_CHECK(moe_.has_value(), "TransformerBlock::moe: this block has a dense MLP (mlp())");
  return *moe_;
}

bool TransformerBlock::has_linear(LinearSlot slot) const {
  return mlp_.has_value() || slot == LinearSlot::qkv || slot == LinearSlot::proj;
}

Linear& TransformerBlock::linear(LinearSlot slot) {
  return const_cast<Linear&>(std::as_const(*this).linear(slot));
}

const Linear& TransformerBlock::linear(LinearSlot slot) const {
  switch (slot) {
    case LinearSlot::qkv:
      return attn_.qkv();
    case LinearSlot::proj:
      return attn_.proj();
    case LinearSlot::fc1:
    case LinearSlot::fc2:
      OCTET_CHECK(mlp_.has_value(), "TransformerBlock::linear: an MoE block has no dense ",
                  slot == LinearSlot::fc1 ? "fc1" : "fc2", " (its experts are in moe())");
      return slot == LinearSlot::fc1 ? mlp_->fc1() : mlp_->fc2();
  }
  OCTET_ERROR("TransformerBlock::linear: unknown slot ", static_cast<int>(slot));
}

Tensor TransformerBlock::forward_full(const Tensor& x, Saved& saved, ForwardMode mode,
                                      const LinearObserver* observer) {
  // The norms write the FP8 inputs of qkv and fc1 in the same kernel when those can take them;
  // their high-precision outputs are then needed only by an observer (the FP8 statistics).
  const bool observed = observer != nullptr && *observer && mode == ForwardMode::normal;
  const bool norm_cast = fusion_enabled(Fusion::norm_cast);
  const auto fused_qkv =
      norm_cast ? attn_.qkv().fused_input(x.rows(), x.dtype(), saved.attn.qkv, mode) : std::nullopt;
  const Tensor h1 =
      norm1_.forward(x, saved.norm1, fused_qkv ? &*fused_qkv : nullptr, !fused_qkv || observed);
  // The residual adds ride in proj's and fc2's GEMM epilogues: r = x + attn(h1), y = r + mlp(h2).
  saved.residual = attn_.forward(h1, saved.batch, saved.seq, saved.attn, mode, observer,
                                 /*residual=*/x);
  // qkv's and fc1's FP8 inputs are made again in backward from the norms' kept inputs.
  release_for_recast(mode, saved.attn.qkv);
  if (moe_) {  // the experts' inputs are the dispatched rows: norm2 writes no FP8 copy
    const Tensor h2 = norm2_.forward(saved.residual, saved.norm2);
    Tensor y = moe_->forward(h2, saved.moe, mode, /*residual=*/saved.residual);
    saved.complete = true;
    return y;
  }
  const auto fused_fc1 =
      norm_cast ? mlp_->fc1().fused_input(x.rows(), x.dtype(), saved.mlp.fc1, mode) : std::nullopt;
  const Tensor h2 = norm2_.forward(saved.residual, saved.norm2, fused_fc1 ? &*fused_fc1 : nullptr,
                                   !fused_fc1 || observed);
  Tensor y = mlp_->forward(h2, saved.mlp, mode, observer, /*residual=*/saved.residual);
  release_for_recast(mode, saved.mlp.fc1);
  saved.complete = true;
  return y;
}

Tensor TransformerBlock::forward(const Tensor& x, int64_t batch, int64_t seq, Saved& saved,
                                 ForwardMode mode, const LinearObserver* observer) {
  OCTET_CHECK(mode != ForwardMode::recompute,
              "TransformerBlock::forward: recompute happens inside backward; call forward with "
              "normal or inference");
  OCTET_CHECK(x.defined() && x.ndim() == 2 && x.size(0) == batch * seq && x.size(1) == config_.dim,
              "TransformerBlock expects x [batch*seq, dim] = [", batch * seq, ", ", config_.dim,
              "], got ", x.defined() ? x.describe() : "none");
  Saved full;
  full.input = x;
  full.batch = batch;
  full.seq = seq;
  Tensor y = forward_full(x, full, mode, observer);
  if (mode == ForwardMode::inference) {
    saved = Saved();
  } else if (recompute_) {  // keep the input and what the Linear layers need to redo their part
    Saved kept;
    kept.input = x;
    kept.batch = batch;
    kept.seq = seq;
    kept.snapshots = {full.attn.qkv.snapshot, full.attn.proj.snapshot, full.mlp.fc1.snapshot,
                      full.mlp.fc2.snapshot};
    if (moe_) kept.moe = full.moe.for_recompute(/*keep_input=*/false);
    saved = std::move(kept);
  } else {
    saved = std::move(full);
  }
  return y;
}

Tensor TransformerBlock::backward(const Tensor& dy, Saved& saved, float aux_loss_scale) {
  OCTET_CHECK(saved.input.defined(),
              "TransformerBlock::backward needs the Saved of a training forward, got an empty one");
  if (!saved.complete) {
    saved.attn.qkv = Linear::Saved::from_snapshot(std::move(saved.snapshots[0]));
    saved.attn.proj = Linear::Saved::from_snapshot(std::move(saved.snapshots[1]));
    saved.mlp.fc1 = Linear::Saved::from_snapshot(std::move(saved.snapshots[2]));
    saved.mlp.fc2 = Linear::Saved::from_snapshot(std::move(saved.snapshots[3]));
    forward_full(saved.input, saved, ForwardMode::recompute, nullptr);
  }
  OCTET_CHECK(
      dy.defined() && dy.shape() == saved.input.shape() && dy.dtype() == saved.input.dtype(),
      "TransformerBlock::backward expects dy like its input ", saved.input.describe(), ", got ",
      dy.defined() ? dy.describe() : "none");
  // y = r + mlp(norm2(r)), r = x + attn(norm1(x)): the residual paths add dy through. Each part
  // of the record is freed after its last use.
  Tensor dh2;
  if (moe_) {
    dh2 = moe_->backward(dy, saved.moe, aux_loss_scale);
  } else {
    refill_norm_output(norm2_, saved.residual, mlp_->fc1(), saved.mlp.fc1);
    dh2 = mlp_->backward(dy, saved.mlp);
  }
  const Tensor dr = norm2_.backward(dh2, saved.norm2, /*residual=*/dy);
  dh2 = saved.residual = Tensor();
  saved.norm2 = Norm::Saved();
  refill_norm_output(norm1_, saved.input, attn_.qkv(), saved.attn.qkv);
  const Tensor dh1 = attn_.backward(dr, saved.attn);
  Tensor dx = norm1_.backward(dh1, saved.norm1, /*residual=*/dr);
  saved = Saved();
  return dx;
}

void TransformerBlock::zero_grad(ZeroGrad how) {
  norm1_.zero_grad(how);
  norm2_.zero_grad(how);
  for (int i = 0; i < kBlockLinears; ++i)
    if (has_linear(static_cast<LinearSlot>(i))) linear(static_cast<LinearSlot>(i)).zero_grad(how);
  if (moe_) moe_->zero_grad(how);
}

void TransformerBlock::settle_grads() {
  norm1_.settle_grad();
  norm2_.settle_grad();
  for (int i = 0; i < kBlockLinears; ++i)
    if (has_linear(static_cast<LinearSlot>(i))) linear(static_cast<LinearSlot>(i)).settle_grad();
  if (moe_) moe_->settle_grad();
}

void TransformerBlock::on_weights_updated(PreparedCast prepared) {
  for (int i = 0; i < kBlockLinears; ++i)
    if (has_linear(static_cast<LinearSlot>(i)))
      linear(static_cast<LinearSlot>(i)).on_weights_updated(prepared);
  if (moe_) moe_->on_weights_updated(prepared);
}

}  // namespace octet::nn
