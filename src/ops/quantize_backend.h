// Backend entry points of the quantize family (include/octet/ops/quantize.h). The dispatcher in
// src/ops/quantize.cc validates arguments, opens the device guard and NVTX range, then calls one
// of these; backends may assume valid, non-empty inputs on one device.
#pragma once

#include <type_traits>

#include "octet/fp8/format.h"
#include "octet/ops/quantize.h"

namespace octet::ops {

/// Calls f(tag) with the FP8 dtype (e4m3 or e5m2) as a compile-time constant, so the encoder's
/// branch on the format folds away in the inner loops. Both backends' quantize code uses it.
template <typename F>
void visit_fp8(DType dtype, F&& f) {
  if (dtype == DType::e4m3) {
    f(std::integral_constant<DType, DType::e4m3>{});
  } else {
    f(std::integral_constant<DType, DType::e5m2>{});
  }
}

/// count_fp8_codes' rule for one element, shared by both backends: adds to counts[kSaturatedCodes,
/// kUnderflowCodes, kNonzeroInputs]. `max_code` is the format's largest finite magnitude code.
template <typename Count>
OCTET_HD void count_fp8_code(float x, uint8_t code, uint8_t max_code, Count* counts) {
  constexpr uint8_t kMagnitude = 0x7F;  // every bit of an FP8 code but the sign
  const uint8_t magnitude = code & kMagnitude;
  counts[kSaturatedCodes] += magnitude == max_code;
  if (x != 0.0f) {
    counts[kNonzeroInputs] += 1;
    counts[kUnderflowCodes] += magnitude == 0;
  }
}

/// The checks of ops::quantize on a target: `out` allocated for a [rows, cols] matrix with valid
/// copies, args.scale for per_tensor, args.amax and args.column_sums shaped right, and all of
/// them on the device of `source` (the op's input), which is returned. Messages name `op`.
/// Shared with the ops that fuse a quantize into their output (FusedQuantize).
Device check_quantize_target(const char* op, int64_t rows, int64_t cols,
                             const fp8::QuantizedTensor& out, const QuantizeArgs& args,
                             const Tensor& source);

}  // namespace octet::ops

namespace octet::ops::cpu {
void amax(const Tensor& x, const Tensor& amax_out);
void quantize(const Tensor& x, fp8::QuantizedTensor& out, const QuantizeArgs& args);
void quantize_groups(const Tensor& x, std::span<const int64_t> offsets,
                     std::span<const FusedQuantize> targets);
void dequantize(const fp8::QuantizedTensor& q, const Tensor& out, bool transposed);
void cast(const Tensor& x, const Tensor& out);
void count_fp8_codes(const Tensor& x, const Tensor& codes, const Tensor& counts);
}  // namespace octet::ops::cpu

namespace octet::ops::cuda {
void amax(const Tensor& x, const Tensor& amax_out);
void quantize(const Tensor& x, fp8::QuantizedTensor& out, const QuantizeArgs& args);
void quantize_groups(const Tensor& x, std::span<const int64_t> offsets,
                     std::span<const FusedQuantize> targets);
void dequantize(const fp8::QuantizedTensor& q, const Tensor& out, bool transposed);
void cast(const Tensor& x, const Tensor& out);
void count_fp8_codes(const Tensor& x, const Tensor& codes, const Tensor& counts);
}  // namespace octet::ops::cuda
