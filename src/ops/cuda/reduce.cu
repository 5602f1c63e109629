// CUDA reductions. Sums run in a fixed order (per-tile partials, then a second pass over the
// partials in tile order), the same order as the CPU reference, so results match it bit for bit
// and never depend on scheduling. No float atomics (DESIGN.md rule 3).
#include <cstdint>

#include "core/nvtx.h"
#include "octet/core/cuda_context.h"
#include "octet/fp8/format.h"
#include "ops/reduce_backend.h"

namespace octet::ops::cuda {
namespace {

/// Columns per block of the first pass: one warp reads consecutive columns of a row (coalesced).
constexpr int kColumnsPerBlock = 32;
/// Tiles per block of the first pass (blockDim.y).
constexpr int kTilesPerBlock = 8;
/// Threads per block of the second pass, one column each.
constexpr int kSecondPassThreads = 256;
/// CUDA's limit on gridDim.y.
constexpr int64_t kMaxGridY = 65535;

template <typename T>
__device__ __forceinline__ float load_as_float(const T* x, int64_t i);
template <>
__device__ __forceinline__ float load_as_float<float>(const float* x, int64_t i) {
  return x[i];
}
template <>
__device__ __forceinline__ float load_as_float<uint16_t>(const uint16_t* x, int64_t i) {
  return fp8::decode_bf16(x[i]);
}

// ----------------------------------------------------------------------------
// CUDA kernels

/// partials[tile, c] = x[tile*tile_rows, c] + ... + x[min(rows, (tile+1)*tile_rows) - 1, c],
/// summed sequentially from 0.
template <typename T>
__global__ void sum_rows_tile_partials_kernel(const T* __restrict__ x, float* __restrict__ partials,
                                              int64_t rows, int64_t cols, int64_t tiles,
                                              int64_t tile_rows) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumnsPerBlock + threadIdx.x;
  const int64_t tile = static_cast<int64_t>(blockIdx.y) * kTilesPerBlock + threadIdx.y;
  if (c >= cols || tile >= tiles) return;
  const int64_t begin = tile * tile_rows;
  const int64_t end = min(rows, begin + tile_rows);
  float sum = 0.0f;
  for (int64_t r = begin; r < end; ++r) sum += load_as_float(x, r * cols + c);
  partials[tile * cols + c] = sum;
}

/// out[c] = (accumulate ? out[c] : 0) + partials[0, c] + partials[1, c] + ... in tile order.
__global__ void sum_rows_combine_kernel(const float* __restrict__ partials, float* __restrict__ out,
                                        int64_t cols, int64_t tiles, bool accumulate) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float sum = accumulate ? out[c] : 0.0f;
  for (int64_t tile = 0; tile < tiles; ++tile) sum += partials[tile * cols + c];
  out[c] = sum;
}

}  // namespace

// ----------------------------------------------------------------------------
// kernel launchers

void sum_rows(const Tensor& x, const Tensor& out, bool accumulate) {
  const Device& device = x.device();
  DeviceGuard guard(device);
  cudaStream_t stream = octet::cuda::stream(device);
  const int64_t rows = x.rows();
  const int64_t cols = x.cols();
  const int64_t tiles = (rows + kSumRowsTileRows - 1) / kSumRowsTileRows;
  const int64_t grid_y = (tiles + kTilesPerBlock - 1) / kTilesPerBlock;
  OCTET_CHECK(grid_y <= kMaxGridY, "sum_rows: at most ",
              kMaxGridY * kTilesPerBlock * kSumRowsTileRows, " rows are supported, got ", rows);
  // Stream-ordered workspace: freed on the same stream after the kernels that use it.
  Tensor partials = Tensor::empty({tiles, cols}, DType::f32, device);

  const dim3 block(kColumnsPerBlock, kTilesPerBlock);
  const dim3 grid(static_cast<unsigned>((cols + kColumnsPerBlock - 1) / kColumnsPerBlock),
                  static_cast<unsigned>(grid_y));
  if (x.dtype() == DType::f32) {
    sum_rows_tile_partials_kernel<<<grid, block, 0, stream>>>(
        static_cast<const float*>(x.raw_data()), partials.data<float>(), rows, cols, tiles,
        kSumRowsTileRows);
  } else {
    sum_rows_tile_partials_kernel<<<grid, block, 0, stream>>>(
        static_cast<const uint16_t*>(x.raw_data()), partials.data<float>(), rows, cols, tiles,
        kSumRowsTileRows);
  }
  OCTET_CHECK_LAUNCH();

  const auto combine_blocks =
      static_cast<unsigned>((cols + kSecondPassThreads - 1) / kSecondPassThreads);
  sum_rows_combine_kernel<<<combine_blocks, kSecondPassThreads, 0, stream>>>(
      partials.data<float>(), out.data<float>(), cols, tiles, accumulate);
  OCTET_CHECK_LAUNCH();
}

}  // namespace octet::ops::cuda
