// TensorCarver: many tensors, of any dtypes, viewing one allocation.
#pragma once

#include <cstdint>
#include <vector>

#include "octet/core/tensor.h"

namespace octet {

/// The byte alignment of a fresh device allocation (cudaMalloc's), which cuBLASLt and the
/// kernels' vector loads may assume of a tensor's start: TensorCarver's default for its pieces.
inline constexpr int64_t kAllocationAlignment = 256;

/// Tensors carved from one allocation: place() each piece (its shape, dtype and the tensors that
/// will view it), then allocate() once. On a GPU every allocation costs host time (a
/// cudaMallocAsync, later a cudaFreeAsync), so tensors made together, used together and dropped
/// together (an FP8 copy and its scales, an MoE layer's per-expert casts, the FP8 states' new
/// scales) share one. The memory is freed when the last view of any piece is dropped.
class TensorCarver {
 public:
  /// `alignment`: the bytes each piece's start is aligned to within the allocation (positive, and
  /// a multiple of every placed dtype's size; the allocation itself is at least as aligned on a
  /// GPU).
  explicit TensorCarver(const Device& device, int64_t alignment = kAllocationAlignment);
  /// Reserves a piece of `shape` x `dtype`, after the pieces placed before it; allocate() makes
  /// `view`, and `also` when given, view it.
  void place(const Shape& shape, DType dtype, Tensor* view, Tensor* also = nullptr);
  /// Makes the one allocation (none when nothing was placed) and sets every placed view.
  void allocate();

 private:
  struct Piece {
    int64_t offset;  ///< in bytes
    Shape shape;
    DType dtype;
    Tensor* view;
    Tensor* also;
  };
  Device device_;
  int64_t alignment_;
  int64_t end_ = 0;  ///< bytes
  std::vector<Piece> pieces_;
};

}  // namespace octet
