#include "octet/core/carve.h"

#include "core/int_math.h"

namespace octet {

TensorCarver::TensorCarver(DType dtype, const Device& device, int64_t alignment)
    : dtype_(dtype), device_(device) {
  const auto element = static_cast<int64_t>(dtype_size(dtype));
  OCTET_CHECK(alignment > 0 && alignment % element == 0, "TensorCarver: an alignment of ",
              alignment, " bytes is not a positive multiple of ", dtype_name(dtype), "'s ",
              element);
  alignment_elements_ = alignment / element;
}

void TensorCarver::place(const Shape& shape, Tensor* view, Tensor* also) {
  const int64_t offset = round_up(end_, alignment_elements_);
  pieces_.push_back({offset, shape, view, also});
  end_ = offset + shape_numel(shape);
}

void TensorCarver::allocate() {
  if (pieces_.empty()) return;
  const Tensor flat = Tensor::empty({end_}, dtype_, device_);
  for (const Piece& p : pieces_) {
    *p.view = flat.slice(p.offset, p.offset + shape_numel(p.shape)).view(p.shape);
    if (p.also != nullptr) *p.also = *p.view;
  }
  pieces_.clear();
}

}  // namespace octet
