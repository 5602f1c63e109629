// Backend entry points of the reduction family (include/octet/ops/reduce.h); see
// quantize_backend.h for the contract between dispatcher and backends.
#pragma once

#include "octet/ops/reduce.h"

namespace octet::ops::cpu {
void sum_rows(const Tensor& x, const Tensor& out, bool accumulate);
}  // namespace octet::ops::cpu

namespace octet::ops::cuda {
void sum_rows(const Tensor& x, const Tensor& out, bool accumulate);
}  // namespace octet::ops::cuda
