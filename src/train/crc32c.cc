// CRC-32C by slicing-by-8 tables, or by the SSE4.2 crc32 instruction where the CPU has it (it
// computes exactly this polynomial, at several GB/s: a checkpoint's checksums then cost less
// than writing it).
#include "octet/train/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace octet::train {
namespace {

// The Castagnoli polynomial 0x1EDC6F41, bit-reversed (RFC 3720, B.4).
constexpr uint32_t kPolynomial = 0x82F63B78u;
constexpr size_t kSlices = 8;

using Tables = std::array<std::array<uint32_t, 256>, kSlices>;

constexpr Tables make_tables() {
  Tables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPolynomial & (0u - (c & 1u)));
    t[0][i] = c;
  }
  for (size_t s = 1; s < kSlices; ++s)
    for (uint32_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  return t;
}

constexpr Tables kTables = make_tables();

uint32_t update_portable(uint32_t c, const uint8_t* p, size_t n) {
  for (; n >= kSlices; n -= kSlices, p += kSlices) {
    uint64_t word;
    std::memcpy(&word, p, sizeof word);  // little-endian: byte 0 is the low byte
    word ^= c;
    c = kTables[7][word & 0xFF] ^ kTables[6][(word >> 8) & 0xFF] ^ kTables[5][(word >> 16) & 0xFF] ^
        kTables[4][(word >> 24) & 0xFF] ^ kTables[3][(word >> 32) & 0xFF] ^
        kTables[2][(word >> 40) & 0xFF] ^ kTables[1][(word >> 48) & 0xFF] ^ kTables[0][word >> 56];
  }
  for (; n > 0; --n, ++p) c = (c >> 8) ^ kTables[0][(c ^ *p) & 0xFF];
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t update_sse42(uint32_t c, const uint8_t* p, size_t n) {
  uint64_t c64 = c;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, sizeof word);
    c64 = _mm_crc32_u64(c64, word);
  }
  c = static_cast<uint32_t>(c64);
  for (; n > 0; --n, ++p) c = _mm_crc32_u8(c, *p);
  return c;
}

bool have_sse42() {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#endif

}  // namespace

uint32_t crc32c_portable(const void* data, size_t bytes, uint32_t crc) {
  return ~update_portable(~crc, static_cast<const uint8_t*>(data), bytes);
}

uint32_t crc32c(const void* data, size_t bytes, uint32_t crc) {
#if defined(__x86_64__)
  if (have_sse42()) return ~update_sse42(~crc, static_cast<const uint8_t*>(data), bytes);
#endif
  return crc32c_portable(data, bytes, crc);
}

}  // namespace octet::train
