// CRC-32C (Castagnoli), the checksum of every tensor in an octet checkpoint.
#pragma once

#include <cstddef>
#include <cstdint>

namespace octet::train {

/// CRC-32C of `bytes` bytes at `data`, continuing from `crc` (0 to start): the iSCSI polynomial
/// 0x1EDC6F41 (RFC 3720, appendix B.4), reflected, with initial value and final xor 0xFFFFFFFF,
/// so crc32c("123456789") = 0xE3069283. Uses the SSE4.2 instruction when the CPU has it.
uint32_t crc32c(const void* data, size_t bytes, uint32_t crc = 0);

/// The same value, always by the portable table method (tests compare the two).
uint32_t crc32c_portable(const void* data, size_t bytes, uint32_t crc = 0);

}  // namespace octet::train
