// cuBLASLt's scale-tensor layouts (part of the planner, src/ops/cuda/cublaslt.h): octet keeps
// compact scales per QuantizedTensor, and these kernels convert them to what cuBLASLt reads for
// VEC128_32F, BLK128x128_32F and VEC32_UE8M0, a pass over the scales only.
#include <cuda_runtime.h>

#include <cstdint>

#include "octet/core/cuda_context.h"
#include "octet/fp8/quantized_tensor.h"
#include "ops/cuda/cublaslt.h"
#include "ops/cuda/launch_util.cuh"

namespace octet::ops::cuda {
namespace {

/// cuBLASLt's scale tensors for VEC128_32F keep the outer dimension contiguous and padded to a
/// multiple of 4 (16 bytes of f32), and BLK128x128_32F pads the K-block count to a multiple of 4:
/// TransformerEngine's "GEMM_READY" scale shapes, which it hands to cuBLASLt unchanged
/// (transformer_engine/pytorch/tensor/float8_blockwise_tensor.py get_scale_shape;
/// common/transpose/quantize_transpose_vector_blockwise.cu), and the sizes in NVIDIA's sample
/// CUDALibrarySamples/cuBLASLt/Common/helpers.h getScaleTensorSize.
constexpr int64_t kScalePadding = 4;
/// A caller's 128x128 scale tensor is used in place only when 16-byte aligned (the granularity of
/// that padding); anything less is copied. The algorithm is keyed on the alignment it gets.
constexpr uintptr_t kScaleAlignment = 16;
/// VEC32_UE8M0 scales are stored in 128-row x 4-block tiles of 512 bytes, tiles in row-major
/// order, swizzled inside the tile: offset = tile * 512 + (row % 32) * 16 + (row % 128 / 32) * 4 +
/// block % 4, rows padded to 128 and blocks to 4. Source: nvmath-python
/// nvmath/linalg/advanced/helpers/matmul.py get_mxfp8_scale_offset, and the tile sizes of
/// CUDALibrarySamples getScaleTensorSize (which points to the cuBLAS guide's "1D block scaling
/// factors layout"); TransformerEngine's swizzle pads the same way (nvte_swizzle_scaling_factors:
/// "padded to 128x4").
constexpr int64_t kMxTileRows = 128;
constexpr int64_t kMxTileBlocks = 4;
constexpr int64_t kMxTileBytes = kMxTileRows * kMxTileBlocks;
constexpr int64_t kMxRowGroup = 32;
constexpr int64_t kMxRowBytes = kMxTileBlocks * (kMxTileRows / kMxRowGroup);  // 16

// ----------------------------------------------------------------------------
// CUDA kernels

// octet's compact 1x128 scales f32[rows, blocks] (row-major) -> VEC128_32F: block-major with the
// rows contiguous, out[block * ld + row], ld = rows padded to kScalePadding.
__global__ void scales_1x128_to_vec128_kernel(const float* in, float* out, int64_t rows,
                                              int64_t blocks, int64_t ld) {
  const int64_t i = global_index();
  if (i >= blocks * ld) return;
  const int64_t block = i / ld;
  const int64_t row = i % ld;
  out[i] = row < rows ? in[row * blocks + block] : 0.0f;
}

// octet's compact 128x128 scales f32[tiles, blocks] -> BLK128x128_32F: same orientation, the
// block count padded to kScalePadding (out[tile * ld + block]).
__global__ void scales_128x128_to_blk128_kernel(const float* in, float* out, int64_t tiles,
                                                int64_t blocks, int64_t ld) {
  const int64_t i = global_index();
  if (i >= tiles * ld) return;
  const int64_t tile = i / ld;
  const int64_t block = i % ld;
  out[i] = block < blocks ? in[tile * blocks + block] : 0.0f;
}

// octet's compact MXFP8 scales e8m0[rows, blocks] -> VEC32_UE8M0's swizzled 128x4 tiles. One
// thread per output byte, so padding bytes are written too (as 2^-127: they scale no data).
__global__ void scales_mxfp8_to_vec32_kernel(const uint8_t* in, uint8_t* out, int64_t rows,
                                             int64_t blocks, int64_t padded_blocks, int64_t total) {
  const int64_t i = global_index();
  if (i >= total) return;
  const int64_t tile = i / kMxTileBytes;
  const int64_t within = i % kMxTileBytes;
  const int64_t tiles_per_row = padded_blocks / kMxTileBlocks;
  // Inverse of within = (row % 32) * 16 + (row % 128 / 32) * 4 + block % 4.
  const int64_t row = (tile / tiles_per_row) * kMxTileRows + within / kMxRowBytes +
                      (within % kMxRowBytes) / kMxTileBlocks * kMxRowGroup;
  const int64_t block = (tile % tiles_per_row) * kMxTileBlocks + within % kMxTileBlocks;
  out[i] = (row < rows && block < blocks) ? in[row * blocks + block] : 0;
}


// ----------------------------------------------------------------------------
// kernel launchers

/// VEC128_32F scales for `x` (data [rows, cols], 1x128 blocks along cols).
Tensor vec128_scales(const GemmOperand& x, cudaStream_t stream) {
  const int64_t rows = x.data.rows();
  const int64_t blocks = ceil_div(x.data.cols(), fp8::kBlock);
  const int64_t ld = round_up(rows, kScalePadding);
  Tensor out = Tensor::empty({blocks, ld}, DType::f32, x.data.device());
  scales_1x128_to_vec128_kernel<<<grid_for(blocks * ld), kThreadsPerBlock, 0, stream>>>(
      x.scale_inv.data<float>(), out.data<float>(), rows, blocks, ld);
  OCTET_CHECK_LAUNCH();
  return out;
}

/// BLK128x128_32F scales for `x` (data [rows, cols], 128x128 tiles).
Tensor blk128_scales(const GemmOperand& x, cudaStream_t stream) {
  const int64_t tiles = ceil_div(x.data.rows(), fp8::kBlock);
  const int64_t blocks = ceil_div(x.data.cols(), fp8::kBlock);
  const int64_t ld = round_up(blocks, kScalePadding);
  Tensor out = Tensor::empty({tiles, ld}, DType::f32, x.data.device());
  scales_128x128_to_blk128_kernel<<<grid_for(tiles * ld), kThreadsPerBlock, 0, stream>>>(
      x.scale_inv.data<float>(), out.data<float>(), tiles, blocks, ld);
  OCTET_CHECK_LAUNCH();
  return out;
}

/// VEC32_UE8M0 scales for `x` (data [rows, cols], 1x32 blocks along cols).
Tensor vec32_scales(const GemmOperand& x, cudaStream_t stream) {
  const int64_t rows = x.data.rows();
  const int64_t blocks = ceil_div(x.data.cols(), fp8::kMxBlock);
  const int64_t padded_blocks = round_up(blocks, kMxTileBlocks);
  const int64_t total = round_up(rows, kMxTileRows) * padded_blocks;
  Tensor out = Tensor::empty({total}, DType::e8m0, x.data.device());
  scales_mxfp8_to_vec32_kernel<<<grid_for(total), kThreadsPerBlock, 0, stream>>>(
      static_cast<const uint8_t*>(x.scale_inv.raw_data()), static_cast<uint8_t*>(out.raw_data()),
      rows, blocks, padded_blocks, total);
  OCTET_CHECK_LAUNCH();
  return out;
}

}  // namespace

/// The scale pointer cuBLASLt reads for `x`, converting octet's compact layout where cuBLASLt's
/// differs. A converted copy comes from the stream-ordered pool into `storage`, which the caller
/// keeps until the matmul is enqueued; freeing it then is ordered after the matmul on the stream.
const void* lt_scale(const GemmOperand& x, Tensor& storage, cudaStream_t stream) {
  if (!is_fp8(x.data.dtype())) return nullptr;
  const Shape expected = fp8::scale_shape(x.mode, x.data.rows(), x.data.cols());
  OCTET_CHECK(x.scale_inv.defined() && x.scale_inv.dtype() == fp8::scale_dtype(x.mode) &&
                  x.scale_inv.numel() == shape_numel(expected),
              "gemm (CUDA): ", fp8::scaling_mode_name(x.mode), " scale_inv for ", x.data.describe(),
              " must be ", dtype_name(fp8::scale_dtype(x.mode)), shape_str(expected), ", got ",
              x.scale_inv.defined() ? x.scale_inv.describe() : std::string("none"));
  switch (x.mode) {
    case fp8::ScalingMode::per_tensor:
      return x.scale_inv.raw_data();  // the device scalar itself: no copy on the hot path
    case fp8::ScalingMode::block_1x128:
      storage = vec128_scales(x, stream);
      return storage.raw_data();
    case fp8::ScalingMode::block_128x128: {
      const bool padded = ceil_div(x.data.cols(), fp8::kBlock) % kScalePadding == 0;
      const bool aligned =
          reinterpret_cast<uintptr_t>(x.scale_inv.raw_data()) % kScaleAlignment == 0;
      if (padded && aligned) return x.scale_inv.raw_data();  // already cuBLASLt's layout
      storage = blk128_scales(x, stream);
      return storage.raw_data();
    }
    case fp8::ScalingMode::mxfp8_1x32:
      storage = vec32_scales(x, stream);
      return storage.raw_data();
  }
  OCTET_ERROR("gemm (CUDA): unknown scaling mode ", static_cast<int>(x.mode));
}


}  // namespace octet::ops::cuda
