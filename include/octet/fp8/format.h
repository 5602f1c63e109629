// Scalar number formats: FP8 E4M3/E5M2, BF16 and the E8M0 block-scale format.
//
// Every encoder here is bit-identical to CUDA's saturating conversions
// (__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...), __float2bfloat16_rn,
// __nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundPosInf)); tests/fp8/format_test.cc proves it
// over all 2^32 float bit patterns. The functions are host-and-device so the CUDA kernels can run
// exactly this code where the hardware has no matching instruction; where it has one (bf16), the
// device uses it.
#pragma once

#include <cstdint>
#include <cstring>

#include "octet/core/dtype.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#define OCTET_HD __host__ __device__ __forceinline__
#else
#define OCTET_HD inline
#endif

namespace octet::fp8 {

/// Largest finite E4M3 value (S.1111.110).
inline constexpr float kE4M3Max = 448.0f;
/// Largest finite E5M2 value (S.11110.11).
inline constexpr float kE5M2Max = 57344.0f;
/// E8M0's exponent bias: bits b encode 2^(b - 127); 0xFF is NaN.
inline constexpr int kE8M0Bias = 127;
inline constexpr uint8_t kE8M0NaN = 0xFF;

/// Largest finite value of an FP8 dtype (e4m3 or e5m2).
constexpr float fp8_max(DType dtype) { return dtype == DType::e4m3 ? kE4M3Max : kE5M2Max; }

OCTET_HD uint32_t float_bits(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof(bits));
  return bits;
}

OCTET_HD float bits_float(uint32_t bits) {
  float x;
  memcpy(&x, &bits, sizeof(x));
  return x;
}

/// Rounds |x| (as float bits) to a floating format with `mantissa_bits` explicit mantissa bits and
/// exponent bias `bias`, round-to-nearest-even, for values already known to be in range (above
/// half the smallest subnormal, at most the largest finite value's rounding limit). Returns the
/// exponent and mantissa fields (no sign). Both results are computed and one is selected: the
/// CPU's quantize loops see data that takes either side at random, and a branch here mispredicts.
OCTET_HD uint32_t round_to_minifloat(uint32_t abs_bits, int mantissa_bits, int bias) {
  // A normal result: the exponent rebiased, `drop` bits rounded off to nearest even; a carry out
  // of the mantissa moves into the exponent, as it should.
  const int drop = 23 - mantissa_bits;
  const uint32_t rebiased = abs_bits - (static_cast<uint32_t>(127 - bias) << 23);
  const uint32_t normal = (rebiased + (1u << (drop - 1)) - 1u + ((abs_bits >> drop) & 1u)) >> drop;
  // A subnormal result counts units of the smallest subnormal, 2^(1 - bias - mantissa_bits).
  // Scaling by the unit's inverse is exact, and adding 2^23 makes the float adder (in its default
  // mode, to nearest even) round the count to an integer in the sum's low mantissa bits. A count
  // of 2^mantissa_bits is the smallest normal's encoding.
  constexpr float kTwoTo23 = 8388608.0f;
  const float per_unit = bits_float(static_cast<uint32_t>(127 + bias - 1 + mantissa_bits) << 23);
  const uint32_t subnormal = float_bits(bits_float(abs_bits) * per_unit + kTwoTo23) -
                             float_bits(kTwoTo23);
  const uint32_t smallest_normal = static_cast<uint32_t>(127 + 1 - bias) << 23;
  return abs_bits < smallest_normal ? subnormal : normal;
}

/// x in a saturating FP8 format: round_to_minifloat's fields with x's sign; 0 (signed) when |x|
/// is at most `zero_limit` (as float bits), `max_code` when above `saturate_limit`; NaN -> 0x7F,
/// canonical positive as CUDA. Selects, not early returns, for round_to_minifloat's reason.
OCTET_HD uint8_t encode_minifloat(float x, int mantissa_bits, int bias, uint32_t zero_limit,
                                  uint32_t saturate_limit, uint32_t max_code) {
  const uint32_t bits = float_bits(x);
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  uint32_t code = round_to_minifloat(abs_bits, mantissa_bits, bias);
  code = abs_bits > saturate_limit ? max_code : code;
  code = abs_bits <= zero_limit ? 0u : code;
  code |= (bits >> 24) & 0x80u;
  return static_cast<uint8_t>(abs_bits > 0x7F800000u ? 0x7Fu : code);
}

/// float -> E4M3, round-to-nearest-even, saturating to ±448; NaN -> 0x7F.
OCTET_HD uint8_t encode_e4m3(float x) {
  // Zero at or below 2^-10 (half the smallest subnormal); saturated above 464 (448 + half an ulp).
  return encode_minifloat(x, 3, 7, 0x3A800000u, 0x43E80000u, 0x7Eu);
}

