#include "octet/nn/linear.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <vector>

#include "octet/fp8/format.h"
#include "octet/nn/autocast.h"
#include "octet/nn/fusion.h"
#include "octet/ops/gemm.h"
#include "octet/ops/quantize.h"
#include "octet/ops/reduce.h"
#include "octet/ops/scaling.h"

namespace octet::nn {
namespace {

using fp8::TensorRole;

/// Bits of a 64-bit draw kept for a uniform float in [0, 1): a float's significand (24 bits)
/// holds them exactly, so the value does not depend on the platform's distributions.
constexpr int kUniformBits = 24;

/// Fills `n` values uniform in [-bound, bound) from `rng` (portable, unlike
/// std::uniform_real_distribution).
std::vector<float> uniform_values(std::mt19937_64& rng, int64_t n, float bound) {
  std::vector<float> values(static_cast<size_t>(n));
  for (float& v : values) {
    const float unit = std::ldexp(static_cast<float>(rng() >> (64 - kUniformBits)), -kUniformBits);
    v = (2.0f * unit - 1.0f) * bound;
  }
  return values;
}

/// True for the recipes with one scale per tensor (delayed and current scaling).
bool per_tensor(const fp8::Recipe& recipe) {
  return recipe.kind == fp8::RecipeKind::delayed || recipe.kind == fp8::RecipeKind::current;
}

/// Current scaling: scale = fp8_max / max|x| for the role's format, written into `scale` (f32[1])
/// when given, else into a new one. Returns the scale. The amax and scale_inv it passes through
/// share one allocation, with the new scale when it makes one: on a GPU every allocation costs
/// host time, and current scaling does this for every cast.
Tensor current_scale(const Tensor& x, const fp8::Recipe& recipe, TensorRole role,
                     Tensor scale = Tensor()) {
  const bool fresh = !scale.defined();
  const Tensor scratch = Tensor::empty({fresh ? 3 : 2}, DType::f32, x.device());
  Tensor amax = scratch.slice(0, 1);
  if (fresh) scale = scratch.slice(2, 3);
  amax.zero();
  ops::amax(x, amax);
  ops::compute_current_scale(amax, scale, scratch.slice(1, 2),
                             fp8::fp8_max(recipe.dtype_for(role)), recipe.power_of_2_scales);
  return scale;
}

/// True when delayed scaling has no amax history yet for `pass` (a fresh state): instead of the
/// initial scale 1, which would flush most of a first step's gradients to zero, the pass takes its
/// scales from the tensors themselves, as current scaling does (FP8State::calibrated).
bool first_delayed_pass(const FP8State* state, Pass pass) {
  return state != nullptr && state->recipe().kind == fp8::RecipeKind::delayed &&
         !state->calibrated(pass);
}

/// Quantizes the [rows, cols] matrix x for `role`, row-wise and, unless `rowwise_only`, transposed
/// (a training operand is used both ways; an inference input only row-wise). `scale`: per-tensor
/// recipes only; `amax_slot`: optional; `column_sums`: optional, (+)= x's column sums (bias
/// gradients ride on grad_output's cast).
fp8::QuantizedTensor quantize_for(const Tensor& x, const fp8::Recipe& recipe, TensorRole role,
                                  const Tensor& scale, const Tensor& amax_slot,
                                  bool rowwise_only = false, const Tensor& column_sums = {},
                                  bool accumulate_column_sums = true) {
  fp8::QuantizedTensor q = fp8::QuantizedTensor::allocate(
      x.rows(), x.cols(), recipe.dtype_for(role), recipe.mode_for(role),
      fp8::Usage{.rowwise = true, .columnwise = !rowwise_only}, x.device());
  ops::QuantizeArgs args;
  args.scale = scale;
  args.amax = amax_slot;
  args.power_of_2_block_scales = recipe.power_of_2_scales;  // read by block scaling only
  args.column_sums = column_sums;
  args.accumulate_column_sums = accumulate_column_sums;
  ops::quantize(x, q, args);
  return q;
}

/// backward_into's dx: the input's shape and dtype, on the layer's device.
void check_dx(const Tensor& dx, const Linear::Saved& saved, const Device& device) {
  OCTET_CHECK(dx.defined() && dx.shape() == saved.input_shape && dx.dtype() == saved.input_dtype &&
                  dx.device() == device,
              "Linear::backward writes dx as ", dtype_name(saved.input_dtype),
              shape_str(saved.input_shape), " on ", device, ", got ",
              dx.defined() ? dx.describe() : std::string("an undefined tensor"));
}

/// x in `dtype` (x itself when it already is).
Tensor in_dtype(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  Tensor out = Tensor::empty(x.shape(), dtype, x.device());
  ops::cast(x, out);
  return out;
}

/// Whether a GEMM with this cast may write bf16 (and so read WeightCast::bias_bf16): an FP8 GEMM
/// writes its input's dtype, a dense one its compute dtype; an f32 layer never does.
bool may_output_bf16(const WeightCast::Key& key) { return key.fp8 || key.dtype == DType::bf16; }

/// Whether `t`'s memory has no handle but `t` (no view or copy of it lives elsewhere).
bool only_handle(const Tensor& t) { return t.defined() && t.storage().use_count() == 1; }

/// Whether q's own tensors are the only handles on their memory. They share it among themselves:
/// each copy's allocation holds its scales too, and per_tensor's copies share one scale.
bool only_handles(const fp8::QuantizedTensor& q) {
  const std::array<const Tensor*, 4> parts{&q.data, &q.data_t, &q.scale_inv, &q.scale_inv_t};
  return std::ranges::all_of(parts, [&](const Tensor* t) {
    const auto same_memory = [&](const Tensor* u) { return u->storage() == t->storage(); };
    return t->defined() && t->storage().use_count() == std::ranges::count_if(parts, same_memory);
  });
}

/// The [rows, cols] training cast of `role` under `recipe` (both copies, on `device`): `given`
/// when the caller provides it (GroupedLinear carves its experts' casts from one allocation),
/// checked; a fresh one when `given` is empty.
fp8::QuantizedTensor training_cast(fp8::QuantizedTensor given, int64_t rows, int64_t cols,
                                   const fp8::Recipe& recipe, TensorRole role,
                                   const Device& device) {
  const DType dtype = recipe.dtype_for(role);
  const fp8::ScalingMode mode = recipe.mode_for(role);
  if (!given.has_rowwise() && !given.has_columnwise()) {
    return fp8::QuantizedTensor::allocate(rows, cols, dtype, mode,
                                          fp8::Usage{.rowwise = true, .columnwise = true}, device);
  }
  OCTET_CHECK(given.rows == rows && given.cols == cols && given.dtype == dtype &&
                  given.mode == mode && given.has_rowwise() && given.has_columnwise() &&
                  given.device() == device,
              "Linear: the cast buffer given for ", fp8::role_name(role), " must be [", rows, ", ",
              cols, "] ", dtype_name(dtype), " ", fp8::scaling_mode_name(mode),
              " with both copies on ", device, ", got [", given.rows, ", ", given.cols, "] ",
              dtype_name(given.dtype), " ", fp8::scaling_mode_name(given.mode));
  return given;
}

}  // namespace

void Linear::run_gemm(const ops::GemmOperand& a, const ops::GemmOperand& b, const Tensor& d,
                      const ops::GemmArgs& args) {
  if (deferred_gemms_ != nullptr) {
    deferred_gemms_->push_back({a, b, d, args});
  } else {
    ops::gemm(a, b, d, args);
  }
}

Tensor Linear::output_bias(const WeightCast& cast, const Tensor& y) const {
  return y.dtype() == DType::bf16 ? cast.bias_bf16 : bias_;
}

Linear::Saved Linear::Saved::from_snapshot(Snapshot snapshot) {
  Saved saved;
  saved.snapshot = std::move(snapshot);
  return saved;
}

Linear::Linear(int64_t in_features, int64_t out_features, bool bias, const Device& device,
               uint64_t seed, DType compute_dtype)
    : in_(in_features), out_(out_features), device_(device), compute_dtype_(compute_dtype) {
  OCTET_CHECK(in_features > 0 && out_features > 0,
              "Linear needs positive in and out features, got in=", in_features,
              " out=", out_features);
  OCTET_CHECK(is_high_precision(compute_dtype), "Linear compute dtype must be f32 or bf16, got ",
              dtype_name(compute_dtype));
  check_device_available(device);
  // PyTorch's default bound for both weight and bias (kaiming_uniform with a = sqrt(5)).
  const float bound = 1.0f / std::sqrt(static_cast<float>(in_features));
  std::mt19937_64 rng(seed);
  weight_ = Tensor::from_vector(uniform_values(rng, out_ * in_, bound), {out_, in_}).to(device);
  grad_weight_ = Tensor::zeros({out_, in_}, DType::f32, device);
  if (bias) {
    bias_ = Tensor::from_vector(uniform_values(rng, out_, bound), {out_}).to(device);
    grad_bias_ = Tensor::zeros({out_}, DType::f32, device);
  }
}

void Linear::zero_grad(ZeroGrad how) {
  const bool on_write = how == ZeroGrad::on_next_write;
  grad_weight_unwritten_ = on_write;
  grad_bias_unwritten_ = on_write && grad_bias_.defined();
  if (on_write) return;
  grad_weight_.zero();
  if (grad_bias_.defined()) grad_bias_.zero();
}

void Linear::settle_grad() {
  if (grad_weight_unwritten_) grad_weight_.zero();
  if (grad_bias_unwritten_) grad_bias_.zero();
  grad_weight_unwritten_ = grad_bias_unwritten_ = false;
}

bool Linear::bias_grad_accumulates() {
  const bool accumulates = !grad_bias_unwritten_;
  grad_bias_unwritten_ = false;
  return accumulates;
}

ops::GemmArgs Linear::wgrad_args() {
  ops::GemmArgs wgrad;
  wgrad.beta = grad_weight_unwritten_ ? 0.0f : 1.0f;  // overwrite, or accumulate over microbatches
  grad_weight_unwritten_ = false;
  return wgrad;
}

void Linear::check_activation(const Tensor& t, int64_t features, const char* what) const {
  OCTET_CHECK(t.defined(), "Linear: ", what, " is an undefined tensor");
  OCTET_CHECK(t.device() == device_, "Linear(in=", in_, ", out=", out_, ") lives on ", device_,
              " but its ", what, " is ", t.describe(), "; move the ", what, " to ", device_);
  OCTET_CHECK(is_high_precision(t.dtype()), "Linear: ", what, " must be f32 or bf16, got ",
              t.describe());
  OCTET_CHECK(t.ndim() >= 1 && t.size(-1) == features, "Linear(in=", in_, ", out=", out_,
              ") expects ", what, " [..., ", features, "], got ", t.describe());
}

FP8State& Linear::state_for(const fp8::Recipe& recipe) {
  if (!state_ || !state_->matches(recipe)) state_ = std::make_shared<FP8State>(recipe, device_);
  return *state_;
}

std::shared_ptr<const WeightCast> Linear::weight_cast(const WeightCast::Key& key,
                                                      const fp8::Recipe* recipe, ForwardMode mode) {
  if (weight_cast_ && weight_cast_->key == key) return weight_cast_;
  OCTET_CHECK(weight_.defined(), "Linear(in=", in_, ", out=", out_,
              "): its FP32 master weight was released (ZeRO-1 keeps it on the rank that updates "
              "it) and the layer holds no ",
              key.fp8 ? "FP8 cast for this recipe" : "cast for this compute dtype",
              "; it computes only in the format of the casts the optimizer writes for it");
  // Inference leaves the module as it found it: no amax recorded, nothing cached or counted.
  const bool inference = mode == ForwardMode::inference;
  auto cast = std::make_shared<WeightCast>();
  cast->key = key;
  if (key.fp8) {
    // Delayed: the state's weight scale, read by the quantize kernel in stream order, before any
    // later update; current: the weight's own amax. The cast records the weight's amax into the
    // weight slot in both (statistics for current).
    Tensor scale;
    if (recipe->kind == fp8::RecipeKind::delayed) {
      scale = state_->scale(TensorRole::weight);
      if (!inference && first_delayed_pass(state_.get(), Pass::forward))
        current_scale(weight_, *recipe, TensorRole::weight, scale);
    } else if (recipe->kind == fp8::RecipeKind::current) {
      scale = current_scale(weight_, *recipe, TensorRole::weight);
    }
    cast->q = quantize_for(weight_, *recipe, TensorRole::weight, scale,
                           inference ? Tensor() : state_->amax_slot(TensorRole::weight));
    cast->scale = scale;
  } else {
    cast->dense = in_dtype(weight_, key.dtype);
  }
  if (bias_.defined() && may_output_bf16(key)) cast->bias_bf16 = in_dtype(bias_, DType::bf16);
  if (inference) return cast;
  ++weight_casts_;
  weight_cast_ = std::move(cast);
  return weight_cast_;
}

int64_t Linear::weight_cast_bytes() const {
  const auto bytes = [](const Tensor& t) {
    return t.defined() ? static_cast<int64_t>(t.nbytes()) : int64_t{0};
  };
  int64_t total = 0;
  const WeightCast* next = next_cast_.get();
  for (const WeightCast* c : {weight_cast_.get(), next}) {
    if (c == nullptr) continue;
    total += bytes(c->q.data) + bytes(c->q.scale_inv) + bytes(c->q.data_t) +
             bytes(c->q.scale_inv_t) + bytes(c->scale) + bytes(c->bias_bf16);
    if (c->dense.defined() && !(weight_.defined() && c->dense.raw_data() == weight_.raw_data()))
      total += bytes(c->dense);
  }
  return total;
}

const Linear::NextCast& Linear::prepare_next_cast() {
  next_cast_.reset();
  next_targets_ = NextCast{};
  // This step's cast is read no more: the optimizer writes the next one into its memory, every
  // byte of it, when nothing else holds that memory (a record of a forward whose backward has
  // not run would); else the cast is freed first and the next one allocated. Reuse saves an
  // allocation and a free per tensor a step, each microseconds of host time on a GPU.
  std::shared_ptr<const WeightCast> current = std::move(weight_cast_);
  if (!current) return next_targets_;
  const bool sole_cast = current.use_count() == 1;
  const WeightCast::Key key = current->key;
  auto cast = std::make_shared<WeightCast>();
  cast->key = key;
  const fp8::QuantizedTensor old_q =
      sole_cast && only_handles(current->q) ? current->q : fp8::QuantizedTensor{};
  const Tensor old_dense = sole_cast && only_handle(current->dense) ? current->dense : Tensor();
  const Tensor old_bias =
      sole_cast && only_handle(current->bias_bf16) ? current->bias_bf16 : Tensor();
  current.reset();
  if (key.fp8) {
    if (state_ == nullptr || !optimizer_writes_cast(key)) return next_targets_;
    cast->q = old_q.has_rowwise() ? old_q
                                  : fp8::QuantizedTensor::allocate(
                                        out_, in_, key.dtype, key.mode,
                                        fp8::Usage{.rowwise = true, .columnwise = true}, device_);
    next_fp8_target_ = ops::FusedQuantize{};
    next_fp8_target_.out = &cast->q;
    next_fp8_target_.args.scale = state_->scale(TensorRole::weight);
    cast->scale = next_fp8_target_.args.scale;
    next_fp8_target_.args.amax = state_->amax_slot(TensorRole::weight);
    next_targets_.weight_fp8 = &next_fp8_target_;
  } else if (key.dtype == DType::bf16) {
    cast->dense =
        old_dense.defined() ? old_dense : Tensor::empty({out_, in_}, DType::bf16, device_);
    next_targets_.weight_bf16 = cast->dense;
  } else {
    cast->dense = weight_;  // an f32 layer computes with the master itself
  }
  if (bias_.defined() && may_output_bf16(key)) {
    cast->bias_bf16 = old_bias.defined() ? old_bias : Tensor::empty({out_}, DType::bf16, device_);
    next_targets_.bias_bf16 = cast->bias_bf16;
  }
  next_cast_ = std::move(cast);
  return next_targets_;
}

bool Linear::optimizer_writes_cast(const WeightCast::Key& key) {
  if (!key.fp8) return key.dtype == DType::bf16;
  return key.kind == fp8::RecipeKind::delayed && key.mode == fp8::ScalingMode::per_tensor &&
         fusion_enabled(Fusion::optimizer_cast);
}

void Linear::on_weights_updated(PreparedCast prepared) {
  next_targets_ = NextCast{};
  if (prepared == PreparedCast::dropped) {
    next_cast_.reset();
    if (!keep_cast_) weight_cast_.reset();
    return;
  }
  weight_cast_.reset();
  if (!next_cast_) return;
  ++weight_casts_;
  weight_cast_ = std::move(next_cast_);
}

void Linear::release_master_weight() {
  weight_ = Tensor();
  keep_cast_ = true;
}

Linear::Saved Linear::start_record(const Saved& saved, ForwardMode mode) {
  Saved out;
  if (mode == ForwardMode::recompute) {
    OCTET_CHECK(saved.snapshot.weight != nullptr,
                "Linear::forward(recompute) needs the snapshot of the original forward "
                "(Saved::from_snapshot), got a Saved without one");
    out.snapshot = saved.snapshot;
    return out;
  }
  const Fp8Context* fp8_context = active_fp8();
  Snapshot& snap = out.snapshot;
  snap.fp8 = fp8_context != nullptr;
  if (!snap.fp8) {
    snap.weight = weight_cast({.fp8 = false, .dtype = compute_dtype_}, nullptr, mode);
    return out;
  }
  snap.recipe = fp8_context->recipe;
  if (mode == ForwardMode::inference) {
    OCTET_CHECK(state_ != nullptr && state_->matches(snap.recipe),
                "Linear::forward(inference) under ", snap.recipe.name(),
                " needs the layer's FP8 state for that recipe (train under it first, or call "
                "ensure_fp8_state), got ",
                state_ ? "a state for " + state_->recipe().name() : std::string("none"));
  } else {
    state_for(snap.recipe);
    fp8_context->registry->register_state(state_);
  }
  snap.weight = weight_cast(WeightCast::Key::fp8_weight(snap.recipe), &snap.recipe, mode);
  // The input scale in use, which recompute must see even after updates. Delayed scaling knows it
  // now: the state's own, which updates never overwrite (FP8State::scale). Current scaling
  // computes it from the input (forward_fp8).
  if (snap.recipe.kind == fp8::RecipeKind::delayed) {
    snap.input_scale = state_->scale(TensorRole::input);
  } else if (snap.recipe.kind == fp8::RecipeKind::current) {
    snap.input_scale = Tensor::empty({1}, DType::f32, device_);
  }
  return out;
}

bool Linear::takes_fused_input(const Saved& saved, ForwardMode mode) const {
  if (mode == ForwardMode::inference) return false;
  const Fp8Context* fp8_context = active_fp8();
  const bool fp8 = mode == ForwardMode::recompute ? saved.snapshot.fp8 : fp8_context != nullptr;
  if (!fp8) return false;
  const fp8::Recipe& recipe =
      mode == ForwardMode::recompute ? saved.snapshot.recipe : fp8_context->recipe;
  if (recipe.kind != fp8::RecipeKind::delayed) return false;
  // A first pass (of a state not yet built, or built and not yet updated) needs the input's own
  // amax before its cast, which a fused producer cannot give.
  const bool fresh_state = state_ == nullptr || !state_->matches(recipe);
  return !(mode == ForwardMode::normal &&
           (fresh_state || first_delayed_pass(state_.get(), Pass::forward)));
}

std::optional<ops::FusedQuantize> Linear::fused_input(int64_t rows, DType dtype, Saved& saved,
                                                      ForwardMode mode,
                                                      fp8::QuantizedTensor input_q) {
  if (!takes_fused_input(saved, mode)) return std::nullopt;
  const fp8::Recipe recipe =
      mode == ForwardMode::recompute ? saved.snapshot.recipe : active_fp8()->recipe;
  Saved out = start_record(saved, mode);
  out.input_q =
      training_cast(std::move(input_q), rows, in_, recipe, TensorRole::input, device_);
  out.input_prefilled = true;
  out.input_shape = {rows, in_};
  out.input_dtype = dtype;
  saved = std::move(out);
  ops::FusedQuantize fused;
  fused.out = &saved.input_q;
  fused.args.scale = saved.snapshot.input_scale;
  if (mode == ForwardMode::normal) fused.args.amax = state_->amax_slot(TensorRole::input);
  return fused;
}

ops::FusedQuantize Linear::refill_input(Saved& saved, bool rowwise) {
  const Snapshot& snap = saved.snapshot;
  OCTET_CHECK(snap.fp8 && snap.weight != nullptr && !saved.input_shape.empty(),
              "Linear::refill_input needs the record of an FP8 training forward, got ",
              snap.fp8 ? "an empty one" : "a high-precision one");
  const fp8::Recipe& recipe = snap.recipe;
  saved.input_q = fp8::QuantizedTensor::allocate(
      shape_numel(saved.input_shape) / in_, in_, recipe.dtype_for(TensorRole::input),
      recipe.mode_for(TensorRole::input), fp8::Usage{.rowwise = rowwise, .columnwise = true},
      device_);
  ops::FusedQuantize target;
  target.out = &saved.input_q;
  target.args.scale = snap.input_scale;  // per-tensor recipes: the forward's; else undefined
  target.args.power_of_2_block_scales = recipe.power_of_2_scales;
  return target;
}

Tensor Linear::forward(const Tensor& x, Saved& saved, ForwardMode mode, const Tensor& residual) {
  Shape y_shape = x.defined() ? x.shape() : saved.input_shape;
  if (!y_shape.empty()) y_shape.back() = out_;
  Tensor y = Tensor::empty(y_shape, x.defined() ? x.dtype() : saved.input_dtype, device_);
  forward_into(x, y, saved, mode, residual);
  return y;
}

void Linear::forward_into(const Tensor& x, const Tensor& y, Saved& saved, ForwardMode mode,
                          const Tensor& residual) {
  if (x.defined()) {
    check_activation(x, in_, "input");
    OCTET_CHECK(!saved.input_prefilled ||
                    (saved.input_q.rows == x.numel() / in_ && saved.input_dtype == x.dtype()),
                "Linear::forward: the fused input holds ", saved.input_q.rows, " rows of ",
                dtype_name(saved.input_dtype), " but x is ", x.describe(),
                " (fused_input was called for another input)");
  } else {
    OCTET_CHECK(saved.input_prefilled,
                "Linear::forward: x is undefined, which needs a fused input (fused_input)");
  }
  // The output's shape and dtype, known before the record starts, so that a bad residual is
  // refused before any FP8 state is registered.
  Shape y_shape = x.defined() ? x.shape() : saved.input_shape;
  y_shape.back() = out_;
  const DType y_dtype = x.defined() ? x.dtype() : saved.input_dtype;
  if (residual.defined()) {
    check_activation(residual, out_, "residual");
    OCTET_CHECK(residual.shape() == y_shape && residual.dtype() == y_dtype, "Linear(in=", in_,
                ", out=", out_, ") expects a residual like its output, ", dtype_name(y_dtype),
                shape_str(y_shape), ", got ", residual.describe());
  }
  Saved out = saved.input_prefilled ? std::move(saved) : start_record(saved, mode);
  if (x.defined()) {
    out.input_shape = x.shape();
    out.input_dtype = x.dtype();
  }
  OCTET_CHECK(y.defined() && y.device() == device_ && y.shape() == y_shape && y.dtype() == y_dtype,
              "Linear(in=", in_, ", out=", out_, ") writes its output into ", dtype_name(y_dtype),
              shape_str(y_shape), " on ", device_, ", got ",
              y.defined() ? y.describe() : std::string("an undefined tensor"));
  const Tensor x2 = x.defined() ? x.view({-1, in_}) : Tensor();
  const Tensor y2 = y.view({-1, out_});
  const Tensor residual2 = residual.defined() ? residual.view({-1, out_}) : Tensor();
  if (out.snapshot.fp8) {
    forward_fp8(x2, y2, residual2, mode, out);
  } else {
    forward_dense(x2, y2, residual2, out);
  }
  out.input_prefilled = false;  // consumed: a later forward into this record quantizes again
  saved = std::move(out);
}

void Linear::forward_fp8(const Tensor& x, const Tensor& y, const Tensor& residual, ForwardMode mode,
                         Saved& saved) {
  Snapshot& snap = saved.snapshot;
  const fp8::Recipe& recipe = snap.recipe;
  const bool record = mode == ForwardMode::normal;
  OCTET_CHECK(state_ != nullptr, "Linear: FP8 forward without an FP8 state");

  Tensor input_scale;
  if (per_tensor(recipe)) {
    OCTET_CHECK(snap.input_scale.defined() && snap.input_scale.numel() == 1,
                "Linear::forward(recompute): the snapshot of a per-tensor FP8 recipe must hold "
                "the input scale of the original forward, got ",
                snap.input_scale.describe());
    input_scale = snap.input_scale;
    // Current scaling, and delayed scaling's first pass, scale from the input itself (a recompute
    // keeps the snapshot's scale).
    const bool from_input = recipe.kind == fp8::RecipeKind::current
                                ? mode != ForwardMode::recompute
                                : record && first_delayed_pass(state_.get(), Pass::forward);
    if (from_input) current_scale(x, recipe, TensorRole::input, input_scale);
  }
  if (!saved.input_prefilled) {
    saved.input_q = quantize_for(x, recipe, TensorRole::input, input_scale,
                                 record ? state_->amax_slot(TensorRole::input) : Tensor(),
                                 /*rowwise_only=*/mode == ForwardMode::inference);
  }
  if (record) state_->mark_recorded(Pass::forward);

  ops::GemmArgs args;
  args.bias = output_bias(*snap.weight, y);
  args.addend = residual;
  args.accumulation = ops::Accumulation::fast;
  // TN: x [rows, in] times (W [out, in])^T.
  run_gemm(ops::GemmOperand::fp8(saved.input_q, /*use_transposed_copy=*/false),
            ops::GemmOperand::fp8(snap.weight->q, /*use_transposed_copy=*/false,
                                  /*transpose=*/true),
            y, args);
}

void Linear::forward_dense(const Tensor& x, const Tensor& y, const Tensor& residual, Saved& saved) {
  saved.input = in_dtype(x, compute_dtype_);
  ops::GemmArgs args;
  args.bias = output_bias(*saved.snapshot.weight, y);
  args.addend = residual;
  run_gemm(ops::GemmOperand::dense(saved.input),
            ops::GemmOperand::dense(saved.snapshot.weight->dense, /*transpose=*/true), y, args);
}

Tensor Linear::backward(const Tensor& dy, const Saved& saved) {
  OCTET_CHECK(saved.filled() && saved.snapshot.weight != nullptr,
              "Linear::backward needs the Saved of a forward (or of a recompute), got an empty "
              "one");
  Tensor dx = Tensor::empty(saved.input_shape, saved.input_dtype, device_);
  backward_into(dy, dx, saved);
  return dx;
}

void Linear::backward_into(const Tensor& dy, const Tensor& dx, const Saved& saved) {
  OCTET_CHECK(saved.filled() && saved.snapshot.weight != nullptr,
              "Linear::backward needs the Saved of a forward (or of a recompute), got an empty "
              "one");
  check_activation(dy, out_, "grad_output");
  Shape expected = saved.input_shape;
  expected.back() = out_;
  OCTET_CHECK(dy.shape() == expected, "Linear::backward expects grad_output of shape ",
              shape_str(expected), " (the output's), got ", dy.describe());
  check_dx(dx, saved, device_);
  const Tensor dy2 = dy.view({-1, out_});
  const Tensor dx2 = dx.view({-1, in_});
  if (saved.snapshot.fp8) {
    backward_fp8(dy2, dx2, saved);
  } else {
    backward_dense(dy2, dx2, saved);
  }
}

void Linear::backward_fp8(const Tensor& dy, const Tensor& dx, const Saved& saved) {
  const fp8::Recipe& recipe = saved.snapshot.recipe;
  OCTET_CHECK(state_ != nullptr && state_->matches(recipe),
              "Linear::backward: the FP8 state of the forward's recipe ", recipe.name(),
              " is gone (was the layer run under another recipe in between?)");
  OCTET_CHECK(saved.input_q.has_columnwise(),
              "Linear::backward needs the Saved of a training forward, got one of an inference "
              "forward (it keeps no transposed input)");
  Tensor scale;
  if (recipe.kind == fp8::RecipeKind::delayed) {
    scale = state_->scale(TensorRole::grad_output);
    if (first_delayed_pass(state_.get(), Pass::backward))
      current_scale(dy, recipe, TensorRole::grad_output, scale);
  } else if (recipe.kind == fp8::RecipeKind::current) {
    scale = current_scale(dy, recipe, TensorRole::grad_output);
  }
  // The bias gradient rides on the cast (Fusion::bias_grad), or is summed by its own pass.
  const bool fused_bias = grad_bias_.defined() && fusion_enabled(Fusion::bias_grad);
  if (grad_bias_.defined() && !fused_bias) ops::sum_rows(dy, grad_bias_, bias_grad_accumulates());
  const fp8::QuantizedTensor dy_q = quantize_for(
      dy, recipe, TensorRole::grad_output, scale, state_->amax_slot(TensorRole::grad_output),
      /*rowwise_only=*/false, fused_bias ? grad_bias_ : Tensor(),
      fused_bias ? bias_grad_accumulates() : true);
  state_->mark_recorded(Pass::backward);
  if (grad_stats_ != nullptr) *grad_stats_ = measure_cast(dy, dy_q.data, scale);
  backward_gemms_fp8(dy_q, dx, saved);
}

bool Linear::takes_fused_grad_output(const Saved& saved) const {
  const Snapshot& snap = saved.snapshot;
  if (!snap.fp8 || snap.recipe.kind != fp8::RecipeKind::delayed) return false;
  if (first_delayed_pass(state_.get(), Pass::backward)) return false;
  // The fused producer sums the bias gradient too, which Fusion::bias_grad may have switched off.
  if (grad_bias_.defined() && !fusion_enabled(Fusion::bias_grad)) return false;
  return grad_stats_ == nullptr;  // the statistics need the unfused dy
}

std::optional<ops::FusedQuantize> Linear::fused_grad_output(int64_t rows, const Saved& saved,
                                                            fp8::QuantizedTensor& dy_q) {
  if (!takes_fused_grad_output(saved)) return std::nullopt;
  const Snapshot& snap = saved.snapshot;
  OCTET_CHECK(state_ != nullptr && state_->matches(snap.recipe),
              "Linear::fused_grad_output: the FP8 state of the forward's recipe ",
              snap.recipe.name(), " is gone");
  dy_q = training_cast(std::move(dy_q), rows, out_, snap.recipe, TensorRole::grad_output, device_);
  ops::FusedQuantize fused;
  fused.out = &dy_q;
  fused.args.scale = state_->scale(TensorRole::grad_output);
  fused.args.amax = state_->amax_slot(TensorRole::grad_output);
  fused.args.column_sums = grad_bias_;
  fused.args.accumulate_column_sums = bias_grad_accumulates();
  state_->mark_recorded(Pass::backward);
  return fused;
}

Tensor Linear::backward(const fp8::QuantizedTensor& dy_q, const Saved& saved) {
  OCTET_CHECK(saved.filled() && saved.snapshot.weight != nullptr && saved.snapshot.fp8,
              "Linear::backward(dy_q) needs the Saved of an FP8 forward");
  Tensor dx = Tensor::empty(saved.input_shape, saved.input_dtype, device_);
  backward_into(dy_q, dx, saved);
  return dx;
}

void Linear::backward_into(const fp8::QuantizedTensor& dy_q, const Tensor& dx,
                           const Saved& saved) {
  OCTET_CHECK(saved.filled() && saved.snapshot.weight != nullptr && saved.snapshot.fp8,
              "Linear::backward(dy_q) needs the Saved of an FP8 forward");
  const int64_t rows = shape_numel(saved.input_shape) / in_;
  OCTET_CHECK(dy_q.rows == rows && dy_q.cols == out_ && dy_q.has_rowwise() && dy_q.has_columnwise(),
              "Linear::backward expects the fused grad_output [", rows, ", ", out_,
              "] with both copies (fused_grad_output), got [", dy_q.rows, ", ", dy_q.cols, "]");
  check_dx(dx, saved, device_);
  backward_gemms_fp8(dy_q, dx.view({-1, in_}), saved);
}

void Linear::backward_gemms_fp8(const fp8::QuantizedTensor& dy_q, const Tensor& dx,
                                const Saved& saved) {
  ops::GemmArgs dgrad;
  dgrad.accumulation = ops::Accumulation::split;
  // TN: dy [rows, out] times (W^T [in, out])^T.
  run_gemm(ops::GemmOperand::fp8(dy_q, /*use_transposed_copy=*/false),
            ops::GemmOperand::fp8(saved.snapshot.weight->q, /*use_transposed_copy=*/true,
                                  /*transpose=*/true),
            dx, dgrad);

  ops::GemmArgs wgrad = wgrad_args();
  wgrad.accumulation = ops::Accumulation::split;
  // TN: dy^T [out, rows] times (x^T [in, rows])^T.
  run_gemm(ops::GemmOperand::fp8(dy_q, /*use_transposed_copy=*/true),
            ops::GemmOperand::fp8(saved.input_q, /*use_transposed_copy=*/true, /*transpose=*/true),
            grad_weight_, wgrad);
}

void Linear::backward_dense(const Tensor& dy, const Tensor& dx, const Saved& saved) {
  if (grad_bias_.defined()) ops::sum_rows(dy, grad_bias_, bias_grad_accumulates());
  const Tensor dy_c = in_dtype(dy, saved.input.dtype());
  // dx [rows, in] = dy [rows, out] W [out, in].
  run_gemm(ops::GemmOperand::dense(dy_c), ops::GemmOperand::dense(saved.snapshot.weight->dense),
            dx);
  const ops::GemmArgs wgrad = wgrad_args();
  // grad_weight [out, in] += dy^T [out, rows] x [rows, in].
  run_gemm(ops::GemmOperand::dense(dy_c, /*transpose=*/true), ops::GemmOperand::dense(saved.input),
            grad_weight_, wgrad);
}

}  // namespace octet::nn
