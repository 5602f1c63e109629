// Dispatcher of the optimizer family: validates arguments, then runs the CPU or CUDA backend
// through dispatch() (device guard + NVTX range).
#include "octet/ops/optimizer.h"

#include <cmath>
#include <string>
#include <utility>

#include "ops/dispatch.h"
#include "ops/optimizer_backend.h"

namespace octet::ops {
namespace {

/// Throws unless `t` is a non-empty f32 tensor, naming `op` and `what`.
void check_f32(const Tensor& t, const char* op, const std::string& what) {
  OCTET_CHECK(t.defined(), op, ": ", what, " is an undefined tensor");
  OCTET_CHECK(t.dtype() == DType::f32, op, ": ", what, " must be f32, got ", t.describe());
  OCTET_CHECK(t.numel() > 0, op, ": ", what, " is an empty tensor (", t.describe(), ")");
}

void check_norm_sq(const Tensor& norm_sq, const char* op) {
  OCTET_CHECK(norm_sq.defined(), op, ": norm_sq is an undefined tensor");
  OCTET_CHECK(norm_sq.dtype() == DType::f32 && norm_sq.shape() == Shape{1}, op,
              ": norm_sq must be f32[1], got ", norm_sq.describe());
}

void check_finite(float value, const char* op, const char* name, const char* expected) {
  OCTET_CHECK(std::isfinite(value), op, ": ", name, " must be finite (", expected, "), got ",
              value);
}

void check_adamw_args(const AdamWArgs& a, const char* op) {
  check_finite(a.lr, op, "lr", ">= 0");
  OCTET_CHECK(a.lr >= 0.0f, op, ": lr must be >= 0, got ", a.lr);
  OCTET_CHECK(a.beta1 >= 0.0f && a.beta1 < 1.0f, op, ": beta1 must be in [0, 1), got ", a.beta1);
  OCTET_CHECK(a.beta2 >= 0.0f && a.beta2 < 1.0f, op, ": beta2 must be in [0, 1), got ", a.beta2);
  check_finite(a.eps, op, "eps", "> 0");
  OCTET_CHECK(a.eps > 0.0f, op, ": eps must be > 0, got ", a.eps);
  check_finite(a.weight_decay, op, "weight_decay", ">= 0");
  OCTET_CHECK(a.weight_decay >= 0.0f, op, ": weight_decay must be >= 0, got ", a.weight_decay);
  OCTET_CHECK(a.step >= 1, op, ": step is 1-based and must be >= 1, got ", a.step);
  check_finite(a.max_grad_norm, op, "max_grad_norm", "<= 0 disables clipping");
}

}  // namespace

void global_norm_squared(const Tensor* grads, int count, const Tensor& norm_sq) {
  constexpr const char* op = "global_norm_squared";
  OCTET_CHECK(count >= 1, op, ": expected at least one gradient tensor, got count ", count);
  OCTET_CHECK(grads != nullptr, op, ": grads is null but count is ", count);
  check_norm_sq(norm_sq, op);
  for (int i = 0; i < count; ++i) {
    const std::string what = "grads[" + std::to_string(i) + "]";
    check_f32(grads[i], op, what);
    OCTET_CHECK(grads[i].device() == norm_sq.device(), op,
                ": all tensors must be on one device, got norm_sq ", norm_sq.describe(), " and ",
                what, " ", grads[i].describe());
  }

  dispatch(
      norm_sq.device(), op, [&] { cpu::global_norm_squared(grads, count, norm_sq); },
      [&] { OCTET_CUDA_ONLY(cuda::global_norm_squared(grads, count, norm_sq)); });
}

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                const Tensor& norm_sq, const AdamWArgs& args) {
  constexpr const char* op = "adamw_step";
  check_f32(param, op, "param");
  check_f32(grad, op, "grad");
  check_f32(m, op, "m");
  check_f32(v, op, "v");
  const std::pair<const Tensor*, const char*> same_shape[] = {
      {&grad, "grad"}, {&m, "m"}, {&v, "v"}};
  for (const auto& [t, name] : same_shape)
    OCTET_CHECK(t->shape() == param.shape(), op, ": ", name, " must have param's shape ",
                shape_str(param.shape()), ", got ", t->describe());
  check_norm_sq(norm_sq, op);
  const Device device = common_device({&param, &grad, &m, &v, &norm_sq}, op);
  check_adamw_args(args, op);
  const AdamWCoefficients coefficients = adamw_coefficients(args);

  dispatch(
      device, op, [&] { cpu::adamw_step(param, grad, m, v, norm_sq, coefficients); },
      [&] { OCTET_CUDA_ONLY(cuda::adamw_step(param, grad, m, v, norm_sq, coefficients)); });
}

}  // namespace octet::ops
