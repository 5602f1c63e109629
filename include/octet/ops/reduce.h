// Reductions with a fixed summation order (DESIGN.md rule 3: no float atomics for sums).
#pragma once

#include <cstdint>

#include "octet/core/tensor.h"

namespace octet::ops {

/// Rows per tile of the two-pass row sum: each tile's partial is a sequential sum over its rows,
/// then the partials are added in tile order. Both backends use exactly this order, so their
/// results agree bit for bit (and never depend on thread scheduling).
inline constexpr int64_t kSumRowsTileRows = 128;

/// out[c] = (accumulate ? out[c] : 0) + sum over the rows r of x[r, c], for the [rows, cols]
/// matrix view of x (f32 or bf16). out is f32 [cols] on x's device. Used for bias gradients.
/// The order is fixed: partials per kSumRowsTileRows-row tile, then those partials in tile order.
void sum_rows(const Tensor& x, const Tensor& out, bool accumulate);

}  // namespace octet::ops
