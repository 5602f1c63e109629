// The C API's MLP: a norm and two Linears (include/octet/octet.h), Transformer Engine's
// LayerNormMLP. Its layers are octet_linear handles, so parameters, gradients and FP8 states go
// through the Linear calls.
#include <memory>
#include <optional>

#include "capi/capi_internal.h"
#include "octet/ops/activation.h"

using octet::capi::deref;
using octet::capi::guarded;
namespace nn = octet::nn;

namespace {

octet::ops::Activation to_activation(octet_activation activation) {
  switch (activation) {
    case OCTET_ACTIVATION_GELU:
      return octet::ops::Activation::gelu;
    case OCTET_ACTIVATION_SWIGLU:
      return octet::ops::Activation::swiglu;
    case OCTET_ACTIVATION_SRELU:
      return octet::ops::Activation::srelu;
  }
  throw octet::capi::InvalidArgument(
      __FILE__, __LINE__,
      octet::detail::concat("activation: expected OCTET_ACTIVATION_GELU, _SWIGLU or _SRELU, got ",
                            static_cast<int>(activation)));
}

octet_activation from_activation(octet::ops::Activation activation) {
  switch (activation) {
    case octet::ops::Activation::gelu:
      return OCTET_ACTIVATION_GELU;
    case octet::ops::Activation::swiglu:
      return OCTET_ACTIVATION_SWIGLU;
    case octet::ops::Activation::srelu:
      return OCTET_ACTIVATION_SRELU;
  }
  return OCTET_ACTIVATION_GELU;
}

}  // namespace

extern "C" {

octet_status octet_mlp_create(int64_t hidden, int64_t ffn, int bias, octet_activation activation,
                              octet_norm norm, float eps, DLDevice device, uint64_t seed,
                              octet_dtype compute_dtype, octet_mlp** out) {
  return guarded([&] {
    deref(out, "out");
    OCTET_CAPI_CHECK(hidden > 0 && ffn > 0, "MLP sizes must be positive, got hidden ", hidden,
                     ", ffn ", ffn);
    const octet::ops::Activation act = to_activation(activation);
    auto mlp = std::make_unique<octet_mlp>(octet_mlp{
        act,
        octet::capi::make_linear(hidden, octet::ops::activation_input_cols(act, ffn), bias, norm,
                                 eps, device, seed, compute_dtype),
        octet::capi::make_linear(ffn, hidden, bias, OCTET_NORM_NONE, 0.0f, device, seed + 1,
                                 compute_dtype)});
    mlp->fc1.part_of_mlp = mlp->fc2.part_of_mlp = true;
    *out = mlp.release();
  });
}

void octet_mlp_destroy(octet_mlp* mlp) { delete mlp; }

octet_status octet_mlp_info(const octet_mlp* mlp, int64_t* hidden, int64_t* ffn,
                            octet_activation* activation) {
  return guarded([&] {
    const octet_mlp& m = deref(mlp, "mlp");
    if (hidden) *hidden = m.fc2.module.out_features();
    if (ffn) *ffn = m.fc2.module.in_features();
    if (activation) *activation = from_activation(m.activation);
  });
}

octet_status octet_mlp_linear(octet_mlp* mlp, int index, octet_linear** out) {
  return guarded([&] {
    octet_mlp& m = deref(mlp, "mlp");
    deref(out, "out");
    OCTET_CAPI_CHECK(index == 0 || index == 1, "index: expected 0 (fc1) or 1 (fc2), got ", index);
    *out = index == 0 ? &m.fc1 : &m.fc2;
  });
}

octet_status octet_mlp_forward(octet_mlp* mlp, DLManagedTensor* x, octet_forward_mode mode,
                               const octet_saved* original, void* stream, DLManagedTensor** y,
                               octet_saved** saved) {
  octet::capi::Consumed input(x);
  return guarded([&] {
    octet_mlp& m = deref(mlp, "mlp");
    const nn::ForwardMode fm = octet::capi::to_mode(mode);
    auto record = octet::capi::begin_forward(mlp, x, mode, original, y, saved, "MLP");
    const octet::Tensor xt = octet::capi::adopt(input.take(), "x");
    nn::Linear& fc1 = m.fc1.module;
    nn::Linear& fc2 = m.fc2.module;
    OCTET_CAPI_CHECK(xt.ndim() >= 1 && xt.size(-1) == fc1.in_features(), "x: the MLP expects [..., ",
                     fc1.in_features(), "], got ", xt.describe());
    octet::capi::StreamJoin join(fc1.device(), stream);
    const std::optional<nn::Norm>& norm = m.fc1.norm;  // the MLP's
    const octet::Tensor yt =
        norm ? nn::norm_mlp_forward(*norm, m.activation, fc1, fc2, xt, record->norm, record->mlp,
                                    fm)
             : nn::mlp_forward(m.activation, fc1, fc2, xt.view({-1, fc1.in_features()}),
                               record->mlp, fm)
                   .view(xt.shape());
    *y = octet::capi::export_tensor(yt, stream);
    *saved = record.release();
  });
}

octet_status octet_mlp_backward(octet_mlp* mlp, const DLTensor* dy, octet_saved* saved,
                                void* stream, DLManagedTensor** dx) {
  return guarded([&] {
    octet_mlp& m = deref(mlp, "mlp");
    deref(dx, "dx");
    octet::capi::check_backward_record(mlp, saved, "MLP");
    std::optional<nn::Norm>& norm = m.fc1.norm;  // the MLP's
    OCTET_CAPI_CHECK(saved->mlp.hidden.defined() && (!norm || saved->norm.input.defined()),
                     "saved: the record's activations were released (by a backward or "
                     "octet_saved_release_activations); recompute it (OCTET_FORWARD_RECOMPUTE) "
                     "before backward");
    const octet::Tensor dyt = octet::capi::borrow(dy, "dy");
    nn::Linear& fc1 = m.fc1.module;
    nn::Linear& fc2 = m.fc2.module;
    OCTET_CAPI_CHECK(dyt.ndim() >= 1 && dyt.size(-1) == fc2.out_features(),
                     "dy: the MLP's output is [..., ", fc2.out_features(), "], got ",
                     dyt.describe());
    octet::capi::StreamJoin join(fc1.device(), stream);
    // What stays is what recomputing the record needs, as after octet_saved_release_activations.
    nn::MLP::Saved kept = octet::capi::snapshots_only(saved->mlp);
    const octet::Tensor dxt =
        norm ? nn::norm_mlp_backward(*norm, m.activation, fc1, fc2, dyt, saved->norm, saved->mlp)
             : nn::mlp_backward(m.activation, fc1, fc2, dyt.view({-1, fc2.out_features()}),
                                saved->mlp)
                   .view(dyt.shape());
    saved->mlp = std::move(kept);
    saved->norm = nn::Norm::Saved{};
    *dx = octet::capi::export_tensor(dxt, stream);
  });
}

}  // extern "C"
