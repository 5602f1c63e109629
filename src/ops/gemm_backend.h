// Backend entry points of the GEMM family (include/octet/ops/gemm.h); see quantize_backend.h for
// the contract between dispatcher and backends. Shapes are resolved by the dispatcher.
#pragma once

#include "octet/ops/gemm.h"

namespace octet::ops {
/// op(A) is [m, k], op(B) is [k, n], D is [m, n].
struct GemmShape {
  int64_t m = 0, n = 0, k = 0;
};
/// Validates one GEMM's arguments as ops::gemm does (messages: expected vs received) and returns
/// its shape; the grouped GEMM checks each of its groups with it.
GemmShape check_gemm_args(const GemmOperand& a, const GemmOperand& b, const Tensor& d,
                          const GemmArgs& args);
}  // namespace octet::ops

namespace octet::ops::cpu {
void gemm(const GemmOperand& a, const GemmOperand& b, const Tensor& d, const GemmArgs& args,
          const GemmShape& shape);
}  // namespace octet::ops::cpu

namespace octet::ops::cuda {
void gemm(const GemmOperand& a, const GemmOperand& b, const Tensor& d, const GemmArgs& args,
          const GemmShape& shape);
/// Whether a GEMM can run on any of the grouped GEMM's lanes (cuda/cublaslt.h, gemm_lane): one
/// that takes no stream-ordered temporary, which the pool frees on octet's stream: no block or
/// MXFP8 scales to convert, no FP32 operands with a BF16 D.
bool runs_on_any_lane(const GemmOperand& a, const GemmOperand& b, const Tensor& d);
/// gemm on lane `lane` of its device, for a GEMM that runs_on_any_lane: the same plan, so the
/// same bits as on octet's stream.
void gemm_on_lane(int lane, const GemmOperand& a, const GemmOperand& b, const Tensor& d,
                  const GemmArgs& args, const GemmShape& shape);
}  // namespace octet::ops::cuda