/// float -> E5M2, round-to-nearest-even, saturating to ±57344; NaN -> 0x7F.
OCTET_HD uint8_t encode_e5m2(float x) {
  // Zero at or below 2^-17; saturated from 61440 on (the tie rounds up): above the float below it.
  return encode_minifloat(x, 2, 15, 0x37000000u, 0x476FFFFFu, 0x7Bu);
}

/// E4M3 -> float (exact). 0x7F/0xFF are NaN.
OCTET_HD float decode_e4m3(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t exponent = (v >> 3) & 0xFu;
  const uint32_t mantissa = v & 0x7u;
  if (exponent == 0xF && mantissa == 0x7) return bits_float(sign | 0x7FC00000u);
  if (exponent == 0) {  // subnormal: mantissa * 2^-9
    float magnitude = static_cast<float>(mantissa) * 0.001953125f;
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent - 7 + 127) << 23) | (mantissa << 20));
}

/// E5M2 -> float (exact). Exponent 31 holds inf and NaN.
OCTET_HD float decode_e5m2(uint8_t v) {
  // E5M2 is the top byte of an IEEE half: widen through the half layout.
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t exponent = (v >> 2) & 0x1Fu;
  const uint32_t mantissa = v & 0x3u;
  if (exponent == 0x1F) return bits_float(sign | 0x7F800000u | (mantissa << 21) | (mantissa ? 0x400000u : 0));
  if (exponent == 0) {  // subnormal: mantissa * 2^-16
    float magnitude = static_cast<float>(mantissa) * 1.52587890625e-05f;
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent - 15 + 127) << 23) | (mantissa << 21));
}

/// Encodes into the FP8 dtype `dtype` (e4m3 or e5m2).
OCTET_HD uint8_t encode_fp8(float x, DType dtype) {
  return dtype == DType::e4m3 ? encode_e4m3(x) : encode_e5m2(x);
}
OCTET_HD float decode_fp8(uint8_t v, DType dtype) {
  return dtype == DType::e4m3 ? decode_e4m3(v) : decode_e5m2(v);
}

/// float -> bf16 bits, round-to-nearest-even; NaN -> 0x7FFF (CUDA's canonical NaN). The device
/// takes the hardware conversion (cvt.rn.bf16.f32: one instruction for the eight of the formula),
/// which CastCuda.F32ToBf16EqualsTheHostEncoder checks against the formula on the GPU.
OCTET_HD uint16_t encode_bf16(float x) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
#else
  const uint32_t bits = float_bits(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
#endif
}

/// encode_bf16(lo) | encode_bf16(hi) << 16: two bf16 in one word, lo at the lower address. One
/// cvt.rn.bf16x2.f32 on the device.
OCTET_HD uint32_t encode_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);  // .x (lo) is the low half
  uint32_t word;
  memcpy(&word, &pair, sizeof(word));
  return word;
#else
  return encode_bf16(lo) | static_cast<uint32_t>(encode_bf16(hi)) << 16;
#endif
}
OCTET_HD float decode_bf16(uint16_t v) { return bits_float(static_cast<uint32_t>(v) << 16); }

/// The E8M0 scale for a block: 2^ceil(log2(x)) for x >= 0, as biased exponent bits, saturated to
/// [2^-127, 2^127]. NaN -> 0xFF. Matches __nv_cvt_float_to_e8m0(x, __NV_SATFINITE,
/// cudaRoundPosInf) for non-negative x (the sign is ignored).
OCTET_HD uint8_t encode_e8m0_round_up(float x) {
  const uint32_t abs_bits = float_bits(x) & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return kE8M0NaN;
  if (abs_bits >= 0x7F000000u) return 254;  // >= 2^127 (inf included): saturate
  uint32_t exponent = abs_bits >> 23;
  const uint32_t mantissa = abs_bits & 0x7FFFFFu;
  if (exponent == 0) return mantissa > 0x400000u ? 1 : 0;  // subnormals: 2^-127 or 2^-126
  return static_cast<uint8_t>(exponent + (mantissa != 0 ? 1 : 0));
}

/// E8M0 bits -> 2^(bits-127) as float (2^-127 is a float subnormal; exact). 0xFF -> NaN.
OCTET_HD float decode_e8m0(uint8_t v) {
  if (v == kE8M0NaN) return bits_float(0x7FC00000u);
  if (v == 0) return bits_float(0x00400000u);
  return bits_float(static_cast<uint32_t>(v) << 23);
}

}  // namespace octet::fp8
