// The C API's Linear module: create, forward, backward, parameter views and the FP8 state for
// checkpoints (include/octet/octet.h).
#include <memory>
#include <optional>

#include "capi/capi_internal.h"

using octet::capi::deref;
using octet::capi::guarded;
namespace nn = octet::nn;

namespace {

/// The checkpointed tensors of an FP8 state, in octet_linear_fp8_state_get's index order.
struct StateEntry {
  const char* name;
  nn::Pass pass;
  octet::Tensor octet::ops::ScalingGroup::*member;
};
constexpr StateEntry kStateEntries[] = {
    {"forward.scale", nn::Pass::forward, &octet::ops::ScalingGroup::scale},
    {"forward.scale_inv", nn::Pass::forward, &octet::ops::ScalingGroup::scale_inv},
    {"forward.amax_history", nn::Pass::forward, &octet::ops::ScalingGroup::amax_history},
    {"backward.scale", nn::Pass::backward, &octet::ops::ScalingGroup::scale},
    {"backward.scale_inv", nn::Pass::backward, &octet::ops::ScalingGroup::scale_inv},
    {"backward.amax_history", nn::Pass::backward, &octet::ops::ScalingGroup::amax_history},
};
constexpr int kStateCount = static_cast<int>(std::size(kStateEntries));

const StateEntry& state_entry(int index) {
  OCTET_CAPI_CHECK(index >= 0 && index < kStateCount, "FP8 state index ", index,
                   " out of range [0, ", kStateCount, ")");
  return kStateEntries[index];
}

/// The state tensor `index` of the layer's FP8 state for `recipe` (created when absent).
octet::Tensor state_tensor(octet_linear* linear, const octet_recipe* recipe, int index) {
  nn::Linear& m = deref(linear, "linear").module;
  const octet::fp8::Recipe& r = deref(recipe, "recipe").recipe;
  const StateEntry& e = state_entry(index);
  return m.ensure_fp8_state(r).group(e.pass).*(e.member);
}

}  // namespace

namespace octet::capi {

nn::ForwardMode to_mode(octet_forward_mode mode) {
  switch (mode) {
    case OCTET_FORWARD_TRAINING:
      return nn::ForwardMode::normal;
    case OCTET_FORWARD_RECOMPUTE:
      return nn::ForwardMode::recompute;
    case OCTET_FORWARD_INFERENCE:
      return nn::ForwardMode::inference;
  }
  throw InvalidArgument(__FILE__, __LINE__,
                        detail::concat("unknown octet_forward_mode ", static_cast<int>(mode)));
}

std::unique_ptr<octet_saved> begin_forward(const void* owner, const DLManagedTensor* x,
                                           octet_forward_mode mode, const octet_saved* original,
                                           DLManagedTensor** y, octet_saved** saved,
                                           const char* module) {
  deref(y, "y");
  deref(saved, "saved");
  OCTET_CAPI_CHECK(x != nullptr, "x must not be NULL");
  auto record = std::make_unique<octet_saved>();
  record->owner = owner;
  record->mode = mode;
  if (to_mode(mode) != nn::ForwardMode::recompute) {
    OCTET_CAPI_CHECK(original == nullptr,
                     "original must be NULL unless mode is OCTET_FORWARD_RECOMPUTE");
    return record;
  }
  const octet_saved& o = deref(original, "original (the record of the forward to recompute)");
  OCTET_CAPI_CHECK(o.owner == owner, "original: the record belongs to another ", module,
                   " than the one recomputing");
  OCTET_CAPI_CHECK(o.mode != OCTET_FORWARD_INFERENCE,
                   "original: an inference record cannot be recomputed for backward");
  record->saved = nn::Linear::Saved::from_snapshot(o.saved.snapshot);
  record->mlp = snapshots_only(o.mlp);
  return record;
}

void check_backward_record(const void* owner, const octet_saved* saved, const char* module) {
  OCTET_CAPI_CHECK(saved != nullptr,
                   "saved must not be NULL: backward needs the record of a forward");
  OCTET_CAPI_CHECK(saved->owner == owner, "saved: the record belongs to another ", module,
                   " than the one running backward");
  OCTET_CAPI_CHECK(saved->mode != OCTET_FORWARD_INFERENCE,
                   "saved: the record of an inference forward cannot be used for backward");
}

octet_linear make_linear(int64_t in_features, int64_t out_features, int bias, octet_norm norm,
                         float eps, DLDevice device, uint64_t seed, octet_dtype compute_dtype) {
  OCTET_CAPI_CHECK(in_features > 0 && out_features > 0, "Linear features must be positive, got in ",
                   in_features, ", out ", out_features);
  const DType dtype = to_dtype(compute_dtype, "compute_dtype");
  OCTET_CAPI_CHECK(is_high_precision(dtype), "compute_dtype: expected OCTET_F32 or OCTET_BF16, got ",
                   dtype_name(dtype));
  OCTET_CAPI_CHECK(
      norm == OCTET_NORM_NONE || norm == OCTET_NORM_LAYERNORM || norm == OCTET_NORM_RMSNORM,
      "norm: expected OCTET_NORM_NONE, OCTET_NORM_LAYERNORM or OCTET_NORM_RMSNORM, got ",
      static_cast<int>(norm));
  OCTET_CAPI_CHECK(norm == OCTET_NORM_NONE || eps > 0.0f,
                   "eps: the norm's epsilon must be positive, got ", eps);
  const Device d = to_device(device);
  check_device_available(d);
  octet_linear linear{nn::Linear(in_features, out_features, bias != 0, d, seed, dtype), {}};
  if (norm != OCTET_NORM_NONE)
    linear.norm.emplace(
        norm == OCTET_NORM_LAYERNORM ? nn::NormKind::layernorm : nn::NormKind::rmsnorm,
        in_features, eps, d);
  return linear;
}

}  // namespace octet::capi

