// TensorCarver: many tensors of one dtype viewing one allocation.
#pragma once

#include <cstdint>
#include <vector>

#include "octet/core/tensor.h"

namespace octet {

/// Tensors of one dtype carved from one allocation: place() each piece (its shape and the tensors
/// that will view it), then allocate() once. On a GPU every allocation costs host time (a
/// cudaMallocAsync, later a cudaFreeAsync), so tensors made together, used together and dropped
/// together (an MoE layer's per-expert casts, the FP8 states' new scales) share one. The memory
/// is freed when the last view of any piece is dropped.
class TensorCarver {
 public:
  /// `alignment`: the bytes each piece's start is aligned to within the allocation (a positive
  /// multiple of the dtype's size; the allocation itself is at least as aligned on a GPU).
  TensorCarver(DType dtype, const Device& device, int64_t alignment);
  /// Reserves a piece of `shape`; allocate() makes `view`, and `also` when given, view it.
  void place(const Shape& shape, Tensor* view, Tensor* also = nullptr);
  /// Makes the one allocation (none when nothing was placed) and sets every placed view.
  void allocate();

 private:
  struct Piece {
    int64_t offset;  ///< in elements
    Shape shape;
    Tensor* view;
    Tensor* also;
  };
  DType dtype_;
  Device device_;
  int64_t alignment_elements_;
  int64_t end_ = 0;  ///< elements
  std::vector<Piece> pieces_;
};

}  // namespace octet
