// amax, FP8 quantization (per-tensor, block, MXFP8; with the fused transposed copy) and
// dequantization. CPU semantics are the reference; CUDA matches them bit-exactly.
#pragma once

#include <cstdint>
#include <span>

#include "octet/core/tensor.h"
#include "octet/fp8/quantized_tensor.h"

namespace octet::ops {

/// Records max|x| into amax_out: element 0 of amax_out (f32, on x's device) becomes
/// max(element 0, max|x|). The max is taken over the bit patterns of |x|, so a NaN anywhere wins
/// and the result does not depend on the order of the reduction. x: f32 or bf16, non-empty.
void amax(const Tensor& x, const Tensor& amax_out);

struct QuantizeArgs {
  /// per_tensor only: f32[1] on x's device; q = fp8(x * scale), scale_inv = 1 / scale.
  Tensor scale;
  /// Optional f32[>=1] on x's device: element 0 becomes max(element 0, max|x|) (as amax()).
  /// Published only after every FP8 store of the call (DESIGN.md rule 1).
  Tensor amax;
  /// block_1x128 / block_128x128: round each block's scale down to a power of two.
  bool power_of_2_block_scales = true;
  /// Optional f32[cols] on x's device: column_sums[c] += the sum over the rows of x[:, c], in
  /// sum_rows' fixed order and bit-identical to ops::sum_rows(x, column_sums, true). A Linear's
  /// bias gradient comes out of its grad_output's cast this way. The CUDA backend computes it in
  /// the quantize kernel when the transposed copy is written (that pass holds whole columns);
  /// otherwise it runs sum_rows after the quantize.
  Tensor column_sums;
  /// false: column_sums = the sums, bitwise as ops::sum_rows(x, column_sums, false) (its old
  /// values are not read), so a gradient's first write needs no zeroing before it.
  bool accumulate_column_sums = true;
};

/// Optional FP8 output of a fused op (norms, activations, the optimizer step): the op also writes
/// quantize(its output) into `out`, exactly as ops::quantize would on the op's (f32/bf16) output,
/// in the same kernel where the backend can. Which modes and copies each op fuses is in its brief.
struct FusedQuantize {
  fp8::QuantizedTensor* out = nullptr;
  QuantizeArgs args;
};

/// Quantizes the [rows, cols] matrix view of x (f32 or bf16) into `out`, whose allocated buffers
/// (see QuantizedTensor::allocate) decide the scaling mode and which copies are written. Writes
/// data/data_t and scale_inv/scale_inv_t. Throws on shape, dtype or device mismatch.
void quantize(const Tensor& x, fp8::QuantizedTensor& out, const QuantizeArgs& args = {});

/// Quantizes row groups of x (f32 or bf16, [rows, cols] as a matrix): for every g with rows, x's
/// rows [offsets[g], offsets[g + 1]) into *targets[g].out with targets[g].args, exactly as
/// ops::quantize on that slice would (scales, amax, column sums; bitwise). A group without rows,
/// or whose target's out is null (a caller quantizing it another way), is skipped. offsets:
/// host-side, groups + 1 non-decreasing entries from 0, the last at most x's rows (rows past it
/// are not read); targets: one per group. The CUDA backend quantizes up to 16 groups in one
/// launch, so the experts of an MoE layer cost the host one launch instead of one each.
void quantize_groups(const Tensor& x, std::span<const int64_t> offsets,
                     std::span<const FusedQuantize> targets);

/// out (f32 or bf16, [rows, cols], or [cols, rows] when `transposed`) = the dequantized row-wise
/// copy of q, or of its transposed copy when `transposed`.
void dequantize(const fp8::QuantizedTensor& q, const Tensor& out, bool transposed = false);

/// out = x converted between f32 and bf16 (round-to-nearest-even); same shape, any of the two.
void cast(const Tensor& x, const Tensor& out);

/// Indices into count_fp8_codes' counts.
enum Fp8CodeCount : int { kSaturatedCodes = 0, kUnderflowCodes = 1, kNonzeroInputs = 2 };

/// Quantization health of x (f32 or bf16) and its FP8 codes (e4m3 or e5m2, x's element count, as
/// a quantize wrote them, element i for x's element i): counts (i64[3] on x's device) +=
/// {codes at the format's largest finite magnitude (saturated), nonzero inputs whose code is
/// zero (underflow), nonzero inputs}. Integer sums, so the counts do not depend on order.
void count_fp8_codes(const Tensor& x, const Tensor& codes, const Tensor& counts);

}  // namespace octet::ops
