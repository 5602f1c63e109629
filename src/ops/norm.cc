// Dispatcher of the norm family: validates every argument (messages name what was expected and
// what was received), then runs the backend of the tensors' device through dispatch(). Also the
// fused FP8 cast plan that norms and activations share (norm_backend.h).
#include "octet/ops/norm.h"

#include <cmath>
#include <utility>

#include "octet/ops/reduce.h"
#include "ops/dispatch.h"
#include "ops/norm_backend.h"
#include "ops/quantize_backend.h"

namespace octet::ops {
namespace {

using fp8::QuantizedTensor;
using fp8::ScalingMode;

/// Throws unless `t` is a defined f32 tensor of exactly `shape`.
void check_f32(const Tensor& t, const char* op, const char* name, const Shape& shape) {
  OCTET_CHECK(t.defined(), op, ": ", name, " is an undefined tensor; expected f32",
              shape_str(shape));
  OCTET_CHECK(t.dtype() == DType::f32, op, ": unsupported dtype for ", name, ": expected f32",
              shape_str(shape), ", got ", t.describe());
  OCTET_CHECK(t.shape() == shape, op, ": shape mismatch: ", name, " expected f32", shape_str(shape),
              ", got ", t.describe());
}

/// x and y of a norm forward (same dtype and shape; y may be undefined when a fused FP8 output
/// is given), gamma (and beta) f32 [cols], eps.
void check_forward(const char* op, const Tensor& x, const Tensor& gamma, const Tensor* beta,
                   float eps, const Tensor& y, const FusedQuantize* fused) {
  check_float_activation(x, op, "x");
  OCTET_CHECK(y.defined() || fused != nullptr, op,
              ": y is an undefined tensor; expected y like x (", x.describe(),
              "), or a fused FP8 output when only that is wanted");
  if (y.defined()) check_like(y, x, op, "y", "x");
  check_f32(gamma, op, "gamma", {x.cols()});
  if (beta != nullptr) check_f32(*beta, op, "beta", {x.cols()});
  OCTET_CHECK(std::isfinite(eps) && eps >= 0.0f, op, ": eps must be finite and >= 0, got ", eps);
}

/// dy, x, dx of a norm backward (same dtype and shape), gamma and dgamma (and dbeta) f32 [cols].
void check_backward(const char* op, const Tensor& dy, const Tensor& x, const Tensor& gamma,
                    const Tensor& dx, const Tensor& dgamma, const Tensor* dbeta) {
  check_float_activation(x, op, "x");
  check_like(dy, x, op, "dy", "x");
  check_like(dx, x, op, "dx", "x");
  check_f32(gamma, op, "gamma", {x.cols()});
  check_f32(dgamma, op, "dgamma", {x.cols()});
  if (dbeta != nullptr) check_f32(*dbeta, op, "dbeta", {x.cols()});
}

/// The norm forwards' shared run: y, or a stream-ordered scratch like x when only the fused FP8
/// output is wanted (the CUDA kernel may then leave it unwritten); the fused plan; the backend;
/// then whatever the plan's kernel cast left to do. cuda_run(out, cast) returns whether the kernel
/// wrote the cast's transposed copy.
template <typename CpuRun, typename CudaRun>
void run_forward(const char* op, const Device& device, const Tensor& x, const Tensor& y,
                 const FusedQuantize* fused, CpuRun cpu_run, CudaRun cuda_run) {
  const Tensor out = y.defined() ? y : Tensor::empty(x.shape(), x.dtype(), x.device());
  const FusedPlan plan(fused, out, device, op, /*y_wanted=*/y.defined());
  bool transposed_written = false;
  dispatch(
      device, op, [&] { cpu_run(out); },
      [&] { transposed_written = cuda_run(out, plan.kernel_cast()); });
  plan.finish(out, transposed_written);
}

}  // namespace

// ----------------------------------------------------------------------------
// Shared dispatcher pieces (norm_backend.h)

void check_like(const Tensor& t, const Tensor& like, const char* op, const char* name,
                const char* like_name) {
  check_float_activation(t, op, name);
  OCTET_CHECK(t.dtype() == like.dtype(), op, ": dtype mismatch: ", name, " must have the dtype of ",
              like_name, " (", like.describe(), "), got ", t.describe());
  OCTET_CHECK(t.shape() == like.shape(), op, ": shape mismatch: ", name, " expected shape ",
              shape_str(like.shape()), " (as ", like_name, "), got ", t.describe());
}

FusedPlan::FusedPlan(const FusedQuantize* fused, const Tensor& y, const Device& device,
                     const char* op, bool y_wanted)
    : fused_(fused) {
  if (fused == nullptr) return;
  OCTET_CHECK(fused->out != nullptr, op,
              ": fused.out is null; expected the QuantizedTensor to write the FP8 output into");
  const QuantizedTensor& q = *fused->out;
  const QuantizeArgs& args = fused->args;
  const std::pair<const Tensor*, const char*> parts[] = {{&q.data, "data"},
                                                         {&q.scale_inv, "scale_inv"},
                                                         {&q.data_t, "data_t"},
                                                         {&q.scale_inv_t, "scale_inv_t"},
                                                         {&args.scale, "args.scale"},
                                                         {&args.amax, "args.amax"},
                                                         {&args.column_sums, "args.column_sums"}};
  for (const auto& [t, name] : parts) {
    OCTET_CHECK(!t->defined() || t->device() == device, op, ": the fused FP8 output's ", name,
                " is on ", t->device(), ", expected ", device, " (the op's tensors' device)");
  }
  check_quantize_target(op, y.rows(), y.cols(), q, args, y);
  // The kernel casts the per-tensor copies (the transposed one where it can, FusedCast); the rest
  // is quantize in finish().
  if (!device.is_cuda() || q.mode != ScalingMode::per_tensor || !q.has_rowwise()) return;

  kernel_cast_.data = static_cast<uint8_t*>(q.data.raw_data());
  kernel_cast_.scale_inv = q.scale_inv.data<float>();
  if (q.has_columnwise()) {
    kernel_cast_.data_t = static_cast<uint8_t*>(q.data_t.raw_data());
    if (q.scale_inv_t.raw_data() != q.scale_inv.raw_data())
      kernel_cast_.scale_inv_t = q.scale_inv_t.data<float>();
  }
  kernel_cast_.scale = args.scale.data<float>();
  kernel_cast_.amax = args.amax.defined() ? args.amax.data<float>() : nullptr;
  kernel_cast_.dtype = q.dtype;
  // Column sums are taken from y after the kernel, so they need it written.
  kernel_cast_.y_wanted = y_wanted || args.column_sums.defined();
}

void FusedPlan::finish(const Tensor& y, bool transposed_written) const {
  if (fused_ == nullptr) return;
  if (!kernel_cast_.enabled()) {
    quantize(y, *fused_->out, fused_->args);
    return;
  }
  if (fused_->out->has_columnwise() && !transposed_written) {
    // The kernel wrote the row-wise copy; the transposed copy needs all of y, so the quantize op
    // writes it (sharing the per-tensor scale) and then records the amax and column sums.
    QuantizedTensor columnwise = *fused_->out;
    columnwise.data = Tensor();
    columnwise.scale_inv = Tensor();
    quantize(y, columnwise, fused_->args);
  } else if (fused_->args.column_sums.defined()) {
    sum_rows(y, fused_->args.column_sums, fused_->args.accumulate_column_sums);
  }
}

// ----------------------------------------------------------------------------
// Entry points

void layernorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps,
                       const Tensor& y, const Tensor& mean, const Tensor& rstd,
                       const FusedQuantize* fused) {
  constexpr const char* op = "layernorm_forward";
  check_forward(op, x, gamma, &beta, eps, y, fused);
  check_f32(mean, op, "mean", {x.rows()});
  check_f32(rstd, op, "rstd", {x.rows()});
  const Device device =
      common_device({&x, &gamma, &beta, y.defined() ? &y : nullptr, &mean, &rstd}, op);
  run_forward(
      op, device, x, y, fused,
      [&](const Tensor& out) { cpu::layernorm_forward(x, gamma, beta, eps, out, mean, rstd); },
      [&](const Tensor& out, const FusedCast& cast) {
        bool transposed = false;
        OCTET_CUDA_ONLY(transposed =
                            cuda::layernorm_forward(x, gamma, beta, eps, out, mean, rstd, cast));
        return transposed;
      });
}

