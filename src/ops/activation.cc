// Dispatcher of the activation family: validates every argument (messages name what was expected
// and what was received), then runs the backend of the tensors' device through dispatch().
#include "octet/ops/activation.h"

#include "ops/activation_backend.h"
#include "ops/dispatch.h"

namespace octet::ops {
namespace {

/// Throws unless `in` (an activation's input, or its gradient) has the shape that goes with the
/// output-shaped `out`: the same, except for swiglu's doubled last dimension.
void check_input_shape(Activation act, const Tensor& in, const Tensor& out, const char* op,
                       const char* in_name, const char* out_name) {
  Shape expected = out.shape();
  OCTET_CHECK(!expected.empty(), op, ": ", out_name, " must have at least 1 dimension, got ",
              out.describe());
  expected.back() = activation_input_cols(act, expected.back());
  OCTET_CHECK(in.shape() == expected, op, ": shape mismatch: ", activation_name(act), " with ",
              out_name, " ", shape_str(out.shape()), " expects ", in_name, " ", shape_str(expected),
              ", got ", in.describe());
}

}  // namespace

const char* activation_name(Activation act) {
  switch (act) {
    case Activation::gelu:
      return "gelu";
    case Activation::swiglu:
      return "swiglu";
    case Activation::srelu:
      return "srelu";
  }
  OCTET_ERROR("unknown Activation value ", static_cast<int>(act));
}

int64_t activation_input_cols(Activation act, int64_t cols) {
  return act == Activation::swiglu ? 2 * cols : cols;
}

void activation_forward(Activation act, const Tensor& x, const Tensor& y,
                        const FusedQuantize* fused) {
  constexpr const char* op = "activation_forward";
  check_float_activation(x, op, "x");
  check_float_activation(y, op, "y");
  OCTET_CHECK(y.dtype() == x.dtype(), op, ": dtype mismatch: y must have the dtype of x (",
              x.describe(), "), got ", y.describe());
  check_input_shape(act, x, y, op, "x", "y");
  const Device device = common_device({&x, &y}, op);
  const FusedPlan plan(fused, y, device, op);
  dispatch(
      device, op, [&] { cpu::activation_forward(act, x, y); },
      [&] { OCTET_CUDA_ONLY(cuda::activation_forward(act, x, y, plan.kernel_cast())); });
  plan.finish(y);
}

void activation_backward(Activation act, const Tensor& dy, const Tensor& x, const Tensor& dx,
                         const FusedQuantize* fused) {
  constexpr const char* op = "activation_backward";
  check_float_activation(x, op, "x");
  check_like(dx, x, op, "dx", "x");
  check_float_activation(dy, op, "dy");
  OCTET_CHECK(dy.dtype() == x.dtype(), op, ": dtype mismatch: dy must have the dtype of x (",
              x.describe(), "), got ", dy.describe());
  check_input_shape(act, x, dy, op, "x", "dy");
  const Device device = common_device({&dy, &x, &dx}, op);
  const FusedPlan plan(fused, dx, device, op);
  dispatch(
      device, op, [&] { cpu::activation_backward(act, dy, x, dx); },
      [&] { OCTET_CUDA_ONLY(cuda::activation_backward(act, dy, x, dx, plan.kernel_cast())); });
  plan.finish(dx);
}

void add(const Tensor& a, const Tensor& b, const Tensor& out) {
  constexpr const char* op = "add";
  check_float_activation(a, op, "a");
  check_like(b, a, op, "b", "a");
  check_like(out, a, op, "out", "a");
  const Device device = common_device({&a, &b, &out}, op);
  dispatch(
      device, op, [&] { cpu::add(a, b, out); }, [&] { OCTET_CUDA_ONLY(cuda::add(a, b, out)); });
}

}  // namespace octet::ops
