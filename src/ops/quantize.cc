// Dispatcher of the quantize family: validates every argument (messages name what was expected
// and what was received), then runs the backend of the tensors' device through dispatch() (device
// guard + NVTX range). Backends (quantize_backend.h) may assume what is checked here.
#include "octet/ops/quantize.h"

#include <cstdio>

#include "ops/dispatch.h"
#include "ops/quantize_backend.h"

namespace octet::ops {
namespace {

using fp8::QuantizedTensor;
using fp8::ScalingMode;

/// The tensor if defined, else nullptr (common_device skips nullptr).
const Tensor* if_defined(const Tensor& t) { return t.defined() ? &t : nullptr; }

void check_high_precision(const Tensor& t, const char* op, const char* name) {
  OCTET_CHECK(t.defined(), op, ": ", name, " is an undefined tensor; expected f32 or bf16");
  OCTET_CHECK(is_high_precision(t.dtype()), op, ": unsupported dtype ", dtype_name(t.dtype()),
              " for ", name, "; expected f32 or bf16, received ", t.describe());
}

void check_non_empty(const Tensor& t, const char* op, const char* name) {
  OCTET_CHECK(t.numel() > 0, op, ": empty tensor ", name, "; expected at least one element, ",
              "received ", t.describe());
}

/// Checks that `t` is allocated with exactly `shape` and `dtype`.
void check_buffer(const Tensor& t, const char* op, const char* name, const Shape& shape,
                  DType dtype) {
  OCTET_CHECK(t.defined(), op, ": ", name, " is not allocated; expected ", dtype_name(dtype),
              shape_str(shape));
  OCTET_CHECK(t.shape() == shape, op, ": shape mismatch: ", name, " expected ", dtype_name(dtype),
              shape_str(shape), ", received ", t.describe());
  OCTET_CHECK(t.dtype() == dtype, op, ": dtype mismatch: ", name, " expected ", dtype_name(dtype),
              shape_str(shape), ", received ", t.describe());
}

/// An f32 tensor with at least `min_numel` elements (args.scale, args.amax, amax_out).
void check_f32_scalar(const Tensor& t, const char* op, const char* name, int64_t min_numel) {
  OCTET_CHECK(t.dtype() == DType::f32, op, ": dtype mismatch: ", name, " expected f32, received ",
              t.describe());
  OCTET_CHECK(t.numel() >= min_numel, op, ": shape mismatch: ", name, " expected at least ",
              min_numel, " element(s), received ", t.describe());
}

/// Checks the copies of `q` that are allocated: FP8 dtype, data and scale shapes and dtypes.
void check_quantized(const QuantizedTensor& q, const char* op) {
  OCTET_CHECK(is_fp8(q.dtype), op, ": unsupported dtype ", dtype_name(q.dtype),
              " for the quantized tensor; expected e4m3 or e5m2");
  OCTET_CHECK(q.rows > 0 && q.cols > 0, op, ": empty tensor: quantized tensor is [", q.rows, ", ",
              q.cols, "]; expected at least one element");
  OCTET_CHECK(
      q.has_rowwise() || q.has_columnwise(), op,
      ": the quantized tensor has neither data nor data_t allocated; expected at least one");
  const DType sdt = fp8::scale_dtype(q.mode);
  if (q.has_rowwise()) {
    check_buffer(q.data, op, "data", {q.rows, q.cols}, q.dtype);
    check_buffer(q.scale_inv, op, "scale_inv", fp8::scale_shape(q.mode, q.rows, q.cols), sdt);
  }
  if (q.has_columnwise()) {
    check_buffer(q.data_t, op, "data_t", {q.cols, q.rows}, q.dtype);
    check_buffer(q.scale_inv_t, op, "scale_inv_t", fp8::scale_shape(q.mode, q.cols, q.rows), sdt);
  }
}

}  // namespace

Device check_quantize_target(const char* op, int64_t rows, int64_t cols, const QuantizedTensor& out,
                             const QuantizeArgs& args, const Tensor& source) {
  OCTET_CHECK(out.rows == rows && out.cols == cols, op, ": shape mismatch: the fused FP8 output ",
              "is allocated for a [", out.rows, ", ", out.cols, "] matrix, expected [", rows, ", ",
              cols, "]");
  check_quantized(out, op);
  if (out.mode == ScalingMode::per_tensor) {
    OCTET_CHECK(args.scale.defined(), op, ": per_tensor scaling needs args.scale (f32[1]), ",
                "received an undefined tensor");
    check_f32_scalar(args.scale, op, "args.scale", 1);
    OCTET_CHECK(args.scale.numel() == 1, op, ": shape mismatch: args.scale expected f32[1], ",
                "received ", args.scale.describe());
  }
  if (args.amax.defined()) check_f32_scalar(args.amax, op, "args.amax", 1);
  if (args.column_sums.defined()) {
    check_buffer(args.column_sums, op, "args.column_sums", {cols}, DType::f32);
  }
  return common_device({&source, if_defined(out.data), if_defined(out.scale_inv),
                        if_defined(out.data_t), if_defined(out.scale_inv_t), if_defined(args.scale),
                        if_defined(args.amax), if_defined(args.column_sums)},
                       op);
}

void amax(const Tensor& x, const Tensor& amax_out) {
  check_high_precision(x, "amax", "x");
  check_non_empty(x, "amax", "x");
  OCTET_CHECK(amax_out.defined(), "amax: amax_out is an undefined tensor; expected f32[>=1]");
  check_f32_scalar(amax_out, "amax", "amax_out", 1);
  const Device device = common_device({&x, &amax_out}, "amax");
  dispatch(
      device, "amax", [&] { cpu::amax(x, amax_out); },
      [&] { OCTET_CUDA_ONLY(cuda::amax(x, amax_out)); });
}

void quantize(const Tensor& x, QuantizedTensor& out, const QuantizeArgs& args) {
  check_high_precision(x, "quantize", "x");
  check_non_empty(x, "quantize", "x");
  const int64_t rows = x.rows(), cols = x.cols();
  OCTET_CHECK(out.rows == rows && out.cols == cols, "quantize: shape mismatch: out is allocated ",
              "for a [", out.rows, ", ", out.cols, "] matrix, but x is ", x.describe(), " ([", rows,
              ", ", cols, "] as a matrix)");
  const Device device = check_quantize_target("quantize", rows, cols, out, args, x);
  const std::string label = op_label("quantize", dtype_name(x.dtype()), "->", dtype_name(out.dtype),
                                     " ", fp8::scaling_mode_name(out.mode), " ", rows, "x", cols,
                                     out.has_rowwise() && out.has_columnwise() ? " both" : "",
                                     args.column_sums.defined() ? " +sums" : "");
  dispatch(
      device, label.c_str(), [&] { cpu::quantize(x, out, args); },
      [&] { OCTET_CUDA_ONLY(cuda::quantize(x, out, args)); });
}

void quantize_groups(const Tensor& x, std::span<const int64_t> offsets,
                     std::span<const FusedQuantize> targets) {
  constexpr const char* op = "quantize_groups";
  check_high_precision(x, op, "x");
  OCTET_CHECK(x.ndim() >= 2 && x.cols() > 0, op, ": x must be a matrix with columns, got ",
              x.describe());
  OCTET_CHECK(!offsets.empty() && targets.size() + 1 == offsets.size(), op, ": expected ",
              targets.size() + 1, " group offsets for ", targets.size(), " targets, got ",
              offsets.size());
  OCTET_CHECK(offsets.front() == 0, op, ": group offsets must start at 0, got ", offsets.front());
  const int64_t rows = x.rows(), cols = x.cols();
  OCTET_CHECK(offsets.back() <= rows, op, ": the group offsets end at row ", offsets.back(),
              " but x has ", rows, " rows (", x.describe(), ")");
  bool any = false;
  for (size_t g = 0; g < targets.size(); ++g) {
    const int64_t group_rows = offsets[g + 1] - offsets[g];
    OCTET_CHECK(group_rows >= 0, op, ": group offsets must not decrease, got ", offsets[g + 1],
                " after ", offsets[g], " (group ", g, ")");
    if (group_rows == 0 || targets[g].out == nullptr) continue;
    // The group in the messages, without a heap string per group on this per-layer host path.
    char name[48];
    std::snprintf(name, sizeof(name), "%s (group %zu)", op, g);
    check_quantize_target(name, group_rows, cols, *targets[g].out, targets[g].args, x);
    any = true;
  }
  if (!any) return;  // every group empty: nothing to write
  const Device device = x.device();
  const std::string label = op_label(op, dtype_name(x.dtype()), " ", targets.size(), " groups ",
                                     offsets.back(), "x", cols);
  dispatch(
      device, label.c_str(), [&] { cpu::quantize_groups(x, offsets, targets); },
      [&] { OCTET_CUDA_ONLY(cuda::quantize_groups(x, offsets, targets)); });
}

void dequantize(const QuantizedTensor& q, const Tensor& out, bool transposed) {
  check_quantized(q, "dequantize");
  OCTET_CHECK(transposed ? q.has_columnwise() : q.has_rowwise(), "dequantize: ",
              transposed ? "transposed=true needs data_t" : "transposed=false needs data",
              ", but the quantized tensor has only ", transposed ? "data" : "data_t");
  check_high_precision(out, "dequantize", "out");
  const int64_t rows = transposed ? q.cols : q.rows, cols = transposed ? q.rows : q.cols;
  OCTET_CHECK(out.ndim() >= 1 && out.rows() == rows && out.cols() == cols,
              "dequantize: shape mismatch: out expected [", rows, ", ", cols, "] as a matrix",
              transposed ? " (transposed)" : "", ", received ", out.describe());
  const Tensor& data = transposed ? q.data_t : q.data;
  const Tensor& scale_inv = transposed ? q.scale_inv_t : q.scale_inv;
  const Device device = common_device({&data, &scale_inv, &out}, "dequantize");
  dispatch(
      device, "dequantize", [&] { cpu::dequantize(q, out, transposed); },
      [&] { OCTET_CUDA_ONLY(cuda::dequantize(q, out, transposed)); });
}

void cast(const Tensor& x, const Tensor& out) {
  check_high_precision(x, "cast", "x");
  check_high_precision(out, "cast", "out");
  OCTET_CHECK(x.shape() == out.shape(), "cast: shape mismatch: out expected shape ",
              shape_str(x.shape()), " (as x), received ", out.describe());
  const Device device = common_device({&x, &out}, "cast");
  if (x.numel() == 0) return;  // nothing to convert
  dispatch(
      device, "cast", [&] { cpu::cast(x, out); }, [&] { OCTET_CUDA_ONLY(cuda::cast(x, out)); });
}

void count_fp8_codes(const Tensor& x, const Tensor& codes, const Tensor& counts) {
  constexpr const char* op = "count_fp8_codes";
  check_high_precision(x, op, "x");
  check_non_empty(x, op, "x");
  OCTET_CHECK(codes.defined() && is_fp8(codes.dtype()), op, ": codes must be e4m3 or e5m2, got ",
              codes.defined() ? codes.describe() : "none");
  OCTET_CHECK(codes.numel() == x.numel(), op, ": codes hold ", codes.numel(),
              " elements but x has ", x.numel(), " (", x.describe(), " vs ", codes.describe(), ")");
  OCTET_CHECK(counts.defined() && counts.dtype() == DType::i64 && counts.numel() == 3, op,
              ": counts must be i64[3], got ", counts.defined() ? counts.describe() : "none");
  const Device device = common_device({&x, &codes, &counts}, op);
  dispatch(
      device, op, [&] { cpu::count_fp8_codes(x, codes, counts); },
      [&] { OCTET_CUDA_ONLY(cuda::count_fp8_codes(x, codes, counts)); });
}

}  // namespace octet::ops
