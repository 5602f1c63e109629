// Fixed hashes, the same with every standard library and machine: FNV-1a over names and bytes,
// and splitmix64's finalizer to spread a seed over all 64 bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace octet {

/// FNV-1a's 64-bit offset basis: the hash of nothing, where a new hash starts.
inline constexpr uint64_t kFnv1aBasis = 0xcbf29ce484222325ull;

/// FNV-1a, 64-bit (offset basis and prime from the FNV specification), of `n` bytes at `data`,
/// continuing from `hash`: hashing two buffers in turn equals hashing them joined.
inline uint64_t fnv1a(const void* data, size_t n, uint64_t hash = kFnv1aBasis) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) hash = (hash ^ bytes[i]) * 0x100000001b3ull;
  return hash;
}
inline uint64_t fnv1a(std::string_view text, uint64_t hash = kFnv1aBasis) {
  return fnv1a(text.data(), text.size(), hash);
}

/// splitmix64's finalizer (Steele, Lea and Flood, "Fast splittable pseudorandom number
/// generators", 2014): spreads any input over all 64 bits.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace octet
