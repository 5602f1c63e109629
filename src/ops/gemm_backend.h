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
}  // namespace octet::ops::cuda
