// Scalar pieces of FP8 scaling that the CPU reference and the CUDA kernels must compute with the
// identical expression, so that both backends agree bit for bit. Formulas: docs/NUMERICS.md.
#pragma once

#include <cfloat>
#include <cstdint>

#include "octet/fp8/format.h"

namespace octet::fp8 {

/// Bit patterns of |x| order like the values, and every NaN sorts above +inf: a max over them
/// is exact, order-independent, and lets a NaN anywhere win.
OCTET_HD uint32_t abs_bits(float x) { return float_bits(x) & 0x7FFFFFFFu; }

/// Float bits with the exponent field all ones: inf or NaN.
inline constexpr uint32_t kExponentMask = 0x7F800000u;
/// Sign and exponent fields: masking a positive normal float with it rounds it down to 2^k.
inline constexpr uint32_t kSignExponentMask = 0xFF800000u;

/// Scale of a block (or tensor) with amax `amax`: fp8_max / amax, 1 when amax is 0, inf or NaN,
/// FLT_MAX when the quotient overflows, optionally rounded down to a power of two.
OCTET_HD float block_scale(float amax, float fp8_max, bool power_of_2) {
  if (amax == 0.0f || (float_bits(amax) & kExponentMask) == kExponentMask) return 1.0f;
  float scale = fp8_max / amax;
  if ((float_bits(scale) & 0x7FFFFFFFu) == kExponentMask) scale = FLT_MAX;
  if (power_of_2) scale = bits_float(float_bits(scale) & kSignExponentMask);
  return scale;
}

/// scale_inv stored next to FP32-scaled data: the IEEE reciprocal of the scale.
OCTET_HD float scale_inv_of(float scale) { return 1.0f / scale; }

/// MXFP8 block scale_inv as E8M0 bits: 2^ceil(log2(amax / fp8_max)) (IEEE division).
OCTET_HD uint8_t mxfp8_scale_inv(float amax, float fp8_max) {
  return encode_e8m0_round_up(amax / fp8_max);
}

/// MXFP8 multiplier applied before encoding: the exact reciprocal 2^(127 - e) of scale_inv bits e
/// (a power of two, so no rounding), NaN when scale_inv is NaN (0xFF).
OCTET_HD float mxfp8_multiplier(uint8_t scale_inv_bits) {
  if (scale_inv_bits == kE8M0NaN) return bits_float(0x7FC00000u);
  return decode_e8m0(static_cast<uint8_t>(2 * kE8M0Bias - scale_inv_bits));
}

/// One quantized element: fp8(x * multiplier) with a plain float multiply (no FMA contraction
/// is possible: nothing is added).
OCTET_HD uint8_t quantize_value(float x, float multiplier, DType dtype) {
  return encode_fp8(x * multiplier, dtype);
}

/// One dequantized element: decode(q) * scale_inv (float multiply); E8M0 scales are decoded first.
OCTET_HD float dequantize_value(uint8_t q, float scale_inv, DType dtype) {
  return decode_fp8(q, dtype) * scale_inv;
}

}  // namespace octet::fp8