extern "C" {

octet_status octet_linear_create(int64_t in_features, int64_t out_features, int bias,
                                 DLDevice device, uint64_t seed, octet_dtype compute_dtype,
                                 octet_linear** out) {
  return octet_linear_create_normed(in_features, out_features, bias, OCTET_NORM_NONE, 0.0f, device,
                                    seed, compute_dtype, out);
}

octet_status octet_linear_create_normed(int64_t in_features, int64_t out_features, int bias,
                                        octet_norm norm, float eps, DLDevice device, uint64_t seed,
                                        octet_dtype compute_dtype, octet_linear** out) {
  return guarded([&] {
    deref(out, "out");
    *out = std::make_unique<octet_linear>(octet::capi::make_linear(
                                              in_features, out_features, bias, norm, eps, device,
                                              seed, compute_dtype))
               .release();
  });
}

void octet_linear_destroy(octet_linear* linear) {
  if (linear == nullptr || linear->part_of_mlp) return;  // an MLP's layer goes with the MLP
  delete linear;
}

octet_status octet_linear_norm_info(const octet_linear* linear, octet_norm* norm, float* eps) {
  return guarded([&] {
    const std::optional<nn::Norm>& n = deref(linear, "linear").norm;
    if (norm)
      *norm = !n                                     ? OCTET_NORM_NONE
              : n->kind() == nn::NormKind::layernorm ? OCTET_NORM_LAYERNORM
                                                     : OCTET_NORM_RMSNORM;
    if (eps) *eps = n ? n->eps() : 0.0f;
  });
}

octet_status octet_linear_info(const octet_linear* linear, int64_t* in_features,
                               int64_t* out_features, int* has_bias, DLDevice* device) {
  return guarded([&] {
    const nn::Linear& m = deref(linear, "linear").module;
    if (in_features) *in_features = m.in_features();
    if (out_features) *out_features = m.out_features();
    if (has_bias) *has_bias = m.bias().defined() ? 1 : 0;
    if (device) *device = octet::capi::from_device(m.device());
  });
}

octet_status octet_linear_forward(octet_linear* linear, DLManagedTensor* x, octet_forward_mode mode,
                                  const octet_saved* original, void* stream, DLManagedTensor** y,
                                  octet_saved** saved) {
  octet::capi::Consumed input(x);
  return guarded([&] {
    nn::Linear& m = deref(linear, "linear").module;
    const nn::ForwardMode fm = octet::capi::to_mode(mode);
    auto record = octet::capi::begin_forward(linear, x, mode, original, y, saved, "Linear");
    const octet::Tensor xt = octet::capi::adopt(input.take(), "x");
    octet::capi::StreamJoin join(m.device(), stream);
    const std::optional<nn::Norm>& norm = linear->norm;
    const octet::Tensor yt =
        norm ? nn::norm_linear_forward(*norm, m, xt, record->norm, record->saved, fm)
             : m.forward(xt, record->saved, fm);
    *y = octet::capi::export_tensor(yt, stream);
    *saved = record.release();
  });
}

octet_status octet_linear_backward(octet_linear* linear, const DLTensor* dy,
                                   const octet_saved* saved, void* stream, DLManagedTensor** dx) {
  return guarded([&] {
    nn::Linear& m = deref(linear, "linear").module;
    deref(dx, "dx");
    octet::capi::check_backward_record(linear, saved, "Linear");
    std::optional<nn::Norm>& norm = linear->norm;
    OCTET_CAPI_CHECK(saved->saved.filled() && (!norm || saved->norm.input.defined()),
                     "saved: the record's activations were released; recompute it "
                     "(OCTET_FORWARD_RECOMPUTE) before backward");
    const octet::Tensor dyt = octet::capi::borrow(dy, "dy");
    octet::capi::StreamJoin join(m.device(), stream);
    const octet::Tensor dxt =
        norm ? nn::norm_linear_backward(*norm, m, dyt, saved->norm, saved->saved)
             : m.backward(dyt, saved->saved);
    *dx = octet::capi::export_tensor(dxt, stream);
  });
}

octet_status octet_saved_release_activations(octet_saved* saved) {
  return guarded([&] {
    octet_saved& s = deref(saved, "saved");
    s.saved = nn::Linear::Saved::from_snapshot(std::move(s.saved.snapshot));
    s.mlp = octet::capi::snapshots_only(std::move(s.mlp));
    s.norm = nn::Norm::Saved{};
  });
}

void octet_saved_destroy(octet_saved* saved) { delete saved; }

octet_status octet_linear_zero_grad(octet_linear* linear, int on_next_write, void* stream) {
  return guarded([&] {
    nn::Linear& m = deref(linear, "linear").module;
    const nn::ZeroGrad how = on_next_write ? nn::ZeroGrad::on_next_write : nn::ZeroGrad::now;
    // on_next_write only marks the gradients: no device work to order on the caller's stream,
    // so none of the join's four CUDA calls (octet.torch's modules make this call every step).
    std::optional<octet::capi::StreamJoin> join;
    if (how == nn::ZeroGrad::now) join.emplace(m.device(), stream);
    m.zero_grad(how);
    if (linear->norm) linear->norm->zero_grad(how);
  });
}

octet_status octet_linear_weights_updated(octet_linear* linear) {
  return guarded([&] { deref(linear, "linear").module.on_weights_updated(); });
}

octet_status octet_linear_tensor_view(const octet_linear* linear, octet_linear_tensor which,
                                      void* stream, DLManagedTensor** out) {
  return guarded([&] {
    const nn::Linear& m = deref(linear, "linear").module;
    deref(out, "out");
    const std::optional<nn::Norm>& norm = linear->norm;
    const octet::Tensor* t = nullptr;
    const bool of_norm = which >= OCTET_LINEAR_NORM_WEIGHT && which <= OCTET_LINEAR_GRAD_NORM_BIAS;
    OCTET_CAPI_CHECK(!of_norm || norm, "the Linear has no norm (it was not created with one)");
    switch (which) {
      case OCTET_LINEAR_WEIGHT:
        t = &m.weight();
        break;
      case OCTET_LINEAR_BIAS:
        t = &m.bias();
        break;
      case OCTET_LINEAR_GRAD_WEIGHT:
        t = &m.grad_weight();
        break;
      case OCTET_LINEAR_GRAD_BIAS:
        t = &m.grad_bias();
        break;
      case OCTET_LINEAR_NORM_WEIGHT:
        t = &norm->gamma();
        break;
      case OCTET_LINEAR_NORM_BIAS:
        t = &norm->beta();
        break;
      case OCTET_LINEAR_GRAD_NORM_WEIGHT:
        t = &norm->grad_gamma();
        break;
      case OCTET_LINEAR_GRAD_NORM_BIAS:
        t = &norm->grad_beta();
        break;
    }
    OCTET_CAPI_CHECK(t != nullptr, "unknown octet_linear_tensor ", static_cast<int>(which));
    OCTET_CAPI_CHECK(t->defined(), of_norm
                                       ? "an RMSNorm has no beta (only LayerNorm has one)"
                                       : "the Linear has no bias (it was created with bias = 0)");
    octet::capi::StreamJoin join(m.device(), stream);
    *out = octet::capi::export_tensor(*t, stream);
  });
}

octet_status octet_linear_fp8_state_count(octet_linear* linear, const octet_recipe* recipe,
                                          int* count) {
  return guarded([&] {
    deref(count, "count");
    deref(linear, "linear").module.ensure_fp8_state(deref(recipe, "recipe").recipe);
    *count = kStateCount;
  });
}

octet_status octet_linear_fp8_state_name(int index, const char** name) {
  return guarded([&] { deref(name, "name") = state_entry(index).name; });
}

octet_status octet_linear_fp8_state_get(octet_linear* linear, const octet_recipe* recipe, int index,
                                        void* stream, DLManagedTensor** out) {
  return guarded([&] {
    deref(out, "out");
    const octet::Tensor t = state_tensor(linear, recipe, index);
    octet::capi::StreamJoin join(t.device(), stream);
    *out = octet::capi::export_tensor(t.clone(), stream);
  });
}

octet_status octet_linear_fp8_state_set(octet_linear* linear, const octet_recipe* recipe, int index,
                                        const DLTensor* value, void* stream) {
  return guarded([&] {
    octet::Tensor t = state_tensor(linear, recipe, index);
    const octet::Tensor v = octet::capi::borrow(value, "value");
    OCTET_CAPI_CHECK(v.dtype() == octet::DType::f32 && v.shape() == t.shape(), "value for ",
                     state_entry(index).name, ": expected f32", octet::shape_str(t.shape()),
                     ", got ", v.describe());
    octet::capi::StreamJoin join(t.device(), stream);
    t.copy_from(v);
    // A restored pass scales from its history from now on, not from its first tensors.
    linear->module.ensure_fp8_state(recipe->recipe).set_calibrated(state_entry(index).pass, true);
    // The cached weight cast was made with the old weight scale.
    linear->module.on_weights_updated();
  });
}

octet_status octet_linear_fp8_update_counts(const octet_linear* linear, int64_t* forward,
                                            int64_t* backward) {
  return guarded([&] {
    const auto& state = deref(linear, "linear").module.fp8_state();
    if (forward) *forward = state ? state->forward_updates() : 0;
    if (backward) *backward = state ? state->backward_updates() : 0;
  });
}

}  // extern "C"
