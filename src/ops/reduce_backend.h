// Backend entry points of the reduction family (include/octet/ops/reduce.h); see
// quantize_backend.h for the contract between dispatcher and backends.
#pragma once

#include "octet/ops/reduce.h"

namespace octet::ops::cpu {
void sum_rows(const Tensor& x, const Tensor& out, bool accumulate);
}  // namespace octet::ops::cpu

namespace octet::ops::cuda {
void sum_rows(const Tensor& x, const Tensor& out, bool accumulate);
/// sum_rows' second pass: out[c] = (accumulate ? out[c] : 0) + partials[0, c] + partials[1, c] +
/// ... in tile order; partials f32 [tiles, cols], out f32 [cols], both on the current device. The
/// quantize kernels that fuse column sums write such partials too.
void combine_row_partials(const Tensor& partials, const Tensor& out, bool accumulate);
}  // namespace octet::ops::cuda
