// Backend entry points of the GEMM family (include/octet/ops/gemm.h); see quantize_backend.h for
// the contract between dispatcher and backends. Shapes are resolved by the dispatcher.
#pragma once

#include "octet/ops/gemm.h"

namespace octet::ops {
/// op(A) is [m, k], op(B) is [k, n], D is [m, n].
struct GemmShape {
  int64_t m = 0, n = 0, k = 0;
};
}  // namespace octet::ops

namespace octet::ops::cpu {
void gemm(const GemmOperand& a, const GemmOperand& b, const Tensor& d, const GemmArgs& args,
          const GemmShape& shape);
}  // namespace octet::ops::cpu

namespace octet::ops::cuda {
void gemm(const GemmOperand& a, const GemmOperand& b, const Tensor& d, const GemmArgs& args,
          const GemmShape& shape);
/// How many GEMMs with an addend ran it as a separate pass because cuBLASLt declined C != D (its
/// heuristic found no such algorithm, or cublasLtMatmul refused one). FP32 operands with a BF16 D
/// always add it separately (cuBLASLt's FP32 GEMM writes FP32) and are not counted. The other
/// counters of the algorithm cache are in ops/cuda/cublaslt.h.
uint64_t gemm_unfused_addends();
}  // namespace octet::ops::cuda
