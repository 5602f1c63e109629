// CUDA reductions. Sums run in a fixed order (per-tile partials, then a second pass over the
// partials in tile order), the same order as the CPU reference, so results match it bit for bit
// and never depend on scheduling. No float atomics (DESIGN.md rule 3).
#include <cstdint>

#include "core/nvtx.h"
#include "octet/core/cuda_context.h"
#include "octet/fp8/format.h"
#include "ops/cuda/launch_util.cuh"
#include "ops/reduce_backend.h"

namespace octet::ops::cuda {
namespace {

/// Threads per block of the first pass along the columns: one warp reads a row's consecutive
/// columns (kColumnsPerThread each: 128 contiguous bytes of bf16 per warp and row).
constexpr int kThreadsX = 32;
/// Tiles per block of the first pass (blockDim.y).
constexpr int kTilesPerBlock = 8;
/// Runs (of kSumRowsRunRows rows) whose loads a thread issues before adding them (in order): a
/// thread's sum is a sequential chain, so the bytes in flight per thread are what hide DRAM
/// latency. With 4 columns per thread, 2 runs put 256 bytes of bf16 in flight per thread: at
/// GPT-2 1.5B's 8192 x 1600 that is 6.5 MB over the GPU, four times what 8 rows of 2 columns
/// put there, a form that ran at a fifth of the copy rate (docs/PERFORMANCE.md, "Designs that
/// measured slower").
constexpr int kRunsInFlight = 2;
constexpr int kRowsInFlight = kRunsInFlight * static_cast<int>(kSumRowsRunRows);
/// Threads per block of the second pass, one column each: small blocks spread a bias's few
/// thousand columns over more SMs.
constexpr int kSecondPassThreads = 64;

/// kN consecutive elements of x starting at i (aligned to kN elements), as floats.
template <int kN, typename T>
__device__ __forceinline__ void load_floats(const T* x, int64_t i, float (&out)[kN]);
template <>
__device__ __forceinline__ void load_floats<1, float>(const float* x, int64_t i, float (&out)[1]) {
  out[0] = x[i];
}
template <>
__device__ __forceinline__ void load_floats<4, float>(const float* x, int64_t i, float (&out)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(x + i);
  out[0] = v.x;
  out[1] = v.y;
  out[2] = v.z;
  out[3] = v.w;
}
template <>
__device__ __forceinline__ void load_floats<4, uint16_t>(const uint16_t* x, int64_t i,
                                                         float (&out)[4]) {
  const uint2 v = *reinterpret_cast<const uint2*>(x + i);
  out[0] = fp8::decode_bf16(static_cast<uint16_t>(v.x & 0xFFFFu));
  out[1] = fp8::decode_bf16(static_cast<uint16_t>(v.x >> 16));
  out[2] = fp8::decode_bf16(static_cast<uint16_t>(v.y & 0xFFFFu));
  out[3] = fp8::decode_bf16(static_cast<uint16_t>(v.y >> 16));
}
template <>
__device__ __forceinline__ void load_floats<1, uint16_t>(const uint16_t* x, int64_t i,
                                                         float (&out)[1]) {
  out[0] = fp8::decode_bf16(x[i]);
}

// ----------------------------------------------------------------------------
// CUDA kernels

/// partials[tile, c] = the sum of column c over the tile's rows in sum_rows' order: runs of
/// kSumRowsRunRows rows, each summed sequentially from 0, then the run sums in order. Each thread
/// owns kCols adjacent columns (cols % kCols == 0) and loads kRunsInFlight runs at a time. Rows
/// past the tile load as 0: a run sum starts at +0 and so is never -0, and adding +0 to it, or
/// a +0 run sum to the tile's, changes no bit.
template <int kCols, typename T>
__global__ void sum_rows_tile_partials_kernel(const T* __restrict__ x, float* __restrict__ partials,
                                              int64_t rows, int64_t cols, int64_t tiles) {
  static_assert(kSumRowsTileRows % kRowsInFlight == 0, "a tile is whole groups of loads");
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreadsX + threadIdx.x) * kCols;
  const int64_t tile = static_cast<int64_t>(blockIdx.y) * kTilesPerBlock + threadIdx.y;
  if (c >= cols || tile >= tiles) return;
  const int64_t begin = tile * kSumRowsTileRows;
  const int64_t end = min(rows, begin + kSumRowsTileRows);
  float sum[kCols] = {};
  for (int64_t group = begin; group < end; group += kRowsInFlight) {
    float v[kRowsInFlight][kCols];
    if (group + kRowsInFlight <= end) {  // unconditional loads, so all are issued up front
#pragma unroll
      for (int j = 0; j < kRowsInFlight; ++j) load_floats<kCols>(x, (group + j) * cols + c, v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < kRowsInFlight; ++j) {
        if (group + j < end) {
          load_floats<kCols>(x, (group + j) * cols + c, v[j]);
        } else {
#pragma unroll
          for (int k = 0; k < kCols; ++k) v[j][k] = 0.0f;
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kRunsInFlight; ++q) {
      float run_sum[kCols] = {};
#pragma unroll
      for (int j = 0; j < kSumRowsRunRows; ++j) {
#pragma unroll
        for (int k = 0; k < kCols; ++k) run_sum[k] += v[q * kSumRowsRunRows + j][k];
      }
#pragma unroll
      for (int k = 0; k < kCols; ++k) sum[k] += run_sum[k];
    }
  }
#pragma unroll
  for (int k = 0; k < kCols; ++k) partials[tile * cols + c + k] = sum[k];
}

/// Partials whose loads a thread of the second pass issues before adding them (in order): the
/// pass has only one thread per column, so latency, not bandwidth, bounds it.
constexpr int kPartialsInFlight = 16;

/// out[c] = (accumulate ? out[c] : 0) + partials[0, c] + partials[1, c] + ... in tile order.
__global__ void sum_rows_combine_kernel(const float* __restrict__ partials, float* __restrict__ out,
                                        int64_t cols, int64_t tiles, bool accumulate) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float sum = accumulate ? out[c] : 0.0f;
  int64_t tile = 0;
  for (; tile + kPartialsInFlight <= tiles; tile += kPartialsInFlight) {
    float v[kPartialsInFlight];
#pragma unroll
    for (int j = 0; j < kPartialsInFlight; ++j) v[j] = partials[(tile + j) * cols + c];
#pragma unroll
    for (int j = 0; j < kPartialsInFlight; ++j) sum += v[j];
  }
  for (; tile < tiles; ++tile) sum += partials[tile * cols + c];
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

  // Four columns per thread (16-byte f32 / 8-byte bf16 loads) when every row start is aligned.
  constexpr int kQuad = 4;
  const bool quads =
      cols % kQuad == 0 &&
      reinterpret_cast<uintptr_t>(x.raw_data()) % (kQuad * dtype_size(x.dtype())) == 0;
  const int64_t columns_per_block = kThreadsX * (quads ? kQuad : 1);
  const dim3 block(kThreadsX, kTilesPerBlock);
  const dim3 grid(static_cast<unsigned>((cols + columns_per_block - 1) / columns_per_block),
                  static_cast<unsigned>(grid_y));
  const auto launch = [&](auto kernel, const auto* data) {
    kernel<<<grid, block, 0, stream>>>(data, partials.data<float>(), rows, cols, tiles);
  };
  if (x.dtype() == DType::f32) {
    const auto* data = static_cast<const float*>(x.raw_data());
    quads ? launch(sum_rows_tile_partials_kernel<kQuad, float>, data)
          : launch(sum_rows_tile_partials_kernel<1, float>, data);
  } else {
    const auto* data = static_cast<const uint16_t*>(x.raw_data());
    quads ? launch(sum_rows_tile_partials_kernel<kQuad, uint16_t>, data)
          : launch(sum_rows_tile_partials_kernel<1, uint16_t>, data);
  }
  OCTET_CHECK_LAUNCH();

  combine_row_partials(partials, out, accumulate);
}

void combine_row_partials(const Tensor& partials, const Tensor& out, bool accumulate) {
  const int64_t tiles = partials.rows(), cols = partials.cols();
  const auto blocks = static_cast<unsigned>((cols + kSecondPassThreads - 1) / kSecondPassThreads);
  sum_rows_combine_kernel<<<blocks, kSecondPassThreads, 0,
                            octet::cuda::stream(partials.device())>>>(
      partials.data<float>(), out.data<float>(), cols, tiles, accumulate);
  OCTET_CHECK_LAUNCH();
}

}  // namespace octet::ops::cuda
