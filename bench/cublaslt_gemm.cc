#include "cublaslt_gemm.h"

#if OCTET_WITH_CUDA

#include "bench_util.h"
#include "core/int_math.h"

namespace octet::bench {
namespace {

/// cuBLAS's recommended workspace for Hopper (cuBLAS docs, cublasSetWorkspace: 32 MiB on sm_90).
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
/// Padding of scale buffers: block counts to 4 (16-byte rows of f32 scales), MXFP8 rows to 128
/// (cuBLAS's 128x4 scale tiles). Over-allocation is harmless; too little would be read past.
constexpr int64_t kPadBlocks = 4;
constexpr int64_t kMxPadRows = 128;

cublasLtHandle_t handle() {
  static const cublasLtHandle_t handle = [] {
    DeviceGuard guard(device());
    cublasLtHandle_t h = nullptr;
    OCTET_BENCH_CHECK_CUBLAS(cublasLtCreate(&h));
    return h;
  }();
  return handle;
}

void* workspace() {
  // Never destroyed, like the handle (see random_tensor).
  static const Tensor* workspace =
      new Tensor(Tensor::empty({static_cast<int64_t>(kWorkspaceBytes)}, DType::u8, device()));
  return workspace->raw_data();
}

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::e4m3:
      return CUDA_R_8F_E4M3;
    case DType::e5m2:
      return CUDA_R_8F_E5M2;
    case DType::bf16:
      return CUDA_R_16BF;
    default:
      OCTET_ERROR("LtGemm: expected e4m3, e5m2 or bf16 operands, got ", dtype_name(dtype));
  }
}

cublasLtMatmulMatrixScale_t scale_mode(fp8::ScalingMode mode) {
  switch (mode) {
    case fp8::ScalingMode::per_tensor:
      return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    case fp8::ScalingMode::block_1x128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case fp8::ScalingMode::block_128x128:
      return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    case fp8::ScalingMode::mxfp8_1x32:
      return CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
  }
  OCTET_ERROR("LtGemm: unknown scaling mode ", static_cast<int>(mode));
}

template <typename T>
void set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value) {
  OCTET_BENCH_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)));
}

}  // namespace

std::string LtGemmConfig::describe() const {
  std::string text(dtype_name(dtype));
  if (is_fp8(dtype)) {
    text +=
        detail::concat(" ", fp8::scaling_mode_name(a_mode), " x ", fp8::scaling_mode_name(b_mode),
                       fast_accumulation ? " fast-accumulation" : " split-accumulation");
  }
  return text + detail::concat(" M=", m, " N=", n, " K=", k);
}

LtGemm::LtGemm(const LtGemmConfig& config, const void* a_scale, const void* b_scale) {
  try {
    plan(config, a_scale, b_scale);
  } catch (...) {
    release();
    throw;
  }
}

void LtGemm::plan(const LtGemmConfig& config, const void* a_scale, const void* b_scale) {
  DeviceGuard guard(device());
  const bool fp8_inputs = is_fp8(config.dtype);
  OCTET_CHECK(fp8_inputs || config.dtype == DType::bf16,
              "LtGemm: expected FP8 or bf16 operands, got ", dtype_name(config.dtype));
  // Row-major D = A * B^T is column-major D^T [n, m] = B * A^T: cuBLASLt's A is octet's B
  // (K x N column-major, transposed), its B is octet's A (K x M column-major, as is).
  OCTET_BENCH_CHECK_CUBLAS(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set(desc_, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set(desc_, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  if (fp8_inputs) {
    const int8_t fast = config.fast_accumulation ? 1 : 0;
    set(desc_, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast);
    set(desc_, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, static_cast<int32_t>(scale_mode(config.b_mode)));
    set(desc_, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, static_cast<int32_t>(scale_mode(config.a_mode)));
    set(desc_, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, b_scale);
    set(desc_, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a_scale);
  }
  const cudaDataType_t type = cuda_type(config.dtype);
  const auto m = static_cast<uint64_t>(config.m);
  const auto n = static_cast<uint64_t>(config.n);
  const auto k = static_cast<uint64_t>(config.k);
  OCTET_BENCH_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&lt_a_, type, k, n, config.k));
  OCTET_BENCH_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&lt_b_, type, k, m, config.k));
  OCTET_BENCH_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&lt_d_, CUDA_R_16BF, n, m, config.n));

  cublasLtMatmulPreference_t preference = nullptr;
  OCTET_BENCH_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&preference));
  const uint64_t workspace_bytes = kWorkspaceBytes;
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  cublasStatus_t status =
      cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace_bytes, sizeof(workspace_bytes));
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulAlgoGetHeuristic(handle(), desc_, lt_a_, lt_b_, lt_d_, lt_d_, preference,
                                            1, &result, &returned);
  }
  cublasLtMatmulPreferenceDestroy(preference);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && returned == 0)) {
    throw Unsupported("cuBLASLt " + std::to_string(cublasLtGetVersion()) +
                      " has no algorithm for " + config.describe());
  }
  OCTET_BENCH_CHECK_CUBLAS(status);
  algo_ = result.algo;
}

LtGemm::~LtGemm() { release(); }

void LtGemm::release() noexcept {
  // Never throws: a failed destroy would only leak a host-side descriptor.
  if (lt_d_ != nullptr) cublasLtMatrixLayoutDestroy(lt_d_);
  if (lt_b_ != nullptr) cublasLtMatrixLayoutDestroy(lt_b_);
  if (lt_a_ != nullptr) cublasLtMatrixLayoutDestroy(lt_a_);
  if (desc_ != nullptr) cublasLtMatmulDescDestroy(desc_);
  lt_d_ = lt_b_ = lt_a_ = nullptr;
  desc_ = nullptr;
}

void LtGemm::run(const void* a, const void* b, void* d, cudaStream_t stream) const {
  const float alpha = 1.0f;
  const float beta = 0.0f;
  OCTET_BENCH_CHECK_CUBLAS(cublasLtMatmul(handle(), desc_, &alpha, b, lt_a_, a, lt_b_, &beta, d,
                                          lt_d_, d, lt_d_, &algo_, workspace(), kWorkspaceBytes,
                                          stream));
}

int64_t LtGemm::scale_elements(fp8::ScalingMode mode, int64_t outer, int64_t inner) {
  switch (mode) {
    case fp8::ScalingMode::per_tensor:
      return 1;
    case fp8::ScalingMode::block_1x128:
      return round_up(ceil_div(inner, fp8::kBlock), kPadBlocks) * round_up(outer, kPadBlocks);
    case fp8::ScalingMode::block_128x128:
      return round_up(ceil_div(inner, fp8::kBlock), kPadBlocks) *
             round_up(ceil_div(outer, fp8::kBlock), kPadBlocks);
    case fp8::ScalingMode::mxfp8_1x32:
      return round_up(ceil_div(inner, fp8::kMxBlock), kPadBlocks) * round_up(outer, kMxPadRows);
  }
  OCTET_ERROR("LtGemm: unknown scaling mode ", static_cast<int>(mode));
}

}  // namespace octet::bench

#endif  // OCTET_WITH_CUDA
