// Grouped GEMM: G independent GEMMs in one call, for mixture-of-experts layers, where every
// expert multiplies its own rows of one expert-contiguous activation buffer by its own weight.
// Its own op family (like ggml's MUL_MAT_ID), reusing the dense GEMM's semantics and machinery.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "octet/core/tensor.h"
#include "octet/ops/gemm.h"

namespace octet::ops {

/// One GEMM of a grouped call: D = alpha * op(A) * op(B) + beta * D + bias (+ addend), exactly as
/// ops::gemm(a, b, d, args).
struct GemmProblem {
  GemmOperand a, b;
  Tensor d;
  GemmArgs args;
};

/// The arguments every group shares, and the optional per-group biases.
struct GroupedGemmArgs {
  float alpha = 1.0f;
  float beta = 0.0f;              ///< 1 accumulates into D (gradient accumulation)
  std::vector<Tensor> bias;       ///< empty, or one [N] tensor (f32 or bf16) per group
  Accumulation accumulation = Accumulation::split;
};

/// Runs independent GEMMs, each checked and computed exactly as ops::gemm would, on one device, in
/// no particular order (the CUDA backend runs several at once): no group's D may overlap another
/// group's D, operands, bias or addend, which is checked. A problem whose M is 0 (an empty group)
/// is skipped. A problem whose K is 0 (a
/// wgrad over an empty group) leaves D unchanged with beta = 1 and zeroes it with beta = 0; it
/// takes no bias or addend. The result of every problem is bitwise that of ops::gemm on the same
/// backend.
void grouped_gemm(std::span<const GemmProblem> problems);

/// Group g's rows [offsets[g], offsets[g+1]) of an expert-contiguous buffer: offsets has G + 1
/// non-decreasing entries starting at 0. Each group's row count must be a multiple of 16 for FP8
/// operands (the dispatch pads every group to it).
///
/// Forward and dgrad: for every group g with rows,
///   D[offsets[g] : offsets[g+1]] = alpha * op(A_g) * op(B_g) + beta * D_g + bias_g,
/// where A_g is a[g] (its own FP8 scales; a.size() == G) or, when a.size() == 1, the group's rows
/// of a[0] (split_rows), and B_g = b[g] is expert g's weight. D is [offsets[G], N].
void grouped_gemm(std::span<const GemmOperand> a, std::span<const GemmOperand> b, const Tensor& d,
                  std::span<const int64_t> offsets, const GroupedGemmArgs& args = {});

/// Weight gradients: for every group g, d[g] = alpha * op(A_g) * op(B_g) + beta * d[g], where the
/// inner dimension K is the group's row count (dW_g = dY_g^T X_g: A_g = dY_g transposed, or the
/// transposed FP8 copy of dY_g; B_g likewise from X_g). a and b hold one operand per group, or one
/// operand each over all rows whose K dimension is the buffer's rows (split_rows). A group with no
/// rows leaves d[g] unchanged (beta = 1) or zeroes it (beta = 0).
void grouped_gemm_wgrad(std::span<const GemmOperand> a, std::span<const GemmOperand> b,
                        std::span<const Tensor> d, std::span<const int64_t> offsets,
                        const GroupedGemmArgs& args = {});

/// The row ranges of `whole` (its stored data's dim 0, and the scales that go with those rows),
/// one operand per group: dense operands, per-tensor FP8 (the one scale is shared), 1x128 and
/// MXFP8 blocks (per-row scales). 128x128 weight tiles cannot be split by rows and are refused.
/// An empty group gets an operand with no rows.
std::vector<GemmOperand> split_rows(const GemmOperand& whole, std::span<const int64_t> offsets);

/// How grouped GEMMs run on `device`, with the answer of the capability probe on CUDA: whether
/// the loaded cuBLASLt offers a grouped matmul (found by looking for its entry point in the
/// library itself, never by version) and, when it does not, that each group is one cuBLASLt call
/// through the dense GEMM's planner. For tests and benchmarks to print.
std::string grouped_gemm_path(const Device& device);

}  // namespace octet::ops
