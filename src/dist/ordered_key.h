// A float's bits mapped to an unsigned integer that orders like the float, with every NaN above
// +inf: NCCL's MAX over these keys is then a float MAX that keeps a NaN from any rank (NCCL's
// float MAX, like MPI's, may drop a NaN on one side of its comparison), and it is exact.
#pragma once

#include <cstdint>

#include "octet/fp8/format.h"

namespace octet::dist {

/// The key of every NaN: above every number's key.
inline constexpr uint32_t kNanKey = 0xFFFFFFFFu;

OCTET_HD uint32_t ordered_key(float x) {
  const uint32_t bits = fp8::float_bits(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return kNanKey;
  // Negative floats order backwards in their bits: flip them below the positive ones.
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

OCTET_HD float from_ordered_key(uint32_t key) {
  const uint32_t bits = key == kNanKey ? 0x7FC00000u : (key & 0x80000000u) ? key & 0x7FFFFFFFu : ~key;
  return fp8::bits_float(bits);
}

}  // namespace octet::dist
