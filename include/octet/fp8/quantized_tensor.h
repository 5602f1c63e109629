// QuantizedTensor: FP8 data of a 2-D tensor with its scales, row-wise and/or transposed.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "octet/core/carve.h"
#include "octet/core/tensor.h"

namespace octet::fp8 {

/// Tile sizes. 1x128/128x128 follow the DeepSeek-V3 block recipe that cuBLASLt's VEC128_32F and
/// BLK128x128_32F scale modes implement; 32 is the OCP MX block size.
inline constexpr int64_t kBlock = 128;
inline constexpr int64_t kMxBlock = 32;

/// How scale_inv maps onto the data. Shapes are for a [rows, cols] data matrix.
enum class ScalingMode : uint8_t {
  per_tensor,     ///< scale_inv f32[1]
  block_1x128,    ///< scale_inv f32[rows, ceil(cols/128)], one per 1x128 run of a row
  block_128x128,  ///< scale_inv f32[ceil(rows/128), ceil(cols/128)], one per 128x128 tile
  mxfp8_1x32,     ///< scale_inv e8m0[rows, ceil(cols/32)], one per 1x32 run of a row
};

std::string_view scaling_mode_name(ScalingMode mode);

/// Shape of the scale_inv tensor for data of shape [rows, cols] under `mode`.
Shape scale_shape(ScalingMode mode, int64_t rows, int64_t cols);
/// dtype of scale_inv under `mode` (e8m0 for mxfp8, f32 otherwise).
DType scale_dtype(ScalingMode mode);

/// Which copies a quantization writes.
struct Usage {
  bool rowwise = true;     ///< data [rows, cols]
  bool columnwise = false; ///< data_t [cols, rows]: the transposed copy Hopper's TN-only GEMMs need
};

/// A [rows, cols] high-precision matrix in FP8.
///
/// `data_t` is the transposed copy, quantized with its own scales laid out for the [cols, rows]
/// matrix: per_tensor shares the one scale; block_1x128 and mxfp8_1x32 quantize the columns of the
/// original (128x1 / 32x1 blocks) from the high-precision input, never from the row-wise copy;
/// block_128x128 uses the same tiles as the row-wise copy, so data_t holds exactly the row-wise
/// values transposed and scale_inv_t is the transposed tile grid.
struct QuantizedTensor {
  ScalingMode mode = ScalingMode::per_tensor;
  DType dtype = DType::e4m3;  ///< e4m3 or e5m2
  int64_t rows = 0;
  int64_t cols = 0;
  Tensor data;         ///< [rows, cols] FP8, or undefined without rowwise usage
  Tensor scale_inv;    ///< scales of data (see ScalingMode)
  Tensor data_t;       ///< [cols, rows] FP8, or undefined without columnwise usage
  Tensor scale_inv_t;  ///< scales of data_t, laid out for the [cols, rows] matrix

  /// Allocates the buffers (contents undefined) for a [rows, cols] matrix on `device`: one
  /// allocation for the row-wise copy and its scales, one for the transposed copy and its (with
  /// the scale per_tensor's copies share), as a GPU allocation costs host time.
  static QuantizedTensor allocate(int64_t rows, int64_t cols, DType dtype, ScalingMode mode,
                                  Usage usage, const Device& device);
  /// allocate() for a [rows[g], cols] matrix per group g, carved from the same two allocations
  /// instead of two per group: the experts of an MoE layer cast their rows every step. Every
  /// piece starts kGroupAlignment-aligned, as a fresh allocation would. A group of 0 rows gets
  /// an empty QuantizedTensor. The groups share memory: it is freed once every group has dropped
  /// that kind of copy (the row-wise copies of all experts, for instance).
  static std::vector<QuantizedTensor> allocate_groups(std::span<const int64_t> rows, int64_t cols,
                                                      DType dtype, ScalingMode mode, Usage usage,
                                                      const Device& device);
  /// Byte alignment of every piece that allocate_groups() carves (what cuBLASLt and the vector
  /// loads of the cast kernels want, and at least what the device allocator gives).
  static constexpr int64_t kGroupAlignment = kAllocationAlignment;
  bool has_rowwise() const { return data.defined(); }
  bool has_columnwise() const { return data_t.defined(); }
  const Device& device() const;
};

}  // namespace octet::fp8