void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                        const Tensor& rstd, const Tensor& dx, const Tensor& dgamma,
                        const Tensor& dbeta, const Tensor& residual, bool accumulate_params) {
  constexpr const char* op = "layernorm_backward";
  check_backward(op, dy, x, gamma, dx, dgamma, &dbeta);
  check_f32(mean, op, "mean", {x.rows()});
  check_f32(rstd, op, "rstd", {x.rows()});
  if (residual.defined()) check_like(residual, x, op, "residual", "x");
  const Device device = common_device({&dy, &x, &gamma, &mean, &rstd, &dx, &dgamma, &dbeta,
                                       residual.defined() ? &residual : nullptr},
                                      op);
  dispatch(
      device, op,
      [&] {
        cpu::layernorm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta, residual,
                                accumulate_params);
      },
      [&] {
        OCTET_CUDA_ONLY(cuda::layernorm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta,
                                                 residual, accumulate_params));
      });
}

void rmsnorm_forward(const Tensor& x, const Tensor& gamma, float eps, const Tensor& y,
                     const Tensor& rstd, const FusedQuantize* fused) {
  constexpr const char* op = "rmsnorm_forward";
  check_forward(op, x, gamma, nullptr, eps, y, fused);
  check_f32(rstd, op, "rstd", {x.rows()});
  const Device device = common_device({&x, &gamma, y.defined() ? &y : nullptr, &rstd}, op);
  run_forward(
      op, device, x, y, fused,
      [&](const Tensor& out) { cpu::rmsnorm_forward(x, gamma, eps, out, rstd); },
      [&](const Tensor& out, const FusedCast& cast) {
        bool transposed = false;
        OCTET_CUDA_ONLY(transposed = cuda::rmsnorm_forward(x, gamma, eps, out, rstd, cast));
        return transposed;
      });
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                      const Tensor& dx, const Tensor& dgamma, const Tensor& residual,
                      bool accumulate_params) {
  constexpr const char* op = "rmsnorm_backward";
  check_backward(op, dy, x, gamma, dx, dgamma, nullptr);
  check_f32(rstd, op, "rstd", {x.rows()});
  if (residual.defined()) check_like(residual, x, op, "residual", "x");
  const Device device = common_device(
      {&dy, &x, &gamma, &rstd, &dx, &dgamma, residual.defined() ? &residual : nullptr}, op);
  dispatch(
      device, op,
      [&] { cpu::rmsnorm_backward(dy, x, gamma, rstd, dx, dgamma, residual, accumulate_params); },
      [&] {
        OCTET_CUDA_ONLY(
            cuda::rmsnorm_backward(dy, x, gamma, rstd, dx, dgamma, residual, accumulate_params));
      });
}

}  // namespace octet::ops
