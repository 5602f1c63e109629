#include "octet/core/carve.h"

#include <memory>

#include "core/int_math.h"

namespace octet {

TensorCarver::TensorCarver(const Device& device, int64_t alignment)
    : device_(device), alignment_(alignment) {
  OCTET_CHECK(alignment > 0, "TensorCarver: an alignment of ", alignment,
              " bytes is not positive");
}

void TensorCarver::place(const Shape& shape, DType dtype, Tensor* view, Tensor* also) {
  const auto element = static_cast<int64_t>(dtype_size(dtype));
  OCTET_CHECK(alignment_ % element == 0, "TensorCarver: an alignment of ", alignment_,
              " bytes is not a multiple of ", dtype_name(dtype), "'s ", element);
  const int64_t offset = round_up(end_, alignment_);
  pieces_.push_back({offset, shape, dtype, view, also});
  end_ = offset + shape_numel(shape) * element;
}

void TensorCarver::allocate() {
  if (pieces_.empty()) return;
  const auto storage = std::make_shared<Storage>(static_cast<size_t>(end_), device_);
  for (const Piece& p : pieces_) {
    *p.view = Tensor::view_of(storage, static_cast<size_t>(p.offset), p.shape, p.dtype);
    if (p.also != nullptr) *p.also = *p.view;
  }
  pieces_.clear();
}

}  // namespace octet
