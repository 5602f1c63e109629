// Reductions with a fixed summation order (DESIGN.md rule 3: no float atomics for sums).
#pragma once

#include <cstdint>

#include "octet/core/tensor.h"

namespace octet::ops {

/// Rows per tile of the two-pass row sum. A tile's partial is the sum, in order, of its runs of
/// kSumRowsRunRows rows, each run a sequential sum from +0 over its rows; then the partials are
/// added in tile order. Both backends, and the quantize kernels that fuse a bias gradient
/// (QuantizeArgs::column_sums), use exactly this order, so their results agree bit for bit (and
/// never depend on thread scheduling). The runs let a CUDA tile kernel sum a column with 8
/// threads of 16 rows each and combine them in a fixed order.
inline constexpr int64_t kSumRowsTileRows = 128;
inline constexpr int64_t kSumRowsRunRows = 16;

/// out[c] = (accumulate ? out[c] : 0) + sum over the rows r of x[r, c], for the [rows, cols]
/// matrix view of x (f32 or bf16). out is f32 [cols] on x's device. Used for bias gradients.
/// The order is fixed (see kSumRowsTileRows): runs, then tiles.
void sum_rows(const Tensor& x, const Tensor& out, bool accumulate);

}  // namespace octet::ops
