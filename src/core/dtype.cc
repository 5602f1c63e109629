#include "octet/core/dtype.h"

#include <array>

#include "octet/core/error.h"

namespace octet {
namespace {
struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t size;
};
constexpr std::array<DTypeInfo, 10> kDTypes{{
    {DType::f32, "f32", 4},
    {DType::bf16, "bf16", 2},
    {DType::f16, "f16", 2},
    {DType::e4m3, "e4m3", 1},
    {DType::e5m2, "e5m2", 1},
    {DType::e8m0, "e8m0", 1},
    {DType::u8, "u8", 1},
    {DType::u16, "u16", 2},
    {DType::i32, "i32", 4},
    {DType::i64, "i64", 8},
}};

const DTypeInfo& info(DType dtype) {
  for (const auto& i : kDTypes)
    if (i.dtype == dtype) return i;
  OCTET_ERROR("unknown dtype code ", static_cast<int>(dtype));
}
}  // namespace

size_t dtype_size(DType dtype) { return info(dtype).size; }
std::string_view dtype_name(DType dtype) { return info(dtype).name; }

DType dtype_from_name(std::string_view name) {
  for (const auto& i : kDTypes)
    if (i.name == name) return i.dtype;
  OCTET_ERROR("unknown dtype '", name, "'; expected one of f32, bf16, f16, e4m3, e5m2, e8m0, u8, u16, i32, i64");
}

}  // namespace octet
