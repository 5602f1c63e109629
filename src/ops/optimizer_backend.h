// Backend entry points of the optimizer family (include/octet/ops/optimizer.h); see
// quantize_backend.h for the contract between dispatcher and backends.
#pragma once

#include <cstdint>

#include "octet/ops/optimizer.h"
#include "ops/optimizer_math.h"

namespace octet::ops {

// The fixed order of global_norm_squared, shared by both backends (they agree bit for bit):
//   1. each tensor is cut into chunks of kNormChunk elements; a chunk's partial is the
//      fixed_order_reduce (fixed_order_reduce.h) over kNormLanes lanes of double(g) * double(g);
//   2. a tensor's sum is the fixed_order_reduce over kNormLanes lanes of its chunk partials;
//   3. the total starts at +0 and adds the tensor sums in the given order; norm_sq = float(total).
// Accumulation is in double: a float squared is exact in double, and 1e9 terms summed in double
// lose far less than one f32 ulp, so the only visible rounding is the final one to f32.
/// Threads per CTA of the norm kernels and lanes of the reduction order.
inline constexpr int kNormLanes = 256;
/// Elements per chunk (one CTA of the first pass): 16 per lane, enough bytes in flight per CTA to
/// stream at bandwidth without making the partial array large.
inline constexpr int64_t kNormChunk = 16 * kNormLanes;

/// Elements per unit of work of the multi-tensor AdamW step (one CTA on CUDA, one iteration of the
/// parallel loop on the CPU). Every element is updated on its own, so the result does not depend
/// on it. 16K elements move 16K * 28 B = 448 KB per CTA, enough to hide the tensor lookup, and
/// cut GPT-2 1.5B into ~95K CTAs, so the last wave is ~1% of the step.
inline constexpr int64_t kAdamWChunk = int64_t{1} << 14;

}  // namespace octet::ops

namespace octet::ops::cpu {
/// Steps 1 and 2 of the order above: sums[i] = tensor i's sum (i64 slots holding doubles, on the
/// gradients' device).
void tensor_norm_sums(const Tensor* grads, int count, const Tensor& sums);
/// Step 3: norm_sq = float(the sums added in order), both on one device.
void sum_tensor_norms(const Tensor& sums, const Tensor& norm_sq);
/// The multi-tensor step (the dispatcher routes the one-tensor step here too, as a list of one).
void adamw_step(const AdamWTensor* tensors, int count, const Tensor& norm_sq,
                const AdamWCoefficients& coefficients);
}  // namespace octet::ops::cpu

namespace octet::ops::cuda {
/// Steps 1 and 2 of the order above: sums[i] = tensor i's sum (i64 slots holding doubles, on the
/// gradients' device).
void tensor_norm_sums(const Tensor* grads, int count, const Tensor& sums);
/// Step 3: norm_sq = float(the sums added in order), both on one device.
void sum_tensor_norms(const Tensor& sums, const Tensor& norm_sq);
/// The multi-tensor step (the dispatcher routes the one-tensor step here too, as a list of one).
void adamw_step(const AdamWTensor* tensors, int count, const Tensor& norm_sq,
                const AdamWCoefficients& coefficients);
}  // namespace octet::ops::cuda
