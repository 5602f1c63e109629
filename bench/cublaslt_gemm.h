// The raw cuBLASLt GEMM that octet's ops::gemm is compared against: descriptors, heuristic and
// matmul called directly, for the same shape, dtypes, layout, scale modes and accumulation.
#pragma once

#if OCTET_WITH_CUDA

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "octet/core/dtype.h"
#include "octet/fp8/quantized_tensor.h"

namespace octet::bench {

/// One GEMM in octet's terms: D [m, n] (bf16) = A [m, k] * B [n, k]^T, both operands row-major
/// and K-contiguous (the TN layout Hopper's FP8 tensor cores require).
struct LtGemmConfig {
  int64_t m = 0, n = 0, k = 0;
  DType dtype = DType::e4m3;                               ///< of A and B: e4m3 or bf16
  fp8::ScalingMode a_mode = fp8::ScalingMode::per_tensor;  ///< FP8 only
  fp8::ScalingMode b_mode = fp8::ScalingMode::per_tensor;  ///< FP8 only
  bool fast_accumulation = false;  ///< FP8 only: CUBLASLT_MATMUL_DESC_FAST_ACCUM

  /// "e4m3 per_tensor x per_tensor fast 8192x8192x8192" for messages.
  std::string describe() const;
};

/// A planned cuBLASLt matmul: built once, run many times.
class LtGemm {
 public:
  /// Creates the descriptors and asks the heuristic for the best algorithm. a_scale and b_scale
  /// are device pointers to the scales in cuBLASLt's layout for the modes (FP8 only; nullptr for
  /// bf16). Throws Unsupported when cuBLASLt has no algorithm for the configuration.
  LtGemm(const LtGemmConfig& config, const void* a_scale, const void* b_scale);
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  /// Enqueues D = A * B^T on `stream`.
  void run(const void* a, const void* b, void* d, cudaStream_t stream) const;

  /// Elements of the scale buffer cuBLASLt reads for a K-contiguous operand with `outer` rows of
  /// `inner` (= K) elements under `mode`, padded generously (every block count rounded up to a
  /// multiple of 4) so any of cuBLASLt's padded layouts fits.
  static int64_t scale_elements(fp8::ScalingMode mode, int64_t outer, int64_t inner);

 private:
  void plan(const LtGemmConfig& config, const void* a_scale, const void* b_scale);
  void release() noexcept;

  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t lt_a_ = nullptr;  ///< cuBLASLt's A: octet's B
  cublasLtMatrixLayout_t lt_b_ = nullptr;  ///< cuBLASLt's B: octet's A
  cublasLtMatrixLayout_t lt_d_ = nullptr;  ///< D, also used as C (beta = 0)
  cublasLtMatmulAlgo_t algo_{};
};

}  // namespace octet::bench

#endif  // OCTET_WITH_CUDA
