// octet::ops::gemm: argument checks, then dispatch by device (src/ops/gemm_backend.h).
#include "octet/ops/gemm.h"

#include <string>

#include "ops/dispatch.h"
#include "ops/gemm_backend.h"

#if OCTET_WITH_CUDA
#include "ops/cuda/cublaslt.h"
#endif

namespace octet::ops {

GemmOperand GemmOperand::dense(const Tensor& data, bool transpose) {
  GemmOperand op;
  op.data = data;
  op.transpose = transpose;
  return op;
}

GemmOperand GemmOperand::fp8(const fp8::QuantizedTensor& q, bool use_transposed_copy,
                             bool transpose) {
  OCTET_CHECK(use_transposed_copy ? q.has_columnwise() : q.has_rowwise(),
              "GemmOperand::fp8: expected a QuantizedTensor with its ",
              use_transposed_copy ? "transposed (columnwise)" : "row-wise",
              " copy, got one without it");
  GemmOperand op;
  op.data = use_transposed_copy ? q.data_t : q.data;
  op.scale_inv = use_transposed_copy ? q.scale_inv_t : q.scale_inv;
  op.mode = q.mode;
  op.transpose = transpose;
  return op;
}

namespace {

/// Hopper's FP8 tensor-core GEMMs (cuBLASLt) need every dimension to be a multiple of 16; octet
/// enforces it on every backend so code tested on the CPU also runs on the GPU.
constexpr int64_t kFp8DimMultiple = 16;

/// [rows, cols] of op(X) for the 2-D matrix view of X.
struct MatrixDims {
  int64_t rows = 0, cols = 0;
};

MatrixDims op_dims(const GemmOperand& x) {
  const int64_t r = x.data.rows(), c = x.data.cols();
  return x.transpose ? MatrixDims{c, r} : MatrixDims{r, c};
}

std::string describe_operand(const char* name, const GemmOperand& x) {
  const MatrixDims d = op_dims(x);
  return detail::concat(name, " = ", x.data.describe(), x.transpose ? " transposed" : "", " (op(",
                        name, ") is [", d.rows, ", ", d.cols, "])");
}

bool is_dense_gemm_dtype(DType d) { return d == DType::f32 || d == DType::bf16; }

void check_operand_defined(const GemmOperand& x, const char* name) {
  OCTET_CHECK(x.data.defined(), "gemm: operand ", name, " has no data (undefined tensor)");
  OCTET_CHECK(x.data.ndim() >= 1, "gemm: operand ", name, " must have at least 1 dimension, got ",
              x.data.describe());
  OCTET_CHECK(x.data.numel() > 0, "gemm: operand ", name, " is empty: ", x.data.describe(),
              "; expected a non-empty matrix");
}

void check_dtypes(const GemmOperand& a, const GemmOperand& b) {
  const DType da = a.data.dtype(), db = b.data.dtype();
  const bool dense = is_dense_gemm_dtype(da) && is_dense_gemm_dtype(db);
  const bool fp8 = is_fp8(da) && is_fp8(db);
  OCTET_CHECK(dense || fp8, "gemm: unsupported dtypes A ", dtype_name(da), " x B ", dtype_name(db),
              "; expected f32 x f32, bf16 x bf16, or FP8 (e4m3 x e4m3, e4m3 x e5m2, e5m2 x e4m3)");
  OCTET_CHECK(!dense || da == db, "gemm: dense operands must share a dtype, got A ", dtype_name(da),
              " x B ", dtype_name(db), "; expected f32 x f32 or bf16 x bf16");
  OCTET_CHECK(!(da == DType::e5m2 && db == DType::e5m2),
              "gemm: unsupported dtypes A e5m2 x B e5m2 (cuBLASLt has no E5M2 x E5M2 GEMM); "
              "expected e4m3 x e4m3, e4m3 x e5m2 or e5m2 x e4m3");
}

bool compatible_modes(fp8::ScalingMode a, fp8::ScalingMode b) {
  using M = fp8::ScalingMode;
  switch (a) {
    case M::per_tensor:
      return b == M::per_tensor;
    case M::block_1x128:
      return b == M::block_1x128 || b == M::block_128x128;
    case M::block_128x128:
      return false;  // cuBLASLt scales only B with 128x128 tiles
    case M::mxfp8_1x32:
      return b == M::mxfp8_1x32;
  }
  return false;
}

void check_fp8_scales(const GemmOperand& x, const char* name) {
  OCTET_CHECK(x.scale_inv.defined(), "gemm: FP8 operand ", name, " (", x.data.describe(),
              ") needs scale_inv (", fp8::scaling_mode_name(x.mode), "), got none");
  const Shape expected = fp8::scale_shape(x.mode, x.data.rows(), x.data.cols());
  const DType expected_dtype = fp8::scale_dtype(x.mode);
  OCTET_CHECK(x.scale_inv.shape() == expected && x.scale_inv.dtype() == expected_dtype,
              "gemm: scale_inv of ", name, " under ", fp8::scaling_mode_name(x.mode), " for data ",
              x.data.describe(), ": expected ", dtype_name(expected_dtype), shape_str(expected),
              ", got ", x.scale_inv.describe());
}

void check_fp8_rules(const GemmOperand& a, const GemmOperand& b, const GemmShape& s) {
  OCTET_CHECK(!a.transpose && b.transpose,
              "gemm: FP8 GEMMs need the TN layout (A not transposed, B transposed, both "
              "K-contiguous), got A ",
              a.transpose ? "transposed" : "not transposed", " and B ",
              b.transpose ? "transposed" : "not transposed",
              "; use the QuantizedTensor's other copy (data_t) instead of transposing");
  OCTET_CHECK(
      s.m % kFp8DimMultiple == 0 && s.n % kFp8DimMultiple == 0 && s.k % kFp8DimMultiple == 0,
      "gemm: FP8 GEMMs need M, N and K each a multiple of 16, got M=", s.m, ", N=", s.n,
      ", K=", s.k);
  OCTET_CHECK(compatible_modes(a.mode, b.mode), "gemm: unsupported FP8 scaling modes A ",
              fp8::scaling_mode_name(a.mode), " x B ", fp8::scaling_mode_name(b.mode),
              "; expected per_tensor x per_tensor, block_1x128 x block_1x128, block_1x128 x "
              "block_128x128, or mxfp8_1x32 x mxfp8_1x32");
  check_fp8_scales(a, "A");
  check_fp8_scales(b, "B");
}

void check_dense_has_no_scales(const GemmOperand& x, const char* name) {
  OCTET_CHECK(!x.scale_inv.defined(), "gemm: dense operand ", name, " (", x.data.describe(),
              ") must not carry scale_inv, got ", x.scale_inv.describe());
}

/// The addend is a second [M, N] input of D's dtype; the epilogue reads it element by element
/// while D is written, so the two must be disjoint.
void check_addend(const GemmArgs& args, const Tensor& d, const GemmShape& shape) {
  const Tensor& c = args.addend;
  OCTET_CHECK(args.beta == 0.0f, "gemm: an addend and beta = ", args.beta,
              " are exclusive (beta adds D's own contents, the addend another matrix); expected "
              "beta = 0 with an addend, or no addend");
  OCTET_CHECK(c.ndim() >= 1 && c.rows() == shape.m && c.cols() == shape.n,
              "gemm: addend shape: expected [", shape.m, ", ", shape.n, "] (D's M x N), got ",
              c.describe());
  OCTET_CHECK(c.dtype() == d.dtype(), "gemm: addend dtype: expected D's dtype ",
              dtype_name(d.dtype()), ", got ", c.describe());
  const auto* c0 = static_cast<const char*>(c.raw_data());
  const auto* d0 = static_cast<const char*>(d.raw_data());
  OCTET_CHECK(c0 + c.nbytes() <= d0 || d0 + d.nbytes() <= c0,
              "gemm: the addend must not share memory with D, got addend ", c.describe(), " and D ",
              d.describe(), "; to add D's own contents use beta = 1 instead");
}

}  // namespace

GemmShape check_gemm_args(const GemmOperand& a, const GemmOperand& b, const Tensor& d,
                          const GemmArgs& args) {
  check_operand_defined(a, "A");
  check_operand_defined(b, "B");
  OCTET_CHECK(d.defined(), "gemm: output D is an undefined tensor");
  OCTET_CHECK(d.ndim() >= 1 && d.numel() > 0, "gemm: output D is empty: ", d.describe(),
              "; expected a non-empty matrix");
  check_dtypes(a, b);

  const MatrixDims oa = op_dims(a), ob = op_dims(b);
  OCTET_CHECK(oa.cols == ob.rows, "gemm: inner dimensions differ: ", describe_operand("A", a), ", ",
              describe_operand("B", b), "; expected op(A) [M, K] and op(B) [K, N]");
  const GemmShape shape{oa.rows, ob.cols, oa.cols};
  OCTET_CHECK(d.rows() == shape.m && d.cols() == shape.n, "gemm: D shape: expected [", shape.m,
              ", ", shape.n, "] (M x N of ", describe_operand("A", a), " and ",
              describe_operand("B", b), "), got ", d.describe());
  OCTET_CHECK(is_dense_gemm_dtype(d.dtype()), "gemm: unsupported D dtype ", dtype_name(d.dtype()),
              "; expected f32 or bf16");
  if (args.bias.defined()) {
    OCTET_CHECK(args.bias.shape() == Shape{shape.n}, "gemm: bias shape: expected [", shape.n,
                "] (N), got ", args.bias.describe());
    OCTET_CHECK(is_dense_gemm_dtype(args.bias.dtype()), "gemm: unsupported bias dtype ",
                dtype_name(args.bias.dtype()), "; expected f32 or bf16");
  }

  if (args.addend.defined()) check_addend(args, d, shape);

  if (is_fp8(a.data.dtype())) {
    check_fp8_rules(a, b, shape);
  } else {
    check_dense_has_no_scales(a, "A");
    check_dense_has_no_scales(b, "B");
  }
  return shape;
}

void gemm(const GemmOperand& a, const GemmOperand& b, const Tensor& d, const GemmArgs& args) {
  const GemmShape shape = check_gemm_args(a, b, d, args);
  const Tensor* a_scale = a.scale_inv.defined() ? &a.scale_inv : nullptr;
  const Tensor* b_scale = b.scale_inv.defined() ? &b.scale_inv : nullptr;
  const Tensor* bias = args.bias.defined() ? &args.bias : nullptr;
  const Tensor* addend = args.addend.defined() ? &args.addend : nullptr;
  const Device device =
      common_device({&a.data, a_scale, &b.data, b_scale, &d, bias, addend}, "gemm");

  const std::string label =
      op_label("gemm", dtype_name(a.data.dtype()), "x", dtype_name(b.data.dtype()), "->",
               dtype_name(d.dtype()), " ", shape.m, "x", shape.n, "x", shape.k,
               addend != nullptr ? " +addend" : "");
  dispatch(
      device, label.c_str(), [&] { cpu::gemm(a, b, d, args, shape); },
      [&] { OCTET_CUDA_ONLY(cuda::gemm(a, b, d, args, shape)); });
}

uint64_t gemm_plans_made() {
#if OCTET_WITH_CUDA
  return cuda::gemm_heuristic_queries();
#else
  return 0;
#endif
}

double gemm_planning_seconds() {
#if OCTET_WITH_CUDA
  return cuda::gemm_heuristic_seconds();
#else
  return 0;
#endif
}

size_t gemm_workspace_bytes(const Device& device) {
#if OCTET_WITH_CUDA
  return device.is_cuda() ? cuda::cublaslt_device_bytes(device) : 0;
#else
  (void)device;
  return 0;
#endif
}

}  // namespace octet::ops
