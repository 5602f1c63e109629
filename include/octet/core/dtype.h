// Element types of tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace octet {

enum class DType : uint8_t {
  f32,
  bf16,
  f16,
  e4m3,  ///< FP8 E4M3 (finite max 448), stored as one byte
  e5m2,  ///< FP8 E5M2 (finite max 57344), stored as one byte
  e8m0,  ///< unsigned power-of-two scale 2^(bits-127), 0xFF is NaN (MXFP8 block scales)
  u8,
  u16,   ///< token ids of llm.c shards
  i32,
  i64,
};

/// Bytes per element.
size_t dtype_size(DType dtype);
/// Lower-case name, e.g. "bf16".
std::string_view dtype_name(DType dtype);
/// Inverse of dtype_name; throws octet::Error on an unknown name.
DType dtype_from_name(std::string_view name);
/// True for e4m3 and e5m2.
constexpr bool is_fp8(DType d) { return d == DType::e4m3 || d == DType::e5m2; }
/// True for the floating types that ops accept as high-precision input (f32, bf16).
constexpr bool is_high_precision(DType d) { return d == DType::f32 || d == DType::bf16; }

/// Maps a C++ element type to its DType (for Tensor::data<T>() checks).
template <typename T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct dtype_of<int32_t> {
  static constexpr DType value = DType::i32;
};
template <>
struct dtype_of<int64_t> {
  static constexpr DType value = DType::i64;
};
template <>
struct dtype_of<uint16_t> {
  static constexpr DType value = DType::u16;
};

}  // namespace octet
