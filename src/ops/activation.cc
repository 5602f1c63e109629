// Dispatcher of the activation family: validates every argument (messages name what was expected
// and what was received), then runs the backend of the tensors' device through dispatch().
#include "octet/ops/activation.h"

#include "octet/ops/reduce.h"
#include "ops/activation_backend.h"
#include "ops/dispatch.h"
#include "ops/quantize_backend.h"

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

/// One activation pass into `out` (shaped `shape`; undefined is allowed with `fused`), which
/// `compute(y)` writes on either backend, plus the optional fused FP8 cast. On CUDA the cast is
/// the tile path, `quantized()`, which says whether it added the column sums (without a
/// transposed copy it cannot; then sum_rows reads the output, computed for that if need be).
/// Elsewhere it is ops::quantize on the finished output (a temporary when `out` is undefined).
template <typename Compute, typename Quantized>
void run_activation(const char* op, const Device& device, const Tensor& out, const Shape& shape,
                    const Tensor& like, const FusedQuantize* fused, Compute&& compute,
                    Quantized&& quantized) {
  const auto output = [&] {
    return out.defined() ? out : Tensor::empty(shape, like.dtype(), like.device());
  };
  if (fused != nullptr && device.is_cuda()) {
    bool sums_done = false;
    dispatch(
        device, op, [] {}, [&] { sums_done = quantized(); });
    if (fused->args.column_sums.defined() && !sums_done) {
      const Tensor y = output();
      if (!out.defined()) compute(y);
      sum_rows(y, fused->args.column_sums, fused->args.accumulate_column_sums);
    }
    return;
  }
  const Tensor y = output();
  compute(y);
  if (fused != nullptr) quantize(y, *fused->out, fused->args);
}

/// Validates a fused FP8 output for a [rows, cols] output of the op whose input is x.
void check_fused(const char* op, const FusedQuantize& fused, int64_t rows, int64_t cols,
                 const Tensor& x) {
  OCTET_CHECK(fused.out != nullptr, op,
              ": fused.out is null; expected the QuantizedTensor to write the FP8 output into");
  check_quantize_target(op, rows, cols, *fused.out, fused.args, x);
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
  OCTET_CHECK(y.defined() || fused != nullptr, op,
              ": y may be undefined only with a fused FP8 output, got neither");
  Shape y_shape = x.shape();
  if (y.defined()) {
    check_float_activation(y, op, "y");
    OCTET_CHECK(y.dtype() == x.dtype(), op, ": dtype mismatch: y must have the dtype of x (",
                x.describe(), "), got ", y.describe());
    check_input_shape(act, x, y, op, "x", "y");
    y_shape = y.shape();
  } else {
    OCTET_CHECK(act != Activation::swiglu || x.size(-1) % 2 == 0, op,
                ": swiglu needs an even number of input columns, got ", x.describe());
    y_shape.back() = act == Activation::swiglu ? x.size(-1) / 2 : x.size(-1);
  }
  const Device device = y.defined() ? common_device({&x, &y}, op) : x.device();
  if (fused != nullptr) check_fused(op, *fused, x.rows(), y_shape.back(), x);
  run_activation(
      op, device, y, y_shape, x, fused,
      [&](const Tensor& out) {
        dispatch(
            device, op, [&] { cpu::activation_forward(act, x, out); },
            [&] { OCTET_CUDA_ONLY(cuda::activation_forward(act, x, out)); });
      },
      [&] {
        bool sums_done = false;
        OCTET_CUDA_ONLY(
            sums_done = cuda::activation_forward_quantized(act, x, y, *fused->out, fused->args));
        return sums_done;
      });
}

void activation_backward(Activation act, const Tensor& dy, const Tensor& x, const Tensor& dx,
                         const FusedQuantize* fused) {
  constexpr const char* op = "activation_backward";
  check_float_activation(x, op, "x");
  OCTET_CHECK(dx.defined() || fused != nullptr, op,
              ": dx may be undefined only with a fused FP8 output, got neither");
  if (dx.defined()) check_like(dx, x, op, "dx", "x");
  check_float_activation(dy, op, "dy");
  OCTET_CHECK(dy.dtype() == x.dtype(), op, ": dtype mismatch: dy must have the dtype of x (",
              x.describe(), "), got ", dy.describe());
  check_input_shape(act, x, dy, op, "x", "dy");
  const Device device =
      dx.defined() ? common_device({&dy, &x, &dx}, op) : common_device({&dy, &x}, op);
  if (fused != nullptr) check_fused(op, *fused, x.rows(), x.cols(), x);
  run_activation(
      op, device, dx, x.shape(), x, fused,
      [&](const Tensor& out) {
        dispatch(
            device, op, [&] { cpu::activation_backward(act, dy, x, out); },
            [&] { OCTET_CUDA_ONLY(cuda::activation_backward(act, dy, x, out)); });
      },
      [&] {
        bool sums_done = false;
        OCTET_CUDA_ONLY(sums_done = cuda::activation_backward_quantized(act, dy, x, dx, *fused->out,
                                                                        fused->args));
        return sums_done;
      });
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
